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

from vocabpar.sampling.noise import gumbel, row_keys
from vocabpar.sampling.ranks import Ranks
from vocabpar.sampling.semantics import NEG_INF, merge_argmax
from vocabpar.wire.records import histogram
from vocabpar.wire.scripts import ENGINE_SEARCH_BITS


def top(x: torch.Tensor, ids: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This shard's ``c`` largest values (float64 ``[B, c]``, descending, -inf padded), their ids
    (-1 padded), and how many of its tokens equal the ``c``-th value (``[B]``: the tied group the
    cut may have split). ``x``: ``[B, R]``; ``ids``: ``[R]``."""
    B, R = x.shape
    m = min(c, R)
    vals = torch.full((B, c), NEG_INF, dtype=torch.float64, device=x.device)
    cand_id = torch.full((B, c), -1, dtype=torch.long, device=x.device)
    ties = torch.zeros(B, dtype=torch.long, device=x.device)
    if m:
        best = x.topk(m, 1)
        vals[:, :m], cand_id[:, :m] = best.values.double(), ids[best.indices]
        if m == c:
            ties = ((x == best.values[:, -1:]) & (ids >= 0)).sum(1)
    return vals, cand_id, ties


def first_max(score: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the max of ``score`` ``[B, m]`` and the lowest of ``ids`` (``[m]`` or ``[B, m]``,
    -1 = none) reaching it: float64 ``[B]`` and int64 ``[B]`` (-1 when the row holds only -inf
    and no id)."""
    if not score.shape[1]:
        return score.new_full(score.shape[:1], NEG_INF), torch.full(score.shape[:1], -1, device=score.device)
    return merge_argmax(score.T, ids.expand_as(score).T)


def best_kept(z: torch.Tensor, ids: torch.Tensor, kept: torch.Tensor, seed: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's Gumbel-max over its ``kept`` tokens: per row the best ``z + G`` (``z = x /
    t``) and the lowest id reaching it. ``z``, ``kept``: ``[B, R]``; ``ids``: ``[R]``; the rest
    ``[B]``."""
    noise = gumbel(row_keys(seed, positions)[:, None, :], ids.clamp(min=0))
    return first_max(torch.where(kept, z + noise, NEG_INF), torch.where(kept, ids, -1))


def threshold(keys: torch.Tensor, weight: torch.Tensor, need: torch.Tensor | Callable, ranks: Ranks,
              rows: int) -> torch.Tensor:
    """Per row, the largest key ``v`` with ``sum(weight[keys >= v]) >= need`` over all ranks:
    ``keys`` in ``[0, 2**32)`` (-1: not a token, weight 0), ``weight`` int64 ``[B, R]``;
    ``need`` ``[B]``, or a function of the rows' total weight (measured by the first round).
    Three histogram all-reduces of ``rows >= B`` rows each resolve 11, 11 and 10 bits of ``v``:
    the same collectives whatever the keys hold."""
    B = keys.shape[0]
    prefix = torch.zeros(B, dtype=torch.long, device=keys.device)
    done = 0
    for bits in ENGINE_SEARCH_BITS:
        high = keys >> (32 - done)
        digit = (keys >> (32 - done - bits)) & ((1 << bits) - 1)
        top = 1 << bits  # the "above" column; a trash column past it takes the tokens below
        outside = torch.where(high > prefix[:, None], top, top + 1)
        column = torch.where(high == prefix[:, None], digit, outside)
        hist = torch.zeros(rows, top + 2, dtype=torch.long, device=keys.device)
        hist[:B].scatter_add_(1, column, weight)
        record = histogram(bits)
        got = record.unpack(ranks.sum(hist[:, : top + 1].contiguous()))
        digits, above = got.digits[:B], got.above[:B]
        if callable(need):
            need = need(digits.sum(1) + above)
        suffix = digits.flip(1).cumsum(1).flip(1)  # suffix[d] = weight of digits >= d
        d = ((above[:, None] + suffix) >= need[:, None]).sum(1).clamp(min=1) - 1
        prefix = (prefix << bits) | d
        done += bits
    return prefix
