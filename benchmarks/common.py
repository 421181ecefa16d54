"""Shared timing helpers for the benchmarks (run inside vocabpar.launch ranks), and their
``--quick`` switch."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from vocabpar import comm

T = TypeVar("T")
QUICK_ENV = "VOCABPAR_BENCH_QUICK"
QUICK = os.environ.get(QUICK_ENV) == "1" or "--quick" in sys.argv[1:]
"""``--quick``: every benchmark at small sizes (2 ranks, a 16k vocabulary), a smoke test whose
ratios are only indicative. Kept in the environment because each rank imports the script
afresh and must see the same sizes."""
if QUICK:
    os.environ[QUICK_ENV] = "1"

QUICK_HELP = "small sizes (2 ranks, V=8192): every table in seconds, ratios only indicative"


def sized(full: T, quick: T) -> T:
    """``quick`` under ``--quick``, else ``full``."""
    return quick if QUICK else full


def timed(fn: Callable[[], object], reps: int, warmup: int = 2, sync: bool = True) -> float:
    """Median seconds per call of ``fn``; with ``sync`` all ranks start each call together and
    the slowest rank's time counts (max over ranks)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if sync and dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    median = statistics.median(samples)
    if sync and dist.is_initialized():
        t = torch.tensor([median])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # bookkeeping only: not counted as traffic
        median = t.item()
    return median


def bytes_of(fn: Callable[[], object]) -> tuple[int, int]:
    """(sent, received) bytes this rank moves during one call of ``fn``."""
    comm.reset_traffic()
    fn()
    return comm.total_bytes()


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def seconds(fn: Callable[[], object], iters: int) -> float:
    """``fn``'s mean seconds per call on this rank over ``iters`` calls, each started together with
    the other ranks, without a warm-up (for paths with nothing to warm, e.g. eager ones)."""
    total = 0.0
    for _ in range(iters):
        comm.all_reduce(torch.zeros(1))  # barrier
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    return total / iters


def measure(fn: Callable[[], object], iters: int) -> tuple[float, int, int]:
    """``fn``'s mean seconds per call on this rank over ``iters`` calls, each started together
    with the other ranks (a one-float all-reduce as barrier), after one warm-up; and the bytes
    this rank sends and the collectives it takes part in per call (comm counters)."""
    fn()
    comm.reset_traffic()
    fn()
    sent = comm.total_bytes()[0]
    calls = sum(c.calls for c in comm.traffic().values())
    return seconds(fn, iters), sent, calls
