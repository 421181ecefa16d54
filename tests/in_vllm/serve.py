"""Serve the tiny model with vLLM and the vocabpar plugin, run the test scenarios, write results.

``python serve.py MODEL TP OUT``: one engine at tensor parallelism TP with the plugin switched on
(``additional_config``). At TP 2 each scenario runs twice in the same engine: first with the
plugin's ``mode='gather'`` (vLLM gathers the logits and samples them with its own sampler, the
plugin only counting), then ``mode='shards'``, recording every sharded step's gathered logits and
inputs. At TP 1 only ``shards`` runs. OUT receives ``results.json`` (tokens, logprobs, texts and
the per-rank counters of each mode) and ``records.pt`` (rank 0's records)."""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with the functions below

PROMPTS = ["the red is", "the shard of", "a model and", "the engine"]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                            "size": {"enum": ["small", "large"]}},
          "required": ["color", "size"], "additionalProperties": False}


def scenarios():
    """name -> (prompts, one SamplingParams per prompt)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    greedy = SamplingParams(temperature=0, max_tokens=12)
    sampled = [
        SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=11, max_tokens=12),
        SamplingParams(temperature=0.8, min_p=0.1, seed=12, max_tokens=12),
        SamplingParams(temperature=1.2, top_p=0.8, min_p=0.02, seed=13, max_tokens=12,
                       repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, frequency_penalty=0.3),
    ]
    json_output = SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return {
        "greedy": (PROMPTS, [greedy] * 4),
        "greedy_penalties": (PROMPTS, [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.4,
                                                      presence_penalty=0.6, frequency_penalty=0.5)] * 4),
        "logprobs": (PROMPTS, [SamplingParams(temperature=0, max_tokens=6, logprobs=5)] * 4),
        "sampled": (PROMPTS, sampled),
        "json": (PROMPTS[:2], [json_output] * 2),
        # greedy, so that vLLM's own sampler gives the same tokens: a bias, allowed ids, a third
        # of the vocabulary held back as stop ids for 6 tokens (then the first one stops the row)
        "constraints": (PROMPTS, [
            SamplingParams(temperature=0, max_tokens=8, logit_bias={17: 6.0, 40: -3.0, 333: 2.5}),
            SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=list(range(50, 120))),
            SamplingParams(temperature=0, max_tokens=8, min_tokens=6, stop_token_ids=list(range(0, 1000, 3))),
            SamplingParams(temperature=0, max_tokens=8, logit_bias={3: 4.0},
                           allowed_token_ids=list(range(300)), min_tokens=4,
                           stop_token_ids=list(range(1, 1000, 4)), repetition_penalty=1.3)]),
        "fallback": (PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=6,
                                                  bad_words=["red", "model"])] * 2),
    }


def sampling_of(runner):
    from vocabpar.integrations.vllm import sampling_of

    return sampling_of(runner)


def configure(worker, changes):
    return dict(vars(sampling_of(worker.model_runner).configure(**changes)))


def counters(worker):
    stats = sampling_of(worker.model_runner).stats
    return {"sharded_steps": stats.sharded_steps, "fallback_steps": dict(stats.fallback_steps),
            "sharded_bytes": stats.sharded_bytes, "gathered_bytes": stats.gathered_bytes,
            "step_gathers": stats.step_gathers}


def save_records(worker, path):
    """Rank 0 writes its records to ``path`` (the RPC reply carries plain values only)."""
    import torch

    sampling = sampling_of(worker.model_runner)
    if sampling.tp_rank == 0:
        torch.save(sampling.records, path)
    return len(sampling.records)


def run(llm):
    """Each scenario's outputs, and the counters each scenario added, per rank."""
    results = {}
    for name, (prompts, params) in scenarios().items():
        before = llm.collective_rpc(counters)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        after = llm.collective_rpc(counters)
        results[name] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "texts": [o.outputs[0].text for o in outputs],
            "logprobs": [[{str(k): v.logprob for k, v in step.items()}
                          for step in o.outputs[0].logprobs or []] for o in outputs],
            "counters": [_delta(a, b) for a, b in zip(after, before)],
        }
    return results


def _delta(after, before):
    out = {k: after[k] - before[k] for k in after if k != "fallback_steps"}
    was = before["fallback_steps"]
    out["fallback_steps"] = {k: v - was.get(k, 0) for k, v in after["fallback_steps"].items()
                             if v != was.get(k, 0)}
    return out


def main(model, tp, out):
    from vllm import LLM

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r) for r in range(tp)) if tp > 1 else "0-1"
    started = time.time()
    llm = LLM(model, tensor_parallel_size=tp, dtype="float32", max_model_len=256, max_num_seqs=8,
              enforce_eager=True, seed=0, additional_config={"vocabpar": {"mode": "shards"}})
    results = {"start_s": time.time() - started}
    if tp > 1:
        llm.collective_rpc(configure, args=({"mode": "gather", "record": False},))
        results["gather"] = run(llm)
    llm.collective_rpc(configure, args=({"mode": "shards", "record": True},))
    results["shards"] = run(llm)
    llm.collective_rpc(save_records, args=(os.path.join(out, "records.pt"),))
    results["total_s"] = time.time() - started
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
