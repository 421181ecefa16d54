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
from vocabpar.sampling.params import Rows, TokenCounts
from vocabpar.sampling.ranks import Ranks
from vocabpar.sampling.semantics import NEG_INF, allowed
from vocabpar.wire.records import histogram
from vocabpar.wire.scripts import ENGINE_SEARCH_BITS


def processed(raw: torch.Tensor, ids: torch.Tensor, padded: bool, rows: Rows,
              penalty: tuple[torch.Tensor, torch.Tensor, TokenCounts] | None,
              bitmask: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[B, columns]`` from raw logits: padding columns -inf (``padded``: the shard has
    some), penalties on the owned seen tokens (``penalty``: their columns and ownership ``[B, K]``
    and the counts), disallowed tokens -inf."""
    x = torch.where(ids >= 0, raw, NEG_INF) if padded else raw
    if penalty is not None and x.shape[1]:
        x = penalised(x, *penalty, rows)
    if bitmask is not None:
        x = torch.where(allowed(bitmask, ids), x, NEG_INF)
    return x


def penalised(x: torch.Tensor, cols: torch.Tensor, owned: torch.Tensor, counts: TokenCounts,
              rows: Rows) -> torch.Tensor:
    """:func:`~vocabpar.sampling.semantics.penalise` without compaction: the penalised values
    are scattered into a spare column for the slots this rank does not own. ``x``: ``[B, R]``;
    ``cols``, ``owned``: ``[B, K]``."""
    B, R = x.shape
    valid = owned & (counts.ids >= 0)
    v = x.gather(1, cols)
    n = counts.counts
    generated = n > 0
    seen = generated if counts.in_prompt is None else generated | counts.in_prompt
    rep = rows.repetition_penalty[:, None]
    v = torch.where(seen, torch.where(v > 0, v / rep, v * rep), v)
    v = v - rows.frequency_penalty[:, None] * n.float() - rows.presence_penalty[:, None] * generated.float()
    out = torch.cat([x, x.new_zeros(B, 1)], 1)
    out.scatter_(1, torch.where(valid, cols, R), torch.where(valid, v, 0.0))
    return out[:, :R]


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
    big = torch.iinfo(torch.long).max
    if not score.shape[1]:
        return score.new_full(score.shape[:1], NEG_INF), torch.full(score.shape[:1], -1, device=score.device)
    best = score.max(1).values
    hit = (score == best[:, None]) & (ids >= 0)
    arg = torch.where(hit, ids, big).min(1).values
    return best, torch.where(arg == big, -1, arg)


def best_kept(x: torch.Tensor, ids: torch.Tensor, kept: torch.Tensor, temperature: torch.Tensor,
              seed: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's Gumbel-max over its ``kept`` tokens: per row the best ``x / t + G`` and the
    lowest id reaching it. ``x``, ``kept``: ``[B, R]``; ``ids``: ``[R]``; the rest ``[B]``."""
    z = x.double() / temperature[:, None]
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


def residual(p: torch.Tensor, p_total: torch.Tensor, q: torch.Tensor, q_total: torch.Tensor,
             seed: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """:func:`~vocabpar.sampling.semantics.residual_scores` without compaction: float64
    ``log(p - q) + G`` where ``p > q``, else -inf. ``p``, ``q``: ``[F, R]`` masses."""
    r = p.double() / p_total.double()[:, None] - q.double() / q_total.double()[:, None]
    noise = gumbel(row_keys(seed, positions, "residual")[:, None, :], ids.clamp(min=0))
    return torch.where(r > 0, torch.log(r.clamp(min=0)) + noise, NEG_INF)
