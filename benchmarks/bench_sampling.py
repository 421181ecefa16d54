"""Distributed sampling vs gather-then-sample on 4 local gloo ranks (B=256, V=129280, FP32).

Run: ``.venv/bin/python benchmarks/bench_sampling.py [--iters N] [--quick]``. For each configuration the
three paths -- the functional ``sample()`` (adaptive), the engine ``Sampler`` (fixed script, no
host read, its check folded in) and gather-then-sample -- run in the same processes on the same
logits, the first two with their local passes compiled (``vocabpar.kernels.fused``; the first
call of each pass in each rank compiles it, in the warm-up, and ``compile s`` is that time) and
eager (``VOCABPAR_COMPILE=0``: the same tokens, asserted); ``reads`` counts host reads of device
values per call (``vocabpar.host_reads``: each one a device synchronisation on a GPU); times are
the slowest rank's mean per step, bytes are what one rank sends per step and ``coll`` the
collectives per ``sample()`` call (comm
counters; the per-call agreement check is off, as in production -- it adds one 256-byte
all-gather), and ``x floor`` divides by the floor: one local pass over the shard (row max) plus
one all-gather of 16 bytes per row. Logit families: peaked = N(0, 5²); flat = N(0, 0.5²); zipf =
per row a random permutation of -1.1·log(1 + rank) plus N(0, 0.1²) noise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from vocabpar import SamplingParams, VocabLayout, comm, sample
from vocabpar.kernels import fused
from vocabpar.launch import run
from vocabpar.sampling import Sampler

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    QUICK_HELP,
    bottom_line,
    host_reads,
    measure,
    ms,
    over,
    passes_note,
    ratio,
    seconds,
    show,
    sized,
    stored_passes,
    table,
    verdict,
)

B, V, N = sized((256, 129280, 4), (32, 8192, 2))

CONFIGS = {
    "greedy": ("peaked", SamplingParams(temperature=0)),
    "t0.8 k50 p0.95 minp0.05": ("peaked", SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05)),
    "top-p 0.9 (peaked)": ("peaked", SamplingParams(top_p=0.9)),
    "top-p 0.9 (zipf)": ("zipf", SamplingParams(top_p=0.9)),
    "top-p 0.9 (flat)": ("flat", SamplingParams(top_p=0.9)),
    "top-k 1000 (peaked)": ("peaked", SamplingParams(top_k=1000)),
    "min-p 0.1 (flat)": ("flat", SamplingParams(min_p=0.1)),
}
RUN = sized(tuple(CONFIGS), ("greedy", "t0.8 k50 p0.95 minp0.05", "top-p 0.9 (flat)", "top-k 1000 (peaked)",
                             "min-p 0.1 (flat)"))
"""The configurations measured (``--quick``: five, one per path of the sampler)."""


def _logits(kind: str, layout: VocabLayout) -> torch.Tensor:
    """This rank's shard of the family's full [B, V] logits (the same full rows on every rank)."""
    g = torch.Generator().manual_seed(1)
    if kind == "zipf":  # top-p 0.9 keeps ~1e4 tokens
        full = torch.stack([-1.1 * torch.log1p(torch.randperm(V, generator=g).float()) for _ in range(B)])
        full += torch.randn(B, V, generator=g) * 0.1
    else:  # sigma 5: top-p 0.9 keeps ~94 tokens (median); sigma 0.5: ~85 % of V
        full = torch.randn(B, V, generator=g) * (5.0 if kind == "peaked" else 0.5)
    ids = layout.local_token_ids(comm.rank())
    return torch.where(ids >= 0, full[:, ids.clamp(min=0)], float("-inf"))


def _gather_then_sample(local: torch.Tensor, layout: VocabLayout,
                        params: SamplingParams) -> torch.Tensor:
    full = comm.all_gather(local).permute(1, 0, 2).reshape(B, -1)[:, layout.sharded_to_full()[:V]]
    if params.temperature == 0:
        return full.argmax(1)
    logits = full / params.temperature
    values, order = logits.sort(1, descending=True)
    if params.top_k:
        values[:, params.top_k:] = float("-inf")
    probs = values.softmax(1)
    if params.top_p < 1:
        drop = probs.cumsum(1) - probs > params.top_p
        values = values.masked_fill(drop, float("-inf"))
    if params.min_p:
        cut = values[:, :1] + torch.log(torch.tensor(params.min_p))
        values = values.masked_fill(values < cut, float("-inf"))
    picked = torch.multinomial(values.softmax(1), 1)
    return order.gather(1, picked)[:, 0]


def _floor(local: torch.Tensor) -> torch.Tensor:
    pairs = torch.stack([local.max(1).values.double().view(torch.long), torch.zeros(B).long()], 1)
    return comm.all_gather(pairs)


def _bench(iters: int) -> dict:
    with stored_passes() as eager:
        out = _configs(iters)
    return out | {"note": passes_note(eager)}


def _configs(iters: int) -> dict:
    layout = VocabLayout(V, N)
    sampler = Sampler(layout, max_rows=B)
    pos = torch.arange(B)
    out = {}
    for name in RUN:
        kind, params = CONFIGS[name]
        local = _logits(kind, layout)
        p = SamplingParams(**{**params.__dict__, "seed": list(range(B))})
        batch = sampler.prepare(p, positions=pos)
        functional = lambda local=local, p=p: sample(local, layout, p, positions=pos, check=False)  # noqa: E731
        engine = lambda local=local, batch=batch: sampler.sample(local, batch)  # noqa: E731
        assert torch.equal(functional().tokens, engine().tokens)
        with fused.compiling(False):
            assert torch.equal(functional().tokens, engine().tokens)
            eager = {"sharded eager": seconds(functional, iters), "engine eager": seconds(engine, iters)}
        out[name] = {
            "floor": measure(lambda local=local: _floor(local), iters),
            "sharded": measure(functional, iters),
            "engine": measure(engine, iters),
            **eager,
            "gather": measure(lambda local=local, q=params: _gather_then_sample(local, layout, q), iters),
            "reads": (host_reads(functional), host_reads(engine)),
        }
    out["compile"] = dict(fused.COMPILE_SECONDS)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=sized(3, 2))
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = ap.parse_args()
    per_rank = run(_bench, N, args.iters, run_timeout=1800, timeout=300)
    show(f"B={B} V={V} ranks={N} gloo, FP32; time = slowest rank, mean of {args.iters} steps; "
         f"bytes = sent per rank per step; {per_rank[0]['note'] or 'passes compiled'}")
    show("functional sample() (adaptive) vs gather-then-sample")
    rows, times, sent = [], {}, {}
    for name in RUN:
        t = {k: max(r[name][k][0] for r in per_rank) for k in ("floor", "sharded", "gather")}
        eager = max(r[name]["sharded eager"] for r in per_rank)
        b = {k: per_rank[0][name][k][1] for k in ("sharded", "gather")}
        calls = max(r[name]["sharded"][2] for r in per_rank)
        reads = max(r[name]["reads"][0] for r in per_rank)
        times[name], sent[name] = (t["sharded"], t["gather"]), (b["sharded"], b["gather"])
        rows.append([name, calls, reads, ms(t["sharded"]), ms(t["gather"]), over(t["gather"], t["sharded"]),
                     f"{b['sharded']:,}", f"{b['gather']:,}", ratio(b["gather"], b["sharded"]),
                     over(t["sharded"], t["floor"]), over(t["gather"], t["floor"]), ms(eager),
                     over(eager, t["sharded"])])
    table(["config", "coll", "reads", "sharded ms", "gather ms", "speed-up", "sharded B", "gather B",
           "bytes x", "sh/floor", "ga/floor", "eager ms", "eag/cmp"], rows,
          drop=["ga/floor", "eager ms", "eag/cmp", "gather B", "sh/floor"])  # coll, reads, bytes stay
    show("\nengine Sampler (fixed script, check folded in) vs the functional sample()")
    rows = []
    for name in RUN:
        t = {k: max(r[name][k][0] for r in per_rank) for k in ("floor", "sharded", "engine")}
        calls = max(r[name]["engine"][2] for r in per_rank)
        reads = max(r[name]["reads"][1] for r in per_rank)
        eager = max(r[name]["engine eager"] for r in per_rank)
        rows.append([name, calls, reads, ms(t["engine"]), f"{per_rank[0][name]['engine'][1]:,}",
                     over(t["engine"], t["floor"]), over(t["engine"], t["sharded"]), ms(eager),
                     over(eager, t["engine"])])
    table(["config", "coll", "reads", "engine ms", "engine B", "eng/floor", "eng/func", "eager ms",
           "eag/cmp"], rows, drop=["eager ms", "eag/cmp", "eng/func"])
    floor = max(r["greedy"]["floor"][0] for r in per_rank)
    show(f"floor (row max + all-gather of 16 B/row): {floor * 1e3:.1f} ms")
    passes = sorted({p for r in per_rank for p in r["compile"]})
    compile_s = {p: max(r["compile"].get(p, 0.0) for r in per_rank) for p in passes}
    show(f"compile s (first call of each pass, slowest rank; {sum(compile_s.values()):.1f} s in all): "
         + (", ".join(f"{p} {s:.1f}" for p, s in compile_s.items()) or "none compiled"))
    bottom_line(verdict("sampling on shards", "gather-then-sample", f"B={B}", times, sent))


if __name__ == "__main__":
    main()
