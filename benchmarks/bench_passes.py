"""Where a sampler call's local time goes: each fused pass (``vocabpar.sampling.fused``, compiled)
against the rest (eager glue: candidates, gathers of listed tokens, small ops), on 4 local gloo
ranks (B=256, V=129280, FP32; the configurations and logits of ``bench_sampling.py``).

Run: ``.venv/bin/python benchmarks/bench_passes.py``. Per configuration and sampler (the functional
``sample()`` and the engine ``Sampler``), after two warm-up calls, one call with every pass timed
(wall ms on the slowest rank, 2 ranks per core) beside the floor (one row-max pass plus an
all-gather of 16 bytes per row); ``coll``: collectives per call, ``reads``: host reads of device
values per call (busiest rank; counted in a further, untimed call). Then, side by side, the
functional call with the threshold search's rounds always on the listed bucket and as shipped.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import torch

from vocabpar import SamplingParams, VocabLayout, comm, sample
from vocabpar.launch import run
from vocabpar.sampling import Sampler, fused, search

sys.path.insert(0, str(Path(__file__).parent))
import bench_sampling as bs  # noqa: E402

NAMES = ("top-p 0.9 (flat)", "top-p 0.9 (zipf)", "top-k 1000 (peaked)", "min-p 0.1 (flat)",
         "top-p 0.9 (peaked)")


def _listed_and_default(fn) -> tuple[float, float, bool]:
    """Seconds of one call of ``fn`` (a ``sample()``) with the threshold search's rounds always on
    its listed bucket, then as shipped (in place when the bucket holds over ``1 / DENSE_SHARE`` of
    the shard), each after a warm-up call; and whether both draw the same tokens."""
    shipped, seconds, tokens = search.DENSE_SHARE, [], []
    for share in (1, shipped):
        search.DENSE_SHARE = share
        fn()
        torch.distributed.barrier()
        start = time.perf_counter()
        tokens.append(fn().tokens)
        seconds.append(time.perf_counter() - start)
    search.DENSE_SHARE = shipped
    return seconds[0], seconds[1], torch.equal(*tokens)


def _job(names: tuple[str, ...]) -> dict:
    layout = VocabLayout(bs.V, bs.N)
    pos = torch.arange(bs.B)
    sampler = Sampler(layout, max_rows=bs.B)
    spent: collections.Counter = collections.Counter()
    call = fused.Fused.__call__

    def timed(self, *args):
        start = time.perf_counter()
        out = call(self, *args)
        spent[self.__name__] += time.perf_counter() - start
        return out

    out = {}
    for name in names:
        kind, params = bs.CONFIGS[name]
        local = bs._logits(kind, layout)
        p = SamplingParams(**{**params.__dict__, "seed": list(range(bs.B))})
        batch = sampler.prepare(p, positions=pos)
        paths = (("func", lambda local=local, p=p: sample(local, layout, p, positions=pos, check=False)),
                 ("engine", lambda local=local, batch=batch: sampler.sample(local, batch)))
        for which, fn in paths:
            fn()
            fn()
            fused.Fused.__call__ = timed
            spent.clear()
            torch.distributed.barrier()
            start = time.perf_counter()
            fn()
            total = time.perf_counter() - start
            fused.Fused.__call__ = call
            start = time.perf_counter()
            bs._floor(local)
            floor = time.perf_counter() - start
            with comm.recording() as sent:  # an untimed call: the read counter slows every op
                reads = bs._reads(fn)
            out[name, which] = (total, dict(spent), floor, len(sent), reads)
        out[name, "search"] = _listed_and_default(paths[0][1])
    return out


def main() -> None:
    per_rank = run(_job, bs.N, NAMES, run_timeout=1800, timeout=300)
    print(f"B={bs.B} V={bs.V} ranks={bs.N} gloo, FP32; one call, slowest rank; ms")
    for key in [k for k in per_rank[0] if k[1] != "search"]:
        total, spent, floor, calls, _ = max(per_rank, key=lambda r: r[key][0])[key]
        reads = max(r[key][4] for r in per_rank)
        passes = sum(spent.values())
        top = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]))
        print(f"{key[0]:<22}{key[1]:<7} coll {calls} reads {reads:>3}  total {total * 1e3:6.0f}  "
              f"passes {passes * 1e3:5.0f}  rest {(total - passes) * 1e3:5.0f}  "
              f"floor {floor * 1e3:5.1f} | {top}")

    print(f"functional sample(), the search's rounds on the listed bucket vs as shipped (in place when "
          f"the bucket holds over 1/{search.DENSE_SHARE} of the shard); one call each, slowest rank; ms")
    for name in NAMES:
        listed, shipped = (max(r[name, "search"][i] for r in per_rank) for i in (0, 1))
        equal = all(r[name, "search"][2] for r in per_rank)
        print(f"{name:<22} listed {listed * 1e3:6.0f}  shipped {shipped * 1e3:6.0f}  "
              f"({listed / shipped:.2f}x)  same tokens: {equal}")


if __name__ == "__main__":
    main()
