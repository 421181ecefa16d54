"""vLLM with the vocabpar plugin: the decode step samples on the tensor-parallel group's
vocabulary shards instead of gathering the logits.

    python examples/vllm_offline.py MODEL [TP]

The plugin is installed with vocabpar (an entry point vLLM loads in every process) and switched
on here by ``additional_config``; ``VOCABPAR_VLLM=1`` in the environment does the same for every
engine. On a CPU build of vLLM the defaults below size the KV cache and pin one core per rank.
"""

import os
import sys

if __name__ == "__main__":  # vLLM spawns its workers: this script must be importable without effect
    tp = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(tp))) if tp > 1 else "nobind")

    from vllm import LLM, SamplingParams

    llm = LLM(sys.argv[1], tensor_parallel_size=tp, max_model_len=256, max_num_seqs=8,
              additional_config={"vocabpar": {}})
    params = [SamplingParams(temperature=0, max_tokens=16),
              SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=1,
                             max_tokens=16, logprobs=5)]
    for out in llm.generate(["The vocabulary of a model", "Tensor parallelism splits"], params):
        sample = out.outputs[0]
        print(f"{out.prompt!r} -> {sample.text!r}")
        if sample.logprobs:
            top = sorted(sample.logprobs[0].items(), key=lambda kv: kv[1].rank)
            print("  first token's top logprobs:", [(k, round(v.logprob, 3)) for k, v in top])
