"""Scoring a long prompt on vocab shards: 4 gloo ranks, V=129280, T=8192, H=1024, FP32.

Per rank: seeded FP32 hidden rows [T, H] and target ids [T] (the same on every rank), an FP32
``ParallelLMHead`` on ``VocabLayout(V, 4)``. Both paths walk the prompt in chunks of 256 rows
and run in the same processes on the same inputs, side by side:

* sharded: ``iter_logits(strategy="none", chunk_rows=256)`` and ``token_logprobs`` on each
  [256, V/4] local block (2 collectives per chunk, plus the 256-byte agreement check);
* gather (what engines do): ``compute_logits(strategy="all_gather")`` per chunk, i.e. full
  [256, V] FP32 rows on every rank, then ``log_softmax``, the targets' values and ``topk``;
* head: the local head GEMM per chunk alone, the floor both paths share;
* eager: the sharded path with top-n, its compiled pass (the rank keys) run eager
  (``vocabpar.kernels.fused``; the results are asserted equal).

Times are a full scoring pass (head GEMM included), slowest rank, median of ``--reps``
passes after a one-chunk warm-up; bytes and calls are exact ``vocabpar.comm`` counters per rank
per pass, the agreement checks apart; the peak RSS rise is measured per rank over one pass
(after ``gc.collect()`` and ``malloc_trim``, so memory freed earlier cannot hide it) and
compared with one [T, V/4] FP32 block, the local shard of unchunked logits.

    .venv/bin/python benchmarks/bench_logprobs.py [--reps 1] [--quick] [--mmap-threshold BYTES]

``--quick`` is a smoke test with T=1024 on 2 ranks and V=8192 (the default run takes ~4 min
on 2 cores);
``--mmap-threshold 1048576`` shows how much of the RSS rise is glibc keeping freed temporaries
(its times are not comparable: every temporary then costs an mmap and fresh page faults).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    QUICK_HELP,
    bottom_line,
    factor,
    fmt_bytes,
    host_reads,
    ms,
    passes_note,
    show,
    sized,
    stored_passes,
    table,
)

from vocabpar import (  # noqa: E402
    ParallelLMHead,
    TokenLogprobs,
    VocabLayout,
    comm,
    compute_logits,
    iter_logits,
    rss,
    token_logprobs,
)
from vocabpar.kernels import fused  # noqa: E402
from vocabpar.launch import run  # noqa: E402

V, H, N = sized((129280, 1024, 4), (8192, 256, 2))
T, CHUNK = 8192, 256
TOP_NS = (0, 5)

try:
    _libc = ctypes.CDLL("libc.so.6")
    _trim = _libc.malloc_trim
except (OSError, AttributeError):  # not glibc: the rise may then be under-reported
    _libc = _trim = None


def _settle() -> None:
    gc.collect()
    if _trim is not None:
        _trim(0)


def _setup(tokens: int):
    layout = VocabLayout(V, comm.world_size())
    g = torch.Generator().manual_seed(0)
    head = ParallelLMHead(layout, H)
    weight = torch.randn(V, H, generator=g) / H ** 0.5  # 0.5 GB, once per rank, dropped below
    head.load_full_weight(weight)
    del weight
    hidden = torch.randn(tokens, H, generator=g) * 2.0  # logits ~ N(0, 4): LSE ~ 13.7
    targets = torch.randint(0, V, (tokens,), generator=g)
    _settle()
    return layout, head, hidden, targets


def _sharded(head, layout, hidden, targets, top_n: int) -> TokenLogprobs:
    parts = []
    for rows, local in iter_logits(head, hidden, strategy="none", chunk_rows=CHUNK):
        parts.append(token_logprobs(local, layout, targets[rows], top_n=top_n))
        del local  # else the loop variable keeps this chunk alive while the next one is computed
    return TokenLogprobs.concat(parts)


def _head_only(head, hidden) -> None:
    """The floor both paths share: the local head GEMM per chunk, logits dropped."""
    for _rows, local in iter_logits(head, hidden, strategy="none", chunk_rows=CHUNK):
        del local


def _gathered(head, hidden, targets, top_n: int) -> dict[str, torch.Tensor]:
    rows_total = hidden.shape[0]
    out = {"logprobs": torch.empty(rows_total), "lse": torch.empty(rows_total),
           "top_ids": torch.empty(rows_total, top_n, dtype=torch.long),
           "top_logprobs": torch.empty(rows_total, top_n)}
    for start in range(0, rows_total, CHUNK):
        rows = slice(start, min(start + CHUNK, rows_total))
        full = compute_logits(head, hidden[rows], strategy="all_gather")  # [chunk, V] FP32
        logp = torch.log_softmax(full, dim=1)
        picked = targets[rows, None]
        out["logprobs"][rows] = logp.gather(1, picked)[:, 0]
        out["lse"][rows] = full.gather(1, picked)[:, 0] - out["logprobs"][rows]  # for the check only
        if top_n:
            out["top_logprobs"][rows], out["top_ids"][rows] = logp.topk(top_n, 1)
        del full, logp
    return out


def _measure(fn, reps: int) -> dict:
    """``reps`` timed passes; the first also books the traffic and the peak RSS rise. Returns
    this rank's median seconds per pass, the counters, the RSS rise and the last result."""
    seconds, result, traffic, rise = [], None, None, 0
    for rep in range(reps):
        result = None
        _settle()
        if rep == 0:
            comm.reset_traffic()
            rss.reset_peak()
            before = rss.status_bytes("VmRSS")
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
        if rep == 0:
            rise = rss.status_bytes("VmHWM") - before
            traffic = {k: (c.calls, c.sent, c.received) for k, c in comm.traffic().items()}
    return {"s": statistics.median(seconds), "traffic": traffic, "rise": rise, "result": result}


