"""The exact threshold search on vocab shards: per row, the largest key ``v`` whose weight at or
above it reaches a target, over all ranks, in at most two histogram all-reduces and one
settling all-gather (plus one round when a final bucket holds many distinct keys).

Keys are unsigned order keys of float32 values in ``[0, 2**32)`` (-1: not a token); weights are
1 (top-k) or exact integer masses (top-p), so every rank finds the same ``v``. The messages are
:data:`vocabpar.wire.records.HISTOGRAM` and :func:`vocabpar.wire.records.settle`; what a search
sends is :class:`vocabpar.wire.scripts.Search`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vocabpar.kernels.fused import digits, histogram, int32_sums, members, order_keys, reachable, scored
from vocabpar.sampling.merged import Merged
from vocabpar.sampling.noise import gumbel_bound
from vocabpar.sampling.ranks import Ranks
from vocabpar.sampling.semantics import NEG_INF, key_value, merge_argmax, row_argmax, threshold_digit
from vocabpar.wire.records import HISTOGRAM, SEARCH_BITS, SETTLE_BITS, SETTLE_TOKENS, settle
from vocabpar.wire.scripts import Search

DENSE_SHARE = 16
"""The search's rounds read the whole shard, rather than its listed bucket, when the bucket holds
more than ``1 / DENSE_SHARE`` of the shard's entries."""


def value_key(values: torch.Tensor) -> torch.Tensor:
    """The unsigned order key of float values (rounded to float32, clamped to the finite-or-inf
    range of keys)."""
    return order_keys(values.float())


def bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bits needed for each non-negative int64 below 2**53 (0 for 0)."""
    return torch.frexp(x.double()).exponent.long()


def contenders(x: torch.Tensor, ids: torch.Tensor, thr: torch.Tensor, temperature: torch.Tensor,
               min_z: torch.Tensor, floor_score: torch.Tensor,
               keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column, z) of this shard's kept tokens (``x >= thr``, ``z = x / temperature >=
    min_z``) that can still beat ``floor_score``: a token whose noise bound (16 hashed bits,
    :func:`gumbel_bound`) cannot reach it is dropped before its exact noise is computed. Never
    drops a possible winner (the bound is conservative). ``x``: ``[F, columns]``; ``ids``:
    ``[columns]``; the rest ``[F]``."""
    bound = gumbel_bound().to(x.device)
    reach = reachable(x, ids, thr.double(), temperature, min_z, floor_score, keys[:, 0], bound)
    r, col = reach.nonzero(as_tuple=True)
    return r, col, x[r, col].double() / temperature[r]


