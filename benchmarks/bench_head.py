"""LM head and logits collection benchmark: 4 gloo ranks, V=129280, H=1024.

Side by side from one run: prefill of 8 sequences x 512 tokens, head on all rows vs the last
row of each sequence; DP attention with 64 rows per rank, logits returned by all-to-all vs
SGLang's all-gather-then-scatter (exact bytes, wall ratio); B=1024 FP32 logits consumed chunk
by chunk (chunk_rows=64) vs collected whole (peak RSS per rank); PyTorch DTensor ColwiseParallel
head with replicated output vs our all_gather at B=256.

    .venv/bin/python benchmarks/bench_head.py [--ranks 4] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import QUICK_HELP, bottom_line, bytes_of, factor, fmt_bytes, ms, over, show, sized, table, timed  # noqa: E402

from vocabpar import (  # noqa: E402
    ParallelLMHead,
    VocabLayout,
    comm,
    compute_logits,
    iter_logits,
    rss,  # noqa: E402
    select_rows,
)
from vocabpar.collect import padded_local, to_token_order  # noqa: E402
from vocabpar.launch import run  # noqa: E402

V, H = sized((129280, 1024), (8192, 256))
SEQS, SEQ_LEN = sized((8, 512), (4, 128))  # the prefill
WIDE, DECODE = sized((1024, 256), (1024, 64))  # rows of the chunked-logits and DTensor comparisons


def peak_rss_delta(fn) -> int:
    """Bytes by which this process's peak RSS rises above its current RSS while ``fn`` runs (0
    where it does not)."""
    rss.reset_peak()
    before = rss.status_bytes("VmRSS")
    fn()
    return max(0, rss.status_bytes("VmHWM") - before)  # below 0: noise, RSS shrank meanwhile


def bench(reps: int) -> dict:
    n, me = comm.world_size(), comm.rank()
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    head = ParallelLMHead(VocabLayout(V, n), H, dtype=torch.bfloat16)
    head.load_full_weight(weight)
    res: dict = {}
    # 1. prefill: all 4096 rows vs the 8 last rows (local shard logits: the head's own cost)
    hidden = torch.randn(SEQS * SEQ_LEN, H, generator=g).to(torch.bfloat16)
    seq_lens = torch.full((SEQS,), SEQ_LEN)
    res["prefill"] = {
        "all rows": timed(lambda: compute_logits(head, hidden, strategy="none"), 1, warmup=0),
        "last rows": timed(lambda: compute_logits(head, select_rows(hidden, seq_lens), strategy="none"),
                           reps),
    }
    # 2. DP attention, 64 rows per rank
    mine = torch.randn(64, H, generator=torch.Generator().manual_seed(me)).to(torch.bfloat16)
    res["dp"] = {}
    for scatter in ("all_to_all", "all_gather"):
        step = lambda s=scatter: compute_logits(head, mine, strategy="dp_gather_scatter", scatter=s)
        res["dp"][scatter] = (timed(step, reps), bytes_of(step))
    assert torch.equal(compute_logits(head, mine, strategy="dp_gather_scatter", scatter="all_to_all"),
                       compute_logits(head, mine, strategy="dp_gather_scatter", scatter="all_gather"))
    # the part the two strategies differ in: returning rows from precomputed [n*64, shard] logits
    local = padded_local(head, torch.randn(64 * n, H, generator=g).to(torch.bfloat16))
    layout = head.layout
    res["dp_exchange"] = {
        "all_to_all": timed(lambda: to_token_order(comm.all_to_all(local, [64] * n, [64] * n)
                                                    .view(n, 64, layout.shard_width), layout), reps),
        "all_gather": timed(lambda: to_token_order(comm.all_gather(local), layout)[me * 64: (me + 1) * 64],
                            reps)}
    # 3. B=1024 FP32: per-row reduction of full-vocab logits, chunked vs whole
    rows = torch.randn(WIDE, H, generator=g).to(torch.bfloat16)

    def whole():
        return torch.logsumexp(compute_logits(head, rows, strategy="all_gather"), dim=1)

    def chunked():
        out = torch.empty(WIDE)
        for part, logits in iter_logits(head, rows, strategy="all_gather", chunk_rows=64):
            out[part] = torch.logsumexp(logits, dim=1)
        return out

    assert torch.allclose(whole(), chunked())
    res["memory"] = {"chunked (chunk_rows=64)": peak_rss_delta(chunked), "whole": peak_rss_delta(whole)}
    # 4. DTensor ColwiseParallel head, replicated output, vs ours at B=256
    batch = torch.randn(DECODE, H, generator=g).to(torch.bfloat16)
    res["dtensor"] = {"vocabpar all_gather (fp32 logits)":
                      timed(lambda: compute_logits(head, batch, strategy="all_gather"), reps),
                      "DTensor ColwiseParallel (bf16 logits)": timed(_dtensor_head(weight, batch), reps)}
    return res if me == 0 else {}


def _dtensor_head(weight: torch.Tensor, batch: torch.Tensor):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (comm.world_size(),))
    linear = torch.nn.Linear(H, V, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(weight)
    linear = parallelize_module(linear, mesh, ColwiseParallel(output_layouts=Replicate()))

    def step():
        with torch.no_grad():
            return linear(batch)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=sized(4, 2))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = parser.parse_args()
    res = run(bench, args.ranks, args.reps, timeout=900, run_timeout=1800)[0]
    show(f"### LM head: {args.ranks} gloo ranks, V={V}, H={H}, bf16 weights, FP32 logits")
    p = res["prefill"]
    show(f"prefill {SEQS} x {SEQ_LEN} tokens: head on all {SEQS * SEQ_LEN} rows {ms(p['all rows'])} ms, "
         f"on the {SEQS} last rows {ms(p['last rows'], 2)} ms: {over(p['all rows'], p['last rows'], 0)}")
    table(["DP attention, 64 rows/rank", "ms", "sent / rank 0", "received / rank 0"],
          [[f"dp_gather_scatter, scatter={scatter}", ms(sec), fmt_bytes(sent), fmt_bytes(recv)]
           for scatter, (sec, (sent, recv)) in res["dp"].items()])
    a2a, ag = res["dp"]["all_to_all"], res["dp"]["all_gather"]
    e = res["dp_exchange"]
    show(f"all_to_all is {factor(a2a[0], ag[0])} end to end (head GEMM included) and receives "
         f"{factor(a2a[1][1], ag[1][1], 'fewer bytes', 'more bytes')} than all-gather-then-scatter; the row "
         f"return alone "
         f"(precomputed logits): {ms(e['all_to_all'])} ms vs {ms(e['all_gather'])} ms, "
         f"{over(e['all_gather'], e['all_to_all'], 2)}")
    m = res["memory"]
    chunked, whole = m["chunked (chunk_rows=64)"], m["whole"]
    show(f"B={WIDE} FP32 logits, per-row logsumexp: peak RSS rise chunked {fmt_bytes(chunked)} vs whole "
         f"{fmt_bytes(whole)}: {chunked / max(whole, 1):.3f} of unchunked")
    d = res["dtensor"]
    ours, theirs = d["vocabpar all_gather (fp32 logits)"], d["DTensor ColwiseParallel (bf16 logits)"]
    show(f"B={DECODE} head + all-gather: vocabpar {ms(ours)} ms (FP32 logits), DTensor ColwiseParallel "
         f"{ms(theirs)} ms (bf16 logits): {over(theirs, ours, 2)}")
    bottom_line(f"prefill head on the last rows {factor(p['last rows'], p['all rows'])} than on all rows; DP "
                f"attention's all-to-all receives {factor(a2a[1][1], ag[1][1], 'fewer bytes', 'more bytes')} "
                f"than all-gather-then-scatter ({factor(a2a[0], ag[0])}); chunked logits' peak RSS rise "
                f"{chunked / max(whole, 1):.2f} of whole")

if __name__ == "__main__":
    main()
