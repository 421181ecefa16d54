"""Speculative verification's steps after the draws, for either schedule: weighing each draft
token against the target's and the draft's exact kept masses, the correction after a rejection,
and the tokens a row emits.

A schedule says which (row, draft position) pairs to weigh, which rows to correct and how a
message crosses the ranks (``sum_ranks``, ``gather_ranks``); :class:`DraftMasses` and these
functions compute the numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vocabpar.kernels.fused import accept_uniforms, residual
from vocabpar.layout import VocabLayout
from vocabpar.sampling.ranks import Ranks
from vocabpar.sampling.semantics import NEG_INF, accepts, merge_argmax
from vocabpar.sampling.steps import Steps
from vocabpar.wire.records import DRAW, MASSES, Unpacked

Send = Callable[[torch.Tensor], torch.Tensor]
KeptTotalAndAt = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def weigh(kept_total_and_at: KeptTotalAndAt, target_rows: torch.Tensor, draft_rows: torch.Tensor,
          cols: torch.Tensor, owned: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
          sum_ranks: Send) -> tuple[Unpacked, torch.Tensor]:
    """Per pair ``[P]``: the target's and the draft's total kept masses and masses of the draft
    token (:data:`~vocabpar.wire.records.MASSES`, summed over ranks by ``sum_ranks``), and
    whether the draft token is accepted (``u * q(x) < p(x)``, ``u`` on the row's "accept" stream
    at ``positions``). ``kept_total_and_at(rows, cols)``: this shard's kept total of each row
    and its kept mass at column ``cols``; ``owned``: the draft token lies in this shard."""
    local = {}
    for side, rows in (("target", target_rows), ("draft", draft_rows)):
        total, at = kept_total_and_at(rows, cols)
        local[f"{side}_total"], local[f"{side}_token"] = total, torch.where(owned, at, 0)
    got = MASSES.unpack(sum_ranks(MASSES.pack(**local)))
    u = accept_uniforms(seeds, positions)
    return got, accepts(u, got.target_token, got.target_total, got.draft_token, got.draft_total)


def correction(target_mass: torch.Tensor, target_total: torch.Tensor, draft_mass: torch.Tensor,
               draft_total: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor,
               gather_ranks: Send) -> torch.Tensor:
    """Per rejected pair, the token of the Gumbel-max over ``(p - q)+`` on the "residual"
    stream, -1 where ``p <= q`` everywhere: this shard's best (score, id) from its kept masses
    ``[F, columns]`` (``ids`` ``[columns]``), merged over ranks by one all-gather of
    :data:`~vocabpar.wire.records.DRAW`."""
    best, arg = residual(target_mass, target_total, draft_mass, draft_total, seeds, positions, ids)
    got = DRAW.unpack(gather_ranks(DRAW.pack(score=best, id=arg)))
    score, token = merge_argmax(got.score, got.id)
    return torch.where(score > NEG_INF, token, -1)


class DraftMasses:
    """Verification with draft logits: per weighed pair ``(b, i)`` (row, draft position) the
    target's and the draft's exact kept masses and each one's mass of the draft token, summed
    over ranks in one message; after a rejection, the correction drawn from ``(p - q)+`` in
    another. ``steps``: the stacked rows' steps (target row ``b`` at position ``i`` is stacked at
    ``b·(k+1) + i``, its draft row at ``B·(k+1) + slot[b]·k + i``); ``pairs``: the pairs the
    schedule weighs, sorted by ``b·k + i``, among them every ``weighed`` one (None: every pair);
    ``drafts`` int64 ``[B, k]``; ``positions`` ``[B]``. ``accept`` ``[B, k]``: the weighed pairs'
    verdicts."""

    def __init__(self, steps: Steps, layout: VocabLayout, ranks: Ranks, drafts: torch.Tensor,
                 positions: torch.Tensor, weighed: torch.Tensor,
                 pairs: tuple[torch.Tensor, torch.Tensor] | None, slot: torch.Tensor, sum_ranks: Send,
                 gather_ranks: Send) -> None:
        B, k = drafts.shape
        self.every = pairs is None
        if pairs is None:
            pair = torch.arange(B * k, device=drafts.device)
            pairs = pair // k, pair % k
        b, i = pairs
        self.steps, self.positions, self.weighed, self.k = steps, positions, weighed, k
        self.gather_ranks, self.key = gather_ranks, b * k + i
        self.target_rows, self.draft_rows = b * (k + 1) + i, B * (k + 1) + slot[b] * k + i
        cols, owned = (t.to(b.device) for t in layout.local_ids(drafts[b, i], ranks.me))
        self.total, accept = weigh(steps.kept_total_and_at, self.target_rows, self.draft_rows, cols, owned,
                                   steps.rows.seed[self.target_rows], positions[b] + i, sum_ranks)
        if not self.every:
            accept = torch.zeros(B * k, dtype=torch.bool, device=b.device).index_put((self.key,), accept)
        self.accept = accept.view(B, k)

    def rejected(self, accepted: torch.Tensor) -> torch.Tensor:
        """Bool ``[B]``: the rows whose first rejected draft was weighed."""
        k = self.k
        return (accepted < k) & self.weighed.gather(1, accepted.clamp(max=max(k - 1, 0))[:, None])[:, 0]

    def correct(self, last: torch.Tensor, accepted: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """``last`` with the correction of each of ``rows`` (the schedule's choice, sorted, among
        them every :meth:`rejected` one; None: every row) that rejected a weighed draft; a row
        where ``p <= q`` everywhere (only when rounding makes them equal) keeps the target's own
        draw."""
        k, steps = self.k, self.steps
        fixed = self.rejected(accepted)
        if rows is not None:
            accepted, fixed = accepted[rows], fixed[rows]
        every_row = torch.arange(last.shape[0], device=last.device) if rows is None else rows
        j = accepted.clamp(max=k - 1)
        # the pair (row, j)
        f = every_row * k + j if self.every else torch.searchsorted(self.key, every_row * k + j)
        target, draft = self.target_rows[f], self.draft_rows[f]
        token = correction(steps.kept_mass(target), self.total.target_total[f], steps.kept_mass(draft),
                           self.total.draft_total[f], steps.rows.seed[target], self.positions[every_row] + j,
                           steps.ids, self.gather_ranks)
        if rows is None:
            return torch.where(fixed & (token >= 0), token, last)
        return last.index_put((rows,), torch.where(fixed & (token >= 0), token, last[rows]))


def emitted(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, k+1]``: the accepted drafts, then ``last`` (the correction or the bonus
    token) at position ``accepted``, -1 after it."""
    B, k = drafts.shape
    keep = torch.arange(k, device=drafts.device) < accepted[:, None]
    tokens = torch.cat([torch.where(keep, drafts, -1), drafts.new_full((B, 1), -1)], 1)
    return tokens.scatter(1, accepted[:, None], last[:, None])