@dataclass(frozen=True)
class Draw:
    """What a threshold search needs to draw the token of rows whose kept set is ``key >= v``
    and ``z >= min_z`` (``v`` the threshold it finds): their logits ``x`` ``[F, columns]``, the
    columns' ``ids``, and the rows' merged candidates and terms (:class:`Merged`)."""

    x: torch.Tensor
    ids: torch.Tensor
    merged: Merged

    def certain_best(self, top_key: torch.Tensor,
                     listed: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's best (score, id) per row among the kept tokens with key >= ``top_key``
        (all kept whatever the threshold within the bucket below): from ``listed`` (row, column,
        key ``[N]``) tokens that include all of them, each scored exactly; else from the shard,
        where the certainly kept candidates give a lower bound on it, so the noise bound prunes
        most tokens first."""
        r, _, ids, score = self._contenders(top_key, listed)
        return row_argmax(r, ids, score, top_key.shape[0])

    def _contenders(self, top_key: torch.Tensor, listed: tuple[torch.Tensor, ...] | None) -> tuple:
        """Row, column, id and score ``[N]`` of tokens among which :meth:`certain_best` lies."""
        if listed is not None:
            r, col, key = listed
            up = key >= top_key[r]
            r, col = r[up], col[up]
            score = self.score(r, col)
            return r, col, torch.where(score > NEG_INF, self.ids[col], -1), score
        m = self.merged
        top_value = key_value(top_key.clamp(max=2**32 - 1) - 2**31).double()
        thr = torch.where(top_key < 2**32, top_value, float("inf"))
        floor, _ = m.best_candidate(thr)
        r, col, z = contenders(self.x, self.ids, thr, m.temperature, m.min_z, floor, m.keys)
        ids = self.ids[col]
        return r, col, ids, scored(z, m.keys[r], ids)

    def score(self, r: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """``z + G`` of the listed tokens, -inf where min-p drops them."""
        m = self.merged
        z = self.x[r, col].double() / m.temperature[r]
        return torch.where(z >= m.min_z[r], scored(z, m.keys[r], self.ids[col]), NEG_INF)


def threshold_search(x: torch.Tensor, real: torch.Tensor, weight: torch.Tensor | None,
                     need: torch.Tensor | Callable, lo: torch.Tensor, hi: torch.Tensor, ranks: Ranks,
                     draw: Draw | None = None,
                     weight_bits: int = 1) -> tuple[torch.Tensor, torch.Tensor, Search]:
    """Per row, the largest key ``v`` with ``sum(weight[key >= v]) >= need`` over all ranks, given
    ``lo <= v <= hi``: ``key`` the order keys of this shard's values ``x`` (float32 ``[F,
    columns]``) where ``real`` (``[columns]``; padding weighs nothing), ``weight`` int64 ``[F,
    columns]`` below ``2**weight_bits``, or 1 per token when None. ``need`` may be a function of
    the rows' total weight, which the first round then measures. With ``draw``, also the token
    drawn from ``key >= v`` and ``z >= min_z``. Returns ``(v, token, search)``: token -1 where not
    drawn, ``search`` what was sent.

    The keys ``lo`` and ``hi`` share their top bits: the search starts in that bucket. Each round
    all-reduces a histogram of ``2**SEARCH_BITS`` weights per row (plus the weight above the
    bucket) and keeps the digit holding ``v``, until a bucket spans at most ``2**SETTLE_BITS``
    keys: at most ``ceil(22 / SEARCH_BITS) = 2`` rounds. Then one all-gather settles it: each rank
    sends the ``SETTLE_TOKENS`` largest distinct keys of the bucket, each with the weight of its
    tokens -- and, to draw, its tokens' best score and its best score above the bucket. A row whose
    bucket holds more distinct keys on some rank (never a matter of ties) takes one more round of
    ``2**SETTLE_BITS`` sums (and is not drawn). Only the bucket's tokens are
    carried from round to round, listed; a bucket holding more than ``1 / DENSE_SHARE`` of the
    shard (counted before listing) is read in place instead, and listed only once it is final.
    To draw, the first listing also holds the tokens above the bucket where that stays small (top-k
    after a first round in place, whose counts bound them): the draw scores those exactly, and
    reads the shard for them otherwise."""
    F = x.shape[0]
    narrow = int32_sums(weight_bits, x.shape[1])
    shard = (x, real, weight)
    shift = bit_length(lo ^ hi)
    prefix = hi >> shift
    bits = (shift - SETTLE_BITS).clamp(0, SEARCH_BITS)
    above, total, rounds = torch.zeros(F, dtype=torch.long), None, 0
    # rounds run on the tokens of the bucket and above only, listed; when some row's bucket is the
    # whole key range, or the bucket holds a large share of the shard, they run on the shard in
    # place instead (one read of it per round, where a listed token costs ~ten indexed operations).
    # A draw needs every kept token above the final bucket: kept in the first listing, they are
    # scored exactly from it instead of from another read of the shard
    with_above = bool((shift < 32).all())  # host syncs here and below: branches every rank takes alike
    if not with_above:
        shift, prefix, above, total, need, _ = _histogram_round(shard, None, bits, shift, prefix, above,
                                                                total, need, ranks, narrow)
        rounds += 1
        # counted tokens: ``above`` (over all ranks) bounds how many this rank would list above
        with_above = draw is not None and weight is None and int(above.sum()) * DENSE_SHARE <= x.numel()
    high = torch.full_like(prefix, 2**33) if with_above else (prefix + 1) << shift
    flags, count = members(*shard, prefix << shift, high)
    in_place = int(count.sum()) * DENSE_SHARE > x.numel()
    r, col = (None, None) if in_place else flags.nonzero(as_tuple=True)
    key, wt = (None, None) if in_place else _listed(shard, r, col)
    listed = (r, col, key) if with_above and not in_place and draw is not None else None
    while True:
        bits = (shift - SETTLE_BITS).clamp(0, SEARCH_BITS)
        if (total is not None or not callable(need)) and not bool((bits > 0).any()):
            break
        if in_place:
            shift, prefix, above, total, need, _ = _histogram_round(shard, None, bits, shift, prefix, above,
                                                                    total, need, ranks, narrow)
            flags = None  # stale: the narrowed bucket is listed after the rounds
        else:
            shift, prefix, above, total, need, keep = _histogram_round((key, wt), r, bits, shift, prefix,
                                                                       above, total, need, ranks)
            r, col, key, wt = r[keep], col[keep], key[keep], wt[keep]
        rounds += 1
    if r is None:  # the final bucket's tokens (everything above it is in ``above`` after a round)
        flags = members(*shard, prefix << shift, (prefix + 1) << shift)[0] if flags is None else flags
        r, col = flags.nonzero(as_tuple=True)
    if key is None:
        key, wt = _listed(shard, r, col)
    v, token, overflow = _settle(key, wt, r, col, shift, prefix, above, need, ranks, draw, listed)
    crowded = bool(overflow.any())  # a host sync that saves a collective for every other row
    if crowded:
        mine = overflow[r]
        _, exact, *_ = _histogram_round((key[mine], wt[mine]), r[mine], torch.where(overflow, shift, 0),
                                        shift, prefix, above, total, need, ranks)
        v, token = torch.where(overflow, exact, v), torch.where(overflow, -1, token)
    return v, token, Search(F, rounds, draw is not None, crowded)


def _listed(shard: tuple, r: torch.Tensor, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The order keys and weights ``[N]`` of the listed tokens ``(r, col)`` of ``shard`` (``(x,
    real, weight)``, as :func:`threshold_search` takes them; listed tokens are real)."""
    x, _, weight = shard
    return value_key(x[r, col]), torch.ones_like(r) if weight is None else weight[r, col]


