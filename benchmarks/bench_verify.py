"""Speculative verification on shards vs gather-then-verify on 4 local gloo ranks (B=64,
V=129280, FP32 logits, k = 4 and 16 draft tokens).

Run: ``.venv/bin/python benchmarks/bench_verify.py [--iters N] [--k 4 16] [--quick]``. Both paths run in
the same processes on the same logits and drafts. ``sharded``: :func:`vocabpar.verify` on this
rank's shard (agreement check off, as in production). ``gather``: all-gather the ``B·(k+1)``
target rows (and, with draft logits, the ``B·k`` draft rows), then a single-device rejection
sampler on full probability tensors, as engines do. Times are the slowest rank's mean per step;
bytes are what one rank sends per step and ``coll`` the collectives per call (comm counters).
Target logits are N(0, 5²) (peaked); the draft's are the target's plus N(0, 1) noise; drafts are
the draft's argmax (one-hot rows) or drawn from its distribution (draft-logit rows). ``sample``:
one :func:`vocabpar.sample` call over the same stacked rows (``B·(k+1)``, plus ``B·k`` with draft
logits) and parameters, the yardstick for verification's local work; ``eager``: ``verify`` with
its passes eager (``VOCABPAR_COMPILE=0``, same tokens, asserted); ``reads``: host reads of device
values per call (``vocabpar.host_reads``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from vocabpar import SamplingParams, VocabLayout, comm, sample, verify
from vocabpar.kernels import fused
from vocabpar.launch import run

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

B, V, N = sized((64, 129280, 4), (8, 8192, 2))

CONFIGS = {  # name: (params, with draft logits)
    "greedy": (SamplingParams(temperature=0), False),
    "top-p 0.9, one-hot drafts": (SamplingParams(top_p=0.9), False),
    "top-p 0.9, draft logits": (SamplingParams(top_p=0.9), True),
    "t0.8 k50, draft logits": (SamplingParams(temperature=0.8, top_k=50), True),
}


def _full_logits(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same full target ``[B, k+1, V]`` and draft ``[B, k, V]`` logits on every rank."""
    g = torch.Generator().manual_seed(k)
    target = torch.randn(B, k + 1, V, generator=g) * 5.0
    return target, target[:, :k] + torch.randn(B, k, V, generator=g)


