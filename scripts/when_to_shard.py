"""Where the engine ``Sampler`` wins, by the planner: per model, mode and sampling configuration,
its estimated decode step beside the fastest tensor-parallel design that holds the same weights per
rank and collects the logits, at batches 1 to 1024, and the batches at which the engine is faster.

    python scripts/when_to_shard.py                                   # the README's models, 8 ranks
    python scripts/when_to_shard.py --presets llama-3.1-8b --modes eager --ranks 4

The README's "When to use it" quotes this script's output (recorded in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json

from vocabpar.cli import main
from vocabpar.plan.crossover import COLLECTING

GATHERING = tuple(d.name for d in COLLECTING)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CONFIGS = {"greedy": [],
           "T0.8 k50 p0.95 min-p 0.05": ["--temperature", "0.8", "--top-k", "50", "--top-p", "0.95",
                                         "--min-p", "0.05"],
           "min-p 0.1": ["--temperature", "1", "--min-p", "0.1"],
           "top-p 0.9": ["--temperature", "1", "--top-p", "0.9"]}


def step_times(preset: str, ranks: int, mode: str, batch: int, flags: list[str]) -> dict[str, float]:
    """Each design's estimated decode step in µs, from ``vocabpar plan --json``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--preset", preset, "--tp", str(ranks), "--mode", mode, "--batch", str(batch), "--json",
              *flags])
    return {d["name"]: d["step_time_s"] * 1e6 for d in json.loads(out.getvalue())["designs"]}


def run(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="llama-3.1-70b,deepseek-v3,gemma-3-27b")
    ap.add_argument("--modes", default="graph,eager")
    ap.add_argument("--ranks", type=int, default=8)
    args = ap.parse_args(argv)
    print(f"{args.ranks} ranks; per batch: engine µs / fastest collecting design µs (its name at B=256)")
    for preset in args.presets.split(","):
        for mode in args.modes.split(","):
            for name, flags in CONFIGS.items():
                cells, wins, best_at_256 = [], [], ""
                for batch in BATCHES:
                    t = step_times(preset, args.ranks, mode, batch, flags)
                    best = min(GATHERING, key=t.__getitem__)
                    cells.append(f"{batch}:{t['vocabpar-engine']:.0f}/{t[best]:.0f}")
                    wins += [batch] if t["vocabpar-engine"] < t[best] else []
                    best_at_256 = best if batch == 256 else best_at_256
                print(f"{preset} {mode} {name}: engine fastest at B in {wins or 'none'} (vs {best_at_256})")
                print("  " + " ".join(cells))


if __name__ == "__main__":
    run()
