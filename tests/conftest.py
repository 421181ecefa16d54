from vocabpar import launch

# Importing transformers' model code takes seconds of CPU per process, and many launches of the
# suite build the demo's Hugging Face models on every rank: the forkserver imports it once, before
# it forks the first rank, and every rank starts with it (skipped where transformers is missing).
launch.preload("transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
               "transformers.models.qwen2.modeling_qwen2")
