"""The mask filters (:data:`vocabpar.wire.filters.MASK_NAMES`, those with round-one ``words``):
each keeps a sampled row's tokens at or above a floor computed from exact per-row sums of its
processed logits. Every rank sends its shard's sums in round one's message (no collective of its
own), and integer sums are the same in any order, so the kept set is the same at any rank count.
Each mask sees the logits before any mask (so several intersect, in any order), and all of them
come ahead of the filters whose thresholds come from the candidates (top-k, top-p, min-p), which
see only the tokens the masks kept.

A mask filter is a module with :meth:`Mask.terms` and :meth:`Mask.floor` listed in :data:`MASKS`
beside its entry in :data:`vocabpar.wire.filters.FILTERS` and its field in
:class:`vocabpar.SamplingParams`: the samplers, the scripts and the reference need nothing more.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vocabpar.sampling import sigma
from vocabpar.sampling.params import Rows
from vocabpar.sampling.semantics import NEG_INF, largest
from vocabpar.wire.filters import BY_NAME, MASK_NAMES
from vocabpar.wire.records import Unpacked


class Mask(Protocol):
    """What a mask filter's module provides."""

    def terms(self, x: torch.Tensor, real: torch.Tensor, /) -> torch.Tensor:
        """int64 ``[B, words]``: this shard's exact sums over each row's logits. ``x``: float32
        ``[B, columns]``; ``real``: bool ``[columns]`` (padding counts for nothing)."""
        ...

    def floor(self, summed: torch.Tensor, top: torch.Tensor, value: torch.Tensor, /) -> torch.Tensor:
        """float32 ``[B]``: the least value a kept token may have (-inf where ``value`` is off).
        ``summed``: :meth:`terms` summed over ranks; ``top``: each row's max (float64);
        ``value``: the filter's float64 ``[B]`` per-row parameter."""
        ...


MASKS: dict[str, Mask] = {"top_n_sigma": sigma}
"""Each mask filter's module, by its name in :data:`vocabpar.wire.filters.FILTERS`."""


def all_terms(names: tuple[str, ...], x: torch.Tensor, real: torch.Tensor) -> dict[str, torch.Tensor]:
    """The round-one fields of the mask filters ``names``: each one's :meth:`Mask.terms`."""
    return {name: MASKS[name].terms(x, real) for name in names}


def applied(names: tuple[str, ...], x: torch.Tensor, candidates: torch.Tensor, first: Unpacked,
            top: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard's logits ``x`` ``[B, columns]`` and round one's gathered candidate values
    ``[n, B, c]`` with each sampled row's masks ``names`` applied (``first``: round one's
    gathered fields, holding each mask's sums ``[n, B, words]``; ``top``: each row's max; at
    least one name)."""
    floors = [MASKS[name].floor(getattr(first, name).sum(0), top,
                                torch.where(rows.greedy, BY_NAME[name].off, getattr(rows, name).double()))
              for name in names]
    bound = largest(floors)
    return masked(x, bound[:, None]), masked(candidates, bound[None, :, None])


def kept(x: torch.Tensor, rows: Rows, b: int) -> torch.Tensor:
    """Bool ``[V]``: the tokens of row ``b``'s processed logits ``x`` (``[V]``, the whole row on
    one device: the same exact sums) that every mask filter keeps -- the single-device rule."""
    keep = torch.ones_like(x, dtype=torch.bool)
    for name in MASK_NAMES:
        value = getattr(rows, name)[b: b + 1].double()
        if bool(value != BY_NAME[name].off):
            summed = MASKS[name].terms(x[None], torch.ones_like(keep))
            keep &= x >= MASKS[name].floor(summed, x.max().double()[None], value)
    return keep


def masked(values: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """``values`` with every value below ``bound`` (broadcast to them) at -inf."""
    return torch.where(values >= bound, values, NEG_INF)
