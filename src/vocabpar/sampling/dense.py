"""The engine sampler's tensor passes: every shape fixed by the call's shapes, never by the
data, and no host read (no ``nonzero``, no boolean indexing, no ``.item()``).

Each pass is the dense twin of a step of the adaptive sampler and computes the same numbers:
the float steps are :mod:`vocabpar.sampling.semantics`' own, applied to whole ``[B, columns]``
blocks with masks instead of to compacted lists, so the tokens stay bit-identical to
:func:`~vocabpar.sampling.reference.reference_sample`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vocabpar.sampling.ranks import Ranks
from vocabpar.sampling.semantics import threshold_digit
from vocabpar.wire.records import histogram


def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` ``[T, ...]`` as ``rows`` rows (zeros after it): a message of the fixed size. (A
    concatenation, not a slice assignment: traced, it holds for a 1-row ``t`` too.)"""
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def threshold(local_histogram: Callable[[int, int, torch.Tensor, int], torch.Tensor], B: int,
              need: torch.Tensor | Callable, ranks: Ranks, rows: int, device: torch.device,
              search_bits: tuple[int, ...]) -> torch.Tensor:
    """Per row, the largest key ``v`` with ``sum(weight[keys >= v]) >= need`` over all ranks, for
    this shard's keys (order keys in ``[0, 2**32)``) and weights as ``local_histogram(shift, bits,
    prefix, top)`` counts them (int64 ``[B, top + 1]``, e.g.
    :func:`~vocabpar.kernels.fused.logit_histogram`); ``need`` ``[B]``, or a function of the
    rows' total weight (measured by the first round). One histogram all-reduce of ``rows >= B``
    rows per round resolves ``search_bits[i]`` bits of ``v`` (they add up to 32): the same
    collectives whatever the keys hold."""
    prefix = torch.zeros(B, dtype=torch.long, device=device)
    shift = 32
    for bits in search_bits:
        top = 1 << bits  # the "above" column; the tokens below the bucket weigh nothing
        hist = padded(local_histogram(shift, bits, prefix, top), rows)
        record = histogram(bits)
        got = record.unpack(ranks.sum(hist))
        counts, above = got.digits[:B], got.above[:B]
        if callable(need):
            need = need(counts.sum(1) + above)
        prefix = (prefix << bits) | threshold_digit(counts, above, need)[0]
        shift -= bits
    return prefix