def bench(tokens: int, reps: int, mmap_threshold: int) -> dict:
    with stored_passes() as eager:
        out = _paths(tokens, reps, mmap_threshold)
    return out | {"note": passes_note(eager)}


def _paths(tokens: int, reps: int, mmap_threshold: int) -> dict:
    if mmap_threshold and _libc is not None:
        _libc.mallopt(-3, mmap_threshold)  # M_MMAP_THRESHOLD; also stops glibc's dynamic raising
    layout, head, hidden, targets = _setup(tokens)
    res: dict = {"shard_width": layout.shard_width, "trimmed": _trim is not None}
    # warm-up on one chunk of each path, and an exact check of the ranks on it (outside timing)
    first = slice(0, CHUNK)
    res["reads"] = {}
    for top_n in TOP_NS:
        chunk = lambda k=top_n: _sharded(head, layout, hidden[first], targets[first], k)  # noqa: E731
        a = chunk()
        res["reads"][top_n] = host_reads(chunk)  # of one chunk's call (untimed: the counter slows ops)
        _gathered(head, hidden[first], targets[first], top_n)
    full = compute_logits(head, hidden[first], strategy="all_gather")
    chosen = full.gather(1, targets[first, None])
    res["ranks equal"] = bool(torch.equal(a.ranks, (full > chosen).sum(1) + 1))
    del full
    res["head"] = _measure(lambda: _head_only(head, hidden), reps)
    res["compile s"] = sum(fused.COMPILE_SECONDS.values())  # in the warm-up
    for top_n in TOP_NS:
        s = _measure(lambda k=top_n: _sharded(head, layout, hidden, targets, k), reps)
        g = _measure(lambda k=top_n: _gathered(head, hidden, targets, k), reps)
        a, b = s.pop("result"), g.pop("result")
        if top_n:  # the top-n's keys are a compiled pass: the same pass eager, the same results
            with fused.compiling(False):
                e = _measure(lambda k=top_n: _sharded(head, layout, hidden, targets, k), reps)
            c = e.pop("result")
            res["eager equal"] = all(torch.equal(getattr(a, f), getattr(c, f))
                                     for f in ("logprobs", "ranks", "top_ids", "top_logprobs"))
            res["eager"] = e
        lse = b["lse"].abs().max().item()
        diff = (a.logprobs - b["logprobs"]).abs().max().item()
        top_diff = (a.top_logprobs - b["top_logprobs"]).abs().max().item() if top_n else 0.0
        res[top_n] = {"sharded": s, "gather": g, "diff": diff, "top diff": top_diff, "max |lse|": lse,
                      "top ids equal": int((a.top_ids == b["top_ids"]).all(1).sum()) if top_n else tokens}
    # slowest rank's median (bookkeeping all-reduce: not through vocabpar.comm, so never counted)
    measured = [res["head"], res["eager"]] + [res[k][p] for k in TOP_NS for p in ("sharded", "gather")]
    t = torch.tensor([m["s"] for m in measured], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    for m, slowest in zip(measured, t.tolist()):
        m["s"] = slowest
    return res


def _received(traffic: dict) -> int:
    return sum(c[2] for k, c in traffic.items() if k not in comm.OVERHEAD)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1, help="timed passes per path (median; default 1)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_HELP}; T={CHUNK * 4}")
    parser.add_argument("--mmap-threshold", type=int, default=0, metavar="BYTES",
                        help="fix glibc's mmap threshold in every rank (mallopt), so freed temporaries "
                             "go back to the OS at once; 0 (default): glibc's dynamic threshold")
    args = parser.parse_args()
    tokens = CHUNK * 4 if args.quick else T
    per_rank = run(bench, N, tokens, args.reps, args.mmap_threshold, timeout=900, run_timeout=1800)
    r0 = per_rank[0]
    chunks = -(-tokens // CHUNK)
    shard_block, full_block = tokens * r0["shard_width"] * 4, tokens * V * 4
    allocator = f"mmap threshold fixed at {args.mmap_threshold:,} B" if args.mmap_threshold \
        else "glibc default allocator"
    show(f"T={tokens} V={V} H={H} ranks={N} gloo, FP32 head, {chunks} chunks of {CHUNK} rows; ms = full "
         f"pass, slowest rank, median of {args.reps}; bytes = received per rank per pass; {allocator}; "
         f"{r0['note'] or 'passes compiled'}")
    show(f"unchunked gather would hold [T, V] FP32 = {fmt_bytes(full_block)} per rank; "
         f"one [T, V/{N}] FP32 block (the local shard) = {fmt_bytes(shard_block)}")
    rows = [("head", "-", [r["head"] for r in per_rank])]
    rows += [(path, top_n, [r[top_n][path] for r in per_rank])
             for top_n in TOP_NS for path in ("sharded", "gather")]
    rows.append(("eager", max(TOP_NS), [r["eager"] for r in per_rank]))
    cells = []
    for path, top_n, measured in rows:
        m = measured[0]
        calls = {k: c[0] for k, c in m["traffic"].items()}
        agr = m["traffic"].get("agreement", (0, 0, 0))
        rise = max(r["rise"] for r in measured)
        cells.append([path, top_n, ms(m["s"], 0), f"{max(_received(r['traffic']) for r in measured):,}",
                      calls.get("all_gather", 0), calls.get("all_reduce", 0), f"{agr[2]:,}", agr[0],
                      fmt_bytes(rise), f"{rise / shard_block:.3f}"])
    table(["path", "top_n", "ms/pass", "received B", "all_gather", "all_reduce", "agreement B", "(calls)",
           "peak RSS rise", "/ [T,V/n]"], cells, drop=["agreement B", "(calls)"])
    for top_n in TOP_NS:
        s, g = r0[top_n]["sharded"], r0[top_n]["gather"]
        rs, rg = (max(r[top_n][p]["rise"] for r in per_rank) for p in ("sharded", "gather"))
        per_call = ", ".join(f"{k} {c[2] // chunks:,} B" for k, c in sorted(s["traffic"].items()))
        bytes_x = _received(g["traffic"]) / _received(s["traffic"])
        show(f"top_n={top_n}: gather/sharded: time {g['s'] / s['s']:.2f}x, bytes {bytes_x:,.0f}x, "
             f"peak RSS rise {rg / max(rs, 1):.1f}x; "
             f"[T, V/{N}] block / sharded rise {shard_block / max(rs, 1):.1f}x (target >= 8x)")
        head = r0["head"]["s"]
        reads = max(r["reads"][top_n] for r in per_rank)
        show(f"  sharded: {reads} host reads per chunk's call (busiest rank)")
        show(f"  beyond the head GEMM ({head * 1e3:.0f} ms): sharded {(s['s'] - head) * 1e3:.0f} ms, gather "
             f"{(g['s'] - head) * 1e3:.0f} ms ({(g['s'] - head) / max(s['s'] - head, 1e-9):.1f}x); sharded, "
             f"received per chunk (1 call each): {per_call}")
    head, top = r0["head"]["s"], max(TOP_NS)
    extra = {name: (r0[top][name]["s"] if name != "eager" else r0["eager"]["s"]) - head
             for name in ("sharded", "eager")}
    plain = r0[0]["sharded"]["s"] - head
    equal, compiling = all(r["eager equal"] for r in per_rank), max(r["compile s"] for r in per_rank)
    show(f"sharded beyond the head GEMM, top_n={top} / top_n=0: {extra['sharded'] / plain:.2f}x compiled "
         f"(target <= 2x), {extra['eager'] / plain:.2f}x eager (results equal: {equal}); "
         f"compile s {compiling:.1f}")
    for top_n in TOP_NS:
        v = r0[top_n]
        show(f"check top_n={top_n}: max |logprob diff| {v['diff']:.2e} (max |LSE| {v['max |lse|']:.1f}, "
             f"relative {v['diff'] / v['max |lse|']:.1e})"
             + (f", max |top-logprob diff| {v['top diff']:.2e}, top ids equal on "
                f"{v['top ids equal']}/{tokens} rows" if top_n else ""))
    ranks_ok = all(r["ranks equal"] for r in per_rank)
    show(f"ranks of the first chunk equal to counting on full rows: {ranks_ok}; "
         f"malloc_trim before each pass: {r0['trimmed']}")
    s, g = r0[0]["sharded"], r0[0]["gather"]
    rise = max(r[0]["sharded"]["rise"] for r in per_rank)
    memory = f"peak RSS rise {fmt_bytes(rise)}, {rise / shard_block:.2f} of one [T, V/{N}] block"
    bottom_line(f"scoring T={tokens} tokens on shards {factor(s['s'], g['s'])} than gather + log-softmax, "
                f"{factor(_received(s['traffic']), _received(g['traffic']), 'fewer bytes', 'more bytes')} "
                f"received; {memory}")

if __name__ == "__main__":
    main()
