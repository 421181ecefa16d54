"""The engine step compiled whole, per plan: kernels per call beside the eager launches, the
collectives and the bytes each rank receives -- what graph mode prices.

Run: ``.venv/bin/python benchmarks/bench_graph.py [--quick]`` (a second either way: it prints
counts and no ms -- the compiled step's time is a GPU's, and none is here). Kernels are the
planner's data (``vocabpar/plan/host_work.json``), counted by ``scripts/count_launches.py
--compiled``: each ``Sampler.sample`` / ``verify`` call compiled whole
(``torch.compile(fullgraph=True)``, Inductor, ``STEP_OPTIONS``) on two gloo ranks, its program's
generated kernels plus the ATen operations left in it, collectives apart
(``tests/test_host_work.py`` compiles the greedy plan again and compares). Eager launches and
host reads are the same file's eager count of the same call (the engine reads none; the step's
one copy of its ids is every design's). Collectives and bytes are the plan's fixed script
(:func:`vocabpar.wire.scripts.engine_sample_script`), priced for Llama 3.1 70B's vocabulary on 8
ranks at ``max_rows`` = 256 (quick: 16) with the search digits a CUDA Sampler picks; the kernel
budget is the one the compiled step was built to: greedy 10, the certified sampled plan 30, a
search plan 48, ``verify`` 60.
"""

from __future__ import annotations

import sys
from pathlib import Path

from vocabpar.layout import VocabLayout
from vocabpar.plan import host
from vocabpar.plan.machine import link
from vocabpar.presets import preset
from vocabpar.wire.filters import Sampling
from vocabpar.wire.scripts import choose_search_bits, engine_plan, engine_sample_script, price

sys.path.insert(0, str(Path(__file__).parent))
from common import bottom_line, fmt_bytes, show, sized, table  # noqa: E402

RANKS, ROWS = 8, sized(256, 16)
PLANS = {  # name: (sampling, kernel budget)
    "greedy": (Sampling(), 10),
    "T0.8 / k50 / p0.95 / min-p 0.05": (Sampling(0.8, top_k=50, top_p=0.95, min_p=0.05), 30),
    "top-p 0.9": (Sampling(1.0, top_p=0.9), 48),
    "top-k 1000": (Sampling(1.0, top_k=1000), 48),
    "min-p 0.1": (Sampling(1.0, min_p=0.1), 48),
}


def script_of(s: Sampling, vocab: int) -> tuple[str, int, int]:
    """The host-work entry, collectives and bytes each rank receives of a ``sample`` call of
    ``ROWS`` rows sampling as ``s``."""
    widest = VocabLayout(vocab, RANKS).shard_width
    plan = engine_plan(ROWS, RANKS, widest, vocab, greedy=[s.greedy], values=s.values(),
                       search_bits=choose_search_bits(ROWS, RANKS, *link("cuda", None, None)))
    traffic = price(engine_sample_script(plan), RANKS)
    return s.key(vocab, s.candidates(RANKS, widest)), traffic.collectives, traffic.bytes


def main() -> None:
    vocab = preset("llama-3.1-70b").vocab_size
    rows, over_budget = [], []
    for name, (sampling, budget) in PLANS.items():
        key, collectives, received = script_of(sampling, vocab)
        kernels = host.entry("engine_graph", key)[0]
        eager = host.entry("engine", key)[0]
        reads = host.entry("engine", key)[1]
        rows.append([f"sample: {name}", str(kernels), str(budget), str(eager), str(reads), str(collectives),
                     fmt_bytes(received)])
        over_budget += [name] * (kernels > budget)
    for name, draft in (("verify, one-hot drafts", False), ("verify, draft logits", True)):
        key = script_of(PLANS["T0.8 / k50 / p0.95 / min-p 0.05"][0], vocab)[0]
        kernels = host.entry("engine_graph_verify", host.verify_name(key, draft))[0]
        eager = host.entry("engine_verify", host.verify_name(key, draft))[0]
        reads = host.entry("engine_verify", host.verify_name(key, draft))[1]
        rows.append([f"{name} (certified plan)", str(kernels), "60", str(eager), str(reads), "", ""])
        over_budget += [name] * (kernels > 60)
    for name, entry in (("sample: greedy + top-5 logprobs", "sample+logprobs"),
                        ("token_logprobs, top 5", "token_logprobs+top_n")):
        kernels = host.entry("engine_graph_score", entry)[0]
        rows.append([name, str(kernels), "48", "", "", "", ""])
        over_budget += [name] * (kernels > 48)
    counted = host.load(host.DATA)["header"]
    show(f"Engine Sampler per call, compiled whole vs eager; Llama 3.1 70B vocabulary ({vocab}), {RANKS} "
         f"ranks, max_rows {ROWS}. Kernels counted from the compiled programs on two ranks "
         f"({counted['compiled_date']}, torch {counted['torch']}).")
    header = ["call", "kernels compiled", "budget", "launches eager", "host reads", "collectives",
              "received / rank"]
    table(header, rows)
    most = max(int(r[1]) for r in rows)
    fewest = min(int(r[3]) / int(r[1]) for r in rows if r[3])
    verdict = "every plan within its budget" if not over_budget else "over budget: " + ", ".join(over_budget)
    bottom_line(f"the compiled engine step runs at most {most} kernels per call, at least {fewest:.0f}x "
                f"fewer than eager; {verdict}")


if __name__ == "__main__":
    main()