def _settle(key, wt, r, col, shift, prefix, above, need, ranks: Ranks, draw: Draw | None, listed):
    """The settling all-gather: each rank's ``SETTLE_TOKENS`` largest distinct keys of its final
    bucket (``key``, ``wt``, ``r``, ``col``: the bucket's tokens, by row ``r``), each with the
    weight of the tokens holding it, merged into ``v`` per row; with ``draw`` also the token: each
    key carries the best (score, id) of its tokens, and the best above the bucket comes from
    ``listed`` (row, column, key) tokens that hold every one above it, or from the shard when
    None. Tied tokens share one entry, so ties never overflow it. Returns ``(v, token,
    overflow)``, ``overflow`` the rows whose bucket held more distinct keys on some rank (their
    ``v`` is not final)."""
    F = prefix.shape[0]
    # one group per (row, key), rows in order, keys descending
    groups, group = torch.unique(r * 2**33 + (2**32 - 1 - key), sorted=True, return_inverse=True)
    G = groups.numel()
    g_r, g_key = groups >> 33, 2**32 - 1 - (groups & (2**33 - 1))
    g_wt = torch.zeros(G, dtype=torch.long).index_add_(0, group, wt)
    count = torch.bincount(g_r, minlength=F)
    slot = torch.arange(G) - (count.cumsum(0) - count)[g_r]
    sent = slot < SETTLE_TOKENS
    at = (g_r[sent], slot[sent])

    def table(values: torch.Tensor, pad: float) -> torch.Tensor:
        out = torch.full((F, SETTLE_TOKENS), pad, dtype=values.dtype)
        out[at] = values[sent]
        return out

    parts = {"count": count, "keys": table(g_key, -1), "weights": table(g_wt, 0)}
    if draw is not None:
        best, best_id = draw.certain_best((prefix + 1) << shift, listed)
        g_score, g_id = row_argmax(group, draw.ids[col], draw.score(r, col), G)
        parts |= {"ids": table(g_id, -1), "scores": table(g_score, NEG_INF), "best": best, "best_id": best_id}
    record = settle(draw is not None)
    got = record.unpack(ranks.gather(record.pack(**parts)))  # each [n, F, ...]
    merged = lambda t: t.permute(1, 0, 2).reshape(F, -1)  # noqa: E731  [F, n·SETTLE_TOKENS]
    ordered, by_key = merged(got.keys).sort(1, descending=True)
    reached = above[:, None] + merged(got.weights).gather(1, by_key).cumsum(1) >= need[:, None]
    v = ordered.gather(1, (~reached).sum(1).clamp(max=ordered.shape[1] - 1)[:, None])[:, 0]
    token = torch.full((F,), -1, dtype=torch.long)
    if draw is not None:  # the best of: every rank's best above the bucket, the bucket's kept tokens
        kept = merged(got.keys) >= v[:, None]
        scores = torch.cat([got.best.T, merged(got.scores)], 1)
        ids = torch.cat([got.best_id.T, torch.where(kept, merged(got.ids), -1)], 1)
        _, token = merge_argmax(scores.T, ids.T)
    return v, token, (got.count > SETTLE_TOKENS).any(0)


def _histogram_round(tokens, r, bits, shift, prefix, above, total, need, ranks: Ranks,
                     narrow: bool = False):
    """One all-reduce: per row, the weights of the ``2**bits`` digits below the bucket's prefix
    (and, in the first round, of everything above the bucket); keep the digit holding the
    threshold. ``tokens``: the keys and weights ``[N]`` of listed tokens of rows ``r``, or (``r``
    None) the shard as :func:`threshold_search` takes it, ``(x, real, weight)``, with ``narrow``
    its weights' :func:`~vocabpar.kernels.fused.int32_sums`. Returns the narrowed (shift, prefix,
    above), the total and ``need`` once known, and which listed tokens stay in the bucket (None
    for the whole shard)."""
    F = prefix.shape[0]
    top, words = 1 << SEARCH_BITS, HISTOGRAM.words()  # column top: above the bucket; below weighs nothing
    keep = None
    if r is None:
        hist = histogram(*tokens, shift, bits, prefix, top, narrow)
    else:
        key, wt = tokens
        digit, weight, inside = digits(key, wt, shift[r], bits[r], prefix[r], top)
        hist = torch.zeros(F * words, dtype=torch.long).index_add_(0, r * words + digit, weight)
    got = HISTOGRAM.unpack(ranks.sum(hist.view(F, words)))
    if total is None:
        total, above = got.digits.sum(1) + got.above, got.above
        need = need(total) if callable(need) else need
    d, suffix = threshold_digit(got.digits, above, need)
    above = above + torch.where(d + 1 < top, suffix.gather(1, (d + 1).clamp(max=top - 1)[:, None])[:, 0], 0)
    if r is not None:
        keep = inside & (digit == d[r])
    return shift - bits, (prefix << bits) | d, above, total, need, keep
