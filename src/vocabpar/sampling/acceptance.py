"""Speculative verification's steps after the draws, for either schedule: weighing each draft
token against the target's and the draft's exact kept masses, the correction after a rejection,
and the tokens a row emits.

A schedule says which (target row, draft row) pairs to weigh and how a message crosses the
ranks (``sum_ranks``, ``gather_ranks``); these functions compute the numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vocabpar.kernels.fused import accept_uniforms, residual
from vocabpar.sampling.semantics import NEG_INF, accepts, merge_argmax
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


def emitted(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, k+1]``: the accepted drafts, then ``last`` (the correction or the bonus
    token) at position ``accepted``, -1 after it."""
    B, k = drafts.shape
    keep = torch.arange(k, device=drafts.device) < accepted[:, None]
    tokens = torch.cat([torch.where(keep, drafts, -1), drafts.new_full((B, 1), -1)], 1)
    return tokens.scatter(1, accepted[:, None], last[:, None])
