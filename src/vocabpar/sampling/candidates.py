"""The sampler's first round: the candidates each rank sends, and what they tell about the rest.

Per row, each rank sends its shard's maximum and its ``c`` largest values with their ids
(:func:`vocabpar.wire.records.round_one`); every threshold the sampler certifies without a search
comes from the merged candidates, and the largest value a rank did not send bounds the rest.
"""

from __future__ import annotations

import math

import torch

from vocabpar.kernels.fused import nan_and_ties
from vocabpar.sampling.masks import all_terms
from vocabpar.sampling.params import Rows
from vocabpar.sampling.ranks import Ranks
from vocabpar.sampling.semantics import NEG_INF, mass_shift, merge_argmax
from vocabpar.wire.filters import BY_NAME, FILTERS, candidate_count, masks_on
from vocabpar.wire.records import Unpacked, round_one


def round_one_contents(rows: Rows, ranks: Ranks) -> tuple[int, tuple[str, ...]]:
    """Round-one candidates each rank sends per row for these rows' parameters (0: all greedy)
    and the mask filters whose sums ride along. Two host reads at most: whether any row samples,
    then every filter's values at once (a greedy row's read as off)."""
    sampled = ~rows.greedy
    if not sampled.any():
        return 0, ()
    values = torch.stack([torch.where(sampled, getattr(rows, f.name).double(), f.off) for f in FILTERS])
    on = dict(zip(BY_NAME, values.tolist()))
    return candidate_count(ranks.n, max(ranks.real_counts), on), masks_on(on)


def shard_top(x: torch.Tensor, ids: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's ``c`` largest values with their ids, padded with (-inf, -1). Ties at the c-th
    value are broken arbitrarily: thresholds only need the values, and a padding column may
    stand in for a real -inf token. ``x``: ``[B, columns]``; ``ids``: ``[columns]``."""
    B, R = x.shape
    vals = torch.full((B, c), NEG_INF, dtype=torch.float64, device=x.device)
    cid = torch.full((B, c), -1, dtype=torch.long, device=x.device)
    m = min(c, R)
    if m:
        best = x.topk(m, 1)
        vals[:, :m], cid[:, :m] = best.values.double(), ids[best.indices]
    return vals, cid


def round_one_fields(raw: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, c: int, *, ties: bool = False,
                     masks: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """This shard's part of :func:`vocabpar.wire.records.round_one`, per row: its (max, lowest
    id) with a NaN of ``raw`` folded into the max, its top-``c`` candidates, with ``ties`` how
    many real tokens equal the c-th (where the cut may split a tied group; 0 where the shard
    sends them all), and each mask filter's sums (``masks``). ``raw``, ``x``: ``[B, columns]``
    (raw and processed logits); ``ids``: ``[columns]``."""
    B, R = x.shape
    if R:
        xmax, col = x.max(1)  # first maximum: storage order is id order
        xmax_id = ids[col]
    else:
        xmax = torch.full((B,), NEG_INF, device=x.device)
        xmax_id = torch.full((B,), -1, device=x.device)
    # one candidate is the max itself: no second pass over the shard
    cand, cand_id = (xmax.double()[:, None], xmax_id[:, None]) if c == 1 else shard_top(x, ids, c)
    cut = cand[:, c - 1] if ties and 0 < c <= R else None
    plain = x is raw and not ties
    real = ids >= 0 if masks or not plain else None  # the real columns, where something reads them
    # the max holds a NaN of the shard unless processing (padding, penalties, a bitmask) replaced it
    has_nan, tied = (xmax.isnan(), None) if plain else nan_and_ties(raw, x, real, cut)
    fields = {"max": torch.where(has_nan, float("nan"), xmax.double()), "max_id": xmax_id, "values": cand,
              "ids": cand_id}
    return fields | ({"ties": tied} if ties else {}) | (all_terms(masks, x, real) if masks else {})


def gather_round_one(raw: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, c: int, ranks: Ranks,
                     masks: tuple[str, ...] = ()) -> Unpacked:
    """One all-gather of :func:`vocabpar.wire.records.round_one` (:func:`round_one_fields`): every
    rank's fields, each ``[n, B, ...]``."""
    record = round_one(c, masks=masks)
    return record.unpack(ranks.gather(record.pack(**round_one_fields(raw, x, ids, c, masks=masks))))


def merged_max(maxima: torch.Tensor, max_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each row's max over the ranks' ``[n, B]`` (max, lowest id) and its lowest id -- the greedy
    token -- ignoring NaN, and which rows hold a NaN on some rank."""
    best, token = merge_argmax(torch.where(maxima.isnan(), NEG_INF, maxima), max_ids)
    return best, token, maxima.isnan().any(0)


def unsent_mass(sent: torch.Tensor, t: torch.Tensor, z_max: torch.Tensor, ranks: Ranks,
                V: int) -> torch.Tensor:
    """A guess (float64 ``[B]``, in the units of
    :func:`~vocabpar.sampling.semantics.scaled_mass`) of the mass of the tokens no rank sent:
    each rank's tail continues the power law through its candidates of ranks c/2 and c
    (geometric tails, flat tails and Zipf tails all fit one), for as many tokens as it holds.
    Used only to choose between two exact paths. ``sent``: float64 ``[n, B, c]``, each rank's
    candidates."""
    c = sent.shape[2]
    half = max(c // 2, 1)
    last = torch.exp(sent[..., c - 1] / t - z_max).nan_to_num(0.0)
    middle = torch.exp(sent[..., half - 1] / t - z_max)
    a = (torch.log(middle / last) / math.log(c / half)).nan_to_num(0.0).clamp(min=0.0, max=50.0)
    unsent = torch.tensor([max(count - c, 0) for count in ranks.real_counts], dtype=torch.float64)[:, None]
    # sum over j in (c, c + unsent] of last * (c / j)**a, as an integral
    one = (a - 1).abs() < 1e-6
    power = torch.where(one, 0.5, 1 - a)
    grown = ((1 + unsent / c) ** power - 1) / power
    tail = last * c * torch.where(one, torch.log1p(unsent / c), grown)
    return tail.sum(0) * 2.0 ** mass_shift(V)

