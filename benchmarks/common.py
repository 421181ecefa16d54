"""Shared helpers of the benchmarks: timing (run inside vocabpar.launch ranks), the ``--quick``
switch, and what they print: prose and tables fitted to ``WIDTH`` (100) columns, a bottom line
per benchmark (``vocabpar bench`` lists them at the end), and the same text unwrapped with every
table whole, as markdown, in the file ``REPORT_ENV`` names (``vocabpar bench`` sets it: its
``--out`` report)."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from vocabpar import comm
from vocabpar.bench import BOTTOM, REPORT_ENV, WIDTH, factor, ratio, wrap  # noqa: F401 -- for the scripts

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


def host_reads(fn: Callable[[], object]) -> int:
    """Host reads of device values in one call of ``fn`` (``vocabpar.host_reads``), its passes run
    eager: the same count as compiled (a pass is pure tensor work, no read), while a compiled pass
    called under the counter's torch function mode fails its program's guards (Dynamo keeps the
    mode stack in them) and would compile, or under ``--quick`` run eager from then on, anew."""
    from vocabpar.host_reads import counting
    from vocabpar.kernels import fused

    with fused.compiling(False), counting() as reads:
        fn()
    return sum(reads.values())


def ms(seconds: float, digits: int = 1) -> str:
    """``seconds`` in milliseconds, as a table cell."""
    return f"{seconds * 1e3:.{digits}f}"


def over(a: float, b: float, digits: int = 1) -> str:
    """``a / b`` as a table cell, ``1.7x`` (``b`` 0 counts as 1: a count of nothing)."""
    return f"{a / (b or 1):.{digits}f}x"


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


@contextlib.contextmanager
def stored_passes() -> Iterator[list[str]]:
    """Under ``--quick`` the library's passes never compile: inside the block one whose program the
    store lacks (for this call's convention and this process's thread count) runs eager, the same
    bits, from then on in this process. A benchmark's own passes (defined outside vocabpar, which
    ``vocabpar warm`` does not know) compile once and are kept. Yields a list that names the passes
    left eager, after the block (empty in full runs, which compile what the store lacks). The
    library's one-line notice that a pass compiles stays silent: the benchmarks report the
    seconds their passes took to compile or load."""
    from vocabpar.kernels import fused, store

    fused.quiet()
    eager: list[str] = []
    if not QUICK:
        yield eager
        return
    compile_and_save = store.compile_and_save

    def only_our_own(fn: Callable[..., object], *args: object) -> object:
        if fn.__module__.split(".")[0] != "vocabpar":
            return compile_and_save(fn, *args)
        eager.append(fn.__name__)  # once per pass: it runs eager from now on
        raise LookupError(f"{fn.__name__}: not in the store, and --quick does not compile")

    store.compile_and_save = only_our_own
    try:
        with warnings.catch_warnings():  # the pass's own warning that it runs eager: said once, after
            warnings.filterwarnings("ignore", "vocabpar: compiling .* failed", RuntimeWarning)
            yield eager
    finally:
        store.compile_and_save = compile_and_save


def passes_note(eager: Sequence[str]) -> str:
    """What :func:`stored_passes` left eager, as a sentence (empty when nothing)."""
    if not eager:
        return "passes compiled (loaded from the store)" if QUICK else ""
    threads, passes = torch.get_num_threads(), f"{len(eager)} pass{'es' if len(eager) > 1 else ''}"
    return (f"{passes} eager, the store lacking them for {threads}-thread processes (--quick does not "
            f"compile them; `vocabpar warm --threads {threads}` does): {', '.join(sorted(eager))}")


def verdict(what: str, baseline: str, at: str, times: dict[str, tuple[float, float]],
            sent: dict[str, tuple[int, int]]) -> str:
    """A bottom line from per-configuration (ours, baseline's) ``times`` (seconds) and ``sent``
    (bytes): the first configuration's ratios, then the range of the speed-ups over all of them;
    e.g. "sampling on shards 33x faster than gather-then-sample at B=256 (greedy), 8080x fewer
    bytes; over all 7 configurations 2.3x faster (top-p 0.9 (flat)) to 94x faster (...)"."""
    if not times or times.keys() != sent.keys():
        raise ValueError(f"times and sent must name the same configurations, got {list(times)} and "
                         f"{list(sent)}")
    first = next(iter(times))
    speed = sorted(times, key=lambda n: times[n][1] / times[n][0])
    return (f"{what} {factor(*times[first])} than {baseline} at {at} ({first}), "
            f"{factor(*sent[first], 'fewer bytes', 'more bytes')}; over all {len(times)} configurations "
            f"{factor(*times[speed[0]])} ({speed[0]}) to {factor(*times[speed[-1]])} ({speed[-1]})")


def _report(text: str) -> None:
    """Append ``text`` to the report file, when :data:`REPORT_ENV` names one."""
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(text)


def show(text: str = "") -> None:
    """Print ``text`` wrapped to :data:`WIDTH` columns; the report gets it unwrapped, as a
    paragraph of its own."""
    print(wrap(text), flush=True)
    if text.strip():
        _report(text.lstrip("\n").rstrip() + "\n\n")


def bottom_line(text: str) -> None:
    """Print the benchmark's bottom line: the ratio that decides, from this run's numbers."""
    show(BOTTOM + text)


def fit(header: Sequence[str], rows: Sequence[Sequence[object]], drop: Sequence[str] = (),
        width: int = WIDTH) -> tuple[list[str], list[str]]:
    """The lines of a plain-text table (first column left-aligned, the others right-aligned, two
    spaces apart) without the columns of ``drop``, first ones first, until every line fits
    ``width``; and the columns left out. ``ValueError`` for a row whose length differs from the
    header's or a ``drop`` name not in it."""
    header = [str(h) for h in header]
    cells = [[str(c) for c in row] for row in rows]
    for i, row in enumerate(cells):
        if len(row) != len(header):
            raise ValueError(f"row {i} has {len(row)} cells, the header {len(header)}: {row}")
    unknown = [d for d in drop if d not in header]
    if unknown:
        raise ValueError(f"columns to drop {unknown} are not in the header {header}")
    keep, left_out = list(range(len(header))), []
    while True:
        widths = {i: max(len(r[i]) for r in [header, *cells]) for i in keep}
        lines = ["  ".join(r[i].ljust(widths[i]) if i == keep[0] else r[i].rjust(widths[i]) for i in keep)
                 .rstrip() for r in [header, *cells]]
        candidates = [d for d in drop if d not in left_out]
        if max(map(len, lines)) <= width or not candidates:
            return lines, left_out
        left_out.append(candidates[0])
        keep.remove(header.index(candidates[0]))


def table(header: Sequence[str], rows: Sequence[Sequence[object]], drop: Sequence[str] = ()) -> None:
    """Print a table fitted to :data:`WIDTH` columns (see :func:`fit`; a line names the columns
    left out); the report gets every column, as a markdown table."""
    lines, left_out = fit(header, rows, drop)
    print("\n".join(lines), flush=True)
    if left_out:
        print(wrap(f"(left out to fit {WIDTH} columns: {', '.join(left_out)}; the --out report has them)"))
    body = [" | ".join(map(str, r)) for r in [header, ["---"] * len(header), *rows]]
    _report("".join(f"| {line} |\n" for line in body) + "\n")
