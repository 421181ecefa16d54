"""What Inductor's C++ charges for, side by side on one shard: the choices the sampler's compiled
passes (``vocabpar.kernels.fused``) make against the plain form of the same pass.

Run: ``.venv/bin/python benchmarks/bench_inductor.py [--quick]``. One process, one thread, one
rank's FP32 shard of B=256 rows and V/4 = 32320 columns of N(0, 1) logits (quick: 16 x 4096);
every pass compiled (``torch.compile``, dynamic shapes) and timed as the median of 5 calls after
warm-up; both forms give equal results (asserted). Per pair: the other form, the shipped form,
the ratio, and host reads per call of the shipped form (``vocabpar.host_reads``; one process, so
no collective):

- a ``[B, V/4]`` mask written as ``bool`` against ``int32`` (what ``nonzero`` reads);
- a histogram of counts: one int64 scatter-add (Inductor hands it to ATen through two int64
  temporaries) against an int32 one added in the loop; and, for masses (46 bits, kept int64),
  the three int32 pieces that would fit them;
- the total of the masses: the ``[B, V/4]`` int64 masses then a sum, against one reducing pass;
- the bucket's token count: the flags then an eager sum, against the count from the same pass;
- the rows' noise keys (sixteen chained hash rounds per row): eager ops, some 150 launches,
  against one compiled pass (one launch; a per-call cost whatever the shard's width).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from vocabpar.kernels import fused
from vocabpar.sampling.noise import row_keys
from vocabpar.sampling.semantics import mass_bits, mass_shift

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    QUICK,
    QUICK_HELP,
    bottom_line,
    factor,
    host_reads,
    over,
    passes_note,
    show,
    sized,
    stored_passes,
    table,
)

B, V = sized((256, 129280), (16, 16384))
R = V // 4


def _mask_bool(x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    return x >= low[:, None]


def _mask_int32(x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    return (x >= low[:, None]).int()


def _int64_bins(x: torch.Tensor, real: torch.Tensor, weight: torch.Tensor | None, shift: torch.Tensor,
                bits: torch.Tensor, prefix: torch.Tensor, top: int, pieces: int) -> torch.Tensor:
    """:func:`vocabpar.kernels.fused.histogram` with one int64 scatter-add (``pieces`` 0), or
    in ``pieces`` int32 pieces of 16 bits."""
    column, added, _ = fused._digits(fused._shard_keys(x, real), fused._real_weight(real, weight),
                                     shift[:, None], bits[:, None], prefix[:, None], top)
    if not pieces:
        return torch.zeros(x.shape[0], top + 1, dtype=torch.long).scatter_add_(1, column, added)
    total = torch.zeros(x.shape[0], top + 1, dtype=torch.long)
    for k in range(pieces):
        total = total + (fused._int32_bins(column, (added >> 16 * k) & 0xFFFF, top) << 16 * k)
    return total


def _ms(fn) -> float:
    for _ in range(2):
        fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _same(a, b) -> bool:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(torch.equal(p.long() if p.dtype == torch.bool else p, q.long() if q.dtype == torch.bool else q)
               for p, q in zip(a, b, strict=True))


def main() -> None:
    if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
        print(__doc__.strip() + f"\n\n--quick: {QUICK_HELP}")
        return
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, R, generator=g)
    real = torch.arange(R) >= 0
    t = torch.ones(B, dtype=torch.float64)
    no_bound = torch.full((B,), float("-inf"), dtype=torch.float64)
    z_max = x.amax(1).double()
    scale = mass_shift(V)
    weight = fused.masses(x, no_bound, t, no_bound, z_max, scale)
    keys = fused._shard_keys(x, real)
    middle = keys.median(1).values
    shift, bits, top = torch.full((B,), 32), torch.full((B,), 11), 2048
    prefix = middle >> 32
    masks = fused.Fused(_mask_bool), fused.Fused(_mask_int32)
    plain_bins = fused.Fused(_int64_bins)
    wide, narrow = fused.int32_sums(mass_bits(V), R), fused.int32_sums(1, R)
    low = x.median(1).values.double()
    seeds, positions = torch.arange(B) * 7919, torch.arange(B) + 100
    pairs = {
        "mask: bool vs int32": (lambda: masks[0](x, low), lambda: masks[1](x, low)),
        "histogram of masses: 3 int32 pieces vs int64": (
            lambda: plain_bins(x, real, weight, shift, bits, prefix, top, -(-mass_bits(V) // 16)),
            lambda: fused.histogram(x, real, weight, shift, bits, prefix, top, wide)),
        "histogram of counts: int64 vs int32": (
            lambda: plain_bins(x, real, None, shift, bits, prefix, top, 0),
            lambda: fused.histogram(x, real, None, shift, bits, prefix, top, narrow)),
        "mass total: masses + sum vs one pass": (
            lambda: fused.masses(x, no_bound, t, no_bound, z_max, scale).sum(1),
            lambda: fused.mass_totals(x, no_bound, t, no_bound, z_max, scale)),
        "bucket count: flags + sum vs same pass": (
            lambda: fused.members(x, real, None, middle, middle + 2**28)[0].sum(1),
            lambda: fused.members(x, real, None, middle, middle + 2**28)[1]),
        "row noise keys: eager ops vs one pass": (
            lambda: row_keys(seeds, positions), lambda: fused.sample_keys(seeds, positions)),
    }
    measured, rows = {}, []
    with stored_passes() as eager:
        for name, (plain, shipped) in pairs.items():
            assert _same(plain(), shipped()), name
            reads = host_reads(shipped)
            measured[name] = a, b = _ms(plain), _ms(shipped)
            rows.append([name, f"{a:.2f}", f"{b:.2f}", over(a, b), reads])
    show(f"one process, one thread, FP32 shard [{B}, {R}] of V={V}, compiled passes; ms = median of 5 calls"
         + (f"; {passes_note(eager)}" if QUICK else ""))
    table(["pass", "other ms", "shipped ms", "ratio", "reads"], rows)
    bottom_line(_verdict(measured))


def _verdict(measured: dict[str, tuple[float, float]]) -> str:
    """The bottom line from each pair's (other, shipped) milliseconds: how many shipped forms are
    faster, and the range of the ratios."""
    order = sorted(measured, key=lambda n: measured[n][0] / measured[n][1])
    faster = sum(a > b for a, b in measured.values())
    return (f"the shipped form is faster in {faster} of {len(measured)} pairs: from "
            f"{factor(*measured[order[0]][::-1])} ({order[0]}) to {factor(*measured[order[-1]][::-1])} "
            f"({order[-1]})")

if __name__ == "__main__":
    main()