def _shard(full: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    ids = layout.local_token_ids(comm.rank())
    return torch.where(ids >= 0, full[..., ids.clamp(min=0)], float("-inf"))


def _gather(local: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    rows = local.reshape(-1, local.shape[-1])
    full = comm.all_gather(rows).permute(1, 0, 2).reshape(rows.shape[0], -1)[:, layout.sharded_to_full()[:V]]
    return full.view(*local.shape[:-1], V)


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Full probability rows after temperature, top-k and top-p (a sort per row)."""
    z = logits / params.temperature
    values, order = z.sort(-1, descending=True)
    if params.top_k:
        values[..., params.top_k:] = float("-inf")
    p = values.softmax(-1)
    if params.top_p < 1:
        p = p.masked_fill(p.cumsum(-1) - p > params.top_p, 0)
        p = p / p.sum(-1, keepdim=True)
    return torch.zeros_like(p).scatter_(-1, order, p)


def _gather_then_verify(local_t, local_d, layout, params, drafts) -> torch.Tensor:
    """The engines' path: gathered logits, full probability tensors, a rejection sampler (the
    probabilities are built 8 batch rows at a time, to fit this machine's memory)."""
    k = drafts.shape[1]
    full_t = _gather(local_t, layout)
    if params.temperature == 0:
        target = full_t.argmax(-1)
        return (drafts == target[:, :k]).long().cumprod(1).sum(1)
    full_d = None if local_d is None else _gather(local_d, layout)
    out = []
    for rows in torch.arange(B).split(8):
        p = _probs(full_t[rows], params)
        d = drafts[rows]
        if full_d is None:
            q = torch.zeros(len(rows), k, V).scatter_(-1, d[..., None], 1.0)
        else:
            q = _probs(full_d[rows], params)
        px, qx = p[:, :k].gather(-1, d[..., None])[..., 0], q.gather(-1, d[..., None])[..., 0]
        accepted = (torch.rand(len(rows), k) * qx < px).long().cumprod(1).sum(1)
        pick = torch.cat([(p[:, :k] - q).clamp(min=0), p[:, k:]], 1)[torch.arange(len(rows)), accepted]
        out.append(torch.multinomial(pick / pick.sum(-1, keepdim=True), 1))
    return torch.cat(out)


def _bench(iters: int, ks: list[int]) -> dict:
    with stored_passes() as eager:
        out = _cases(iters, ks)
    return out | {"note": passes_note(eager)}


def _cases(iters: int, ks: list[int]) -> dict:
    layout = VocabLayout(V, N)
    pos = torch.arange(B) * 3
    out = {}
    for k in ks:
        full_t, full_d = _full_logits(k)
        local_t, local_d = _shard(full_t, layout), _shard(full_d, layout)
        g = torch.Generator().manual_seed(7)
        drafts_of = {}
        for name, (params, drafted) in CONFIGS.items():
            if drafted:
                drafts_of[name] = torch.cat([torch.multinomial(_probs(full_d[rows], params).view(-1, V), 1,
                                                               generator=g).view(-1, k)
                                             for rows in torch.arange(B).split(8)])
            else:
                drafts_of[name] = full_d.argmax(-1)
        del full_t, full_d
        for name, (params, drafted) in CONFIGS.items():
            drafts = drafts_of[name]
            p = SamplingParams(**{**params.__dict__, "seed": list(range(B))})
            dl = local_d if drafted else None

            def sharded(t=local_t, p=p, d=drafts, dl=dl):
                return verify(t, layout, p, d, positions=pos, draft_logits=dl, check=False)

            def gathered(t=local_t, q=params, d=drafts, dl=dl):
                return _gather_then_verify(t, dl, layout, q, d)

            rows = [local_t.reshape(B * (k + 1), -1)] + ([] if dl is None else [dl.reshape(B * k, -1)])
            stacked, stacked_params = torch.cat(rows), SamplingParams(**{**params.__dict__, "seed": 1})
            stacked_pos = torch.arange(stacked.shape[0])

            def sample_stacked(x=stacked, q=stacked_params, at=stacked_pos):
                return sample(x, layout, q, positions=at, check=False)

            result = sharded()
            accepted = result.accepted.double().mean().item()
            reads = host_reads(sharded)
            with fused.compiling(False):
                assert torch.equal(sharded().tokens, result.tokens)
                eager = seconds(sharded, iters)
            out[k, name] = {"sharded": measure(sharded, iters), "gather": measure(gathered, iters),
                            "sample": measure(sample_stacked, iters), "eager": eager,
                            "reads": reads, "accepted": accepted}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--k", type=int, nargs="+", default=sized([4, 16], [4]))
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = ap.parse_args()
    per_rank = run(_bench, N, args.iters, args.k, run_timeout=3600, timeout=600, threads_per_rank=1)
    show(f"B={B} V={V} ranks={N} gloo, FP32; time = slowest rank, mean of {args.iters} steps; "
         f"bytes = sent per rank per step; accepted = mean drafts kept per row (sharded); g coll = "
         f"collectives of gather-then-verify; {per_rank[0]['note'] or 'passes compiled'}")
    rows, times, sent = [], {}, {}
    for k in args.k:
        for name in CONFIGS:
            r0 = per_rank[0][k, name]
            t = {p: max(r[k, name][p][0] for r in per_rank) for p in ("sharded", "gather", "sample")}
            eager = max(r[k, name]["eager"] for r in per_rank)
            reads = max(r[k, name]["reads"] for r in per_rank)
            calls = max(r[k, name]["sharded"][2] for r in per_rank)
            gathered = max(r[k, name]["gather"][2] for r in per_rank)
            b = (r0["sharded"][1], r0["gather"][1])
            times[f"k={k} {name}"], sent[f"k={k} {name}"] = (t["sharded"], t["gather"]), b
            rows.append([name, k, calls, reads, ms(t["sharded"]), ms(t["gather"]),
                         over(t["gather"], t["sharded"]), f"{b[0]:,}", f"{b[1]:,}", ratio(b[1], b[0]),
                         f"{r0['accepted']:.2f}", ms(t["sample"]), over(t["sharded"], t["sample"]), ms(eager),
                         over(eager, t["sharded"]), gathered])
    table(["config", "k", "coll", "reads", "sharded ms", "gather ms", "speed-up", "sharded B", "gather B",
           "bytes x", "accepted", "sample ms", "v/sample", "eager ms", "eag/cmp", "g coll"], rows,
          drop=["g coll", "sample ms", "eager ms", "eag/cmp", "v/sample", "accepted", "gather B"])
    bottom_line(verdict("verification on shards", "gather-then-verify", f"B={B}", times, sent))


if __name__ == "__main__":
    main()
