import os

# A 2-thread OpenMP team spins at its barriers: when another process holds one of the two cores,
# a 1-rank sweep went from 0.6 s to 13-35 s. Waiting threads that sleep keep the suite's time
# stable on a shared machine; set before torch loads (here, and in every rank through the
# forkserver's environment).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# The sampler's passes compile on first use in each process (seconds each); the suite's many short
# rank processes run them eager, which gives the same bits. tests/test_fused.py compiles them and
# checks compiled == eager == reference.
os.environ.setdefault("VOCABPAR_COMPILE", "0")

from vocabpar import launch  # noqa: E402

# Importing transformers' model code takes seconds of CPU per process, and many launches of the
# suite build the demo's Hugging Face models on every rank: the forkserver imports it once, before
# it forks the first rank, and every rank starts with it (skipped where transformers is missing).
launch.preload("transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
               "transformers.models.qwen2.modeling_qwen2")
