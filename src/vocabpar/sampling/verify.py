"""Speculative decoding's verification step on vocab-sharded logits: exact, identical at any
number of ranks, without gathering the target's logits or building a probability tensor.

A request proposes ``k`` draft tokens; the target model's logits at the ``k`` draft positions and
the one after them are sharded over the vocabulary. Per batch row, position ``i`` accepts or
rejects draft ``x_i`` against ``p_i``, the target's distribution after the row's sampling
parameters (the sampler's semantics), and ``q_i``, the draft's distribution after the same
parameters (or one-hot at ``x_i`` when no draft logits are given):

* deterministic drafts (no draft logits), greedy rows and positions whose target max is +inf:
  ``x_i`` is accepted iff it equals the token :func:`~vocabpar.sampling.adaptive.sample` draws at
  ``positions + i``; the first token drawn that differs is the correction. For one-hot ``q`` this
  is standard speculative sampling (accepted with probability ``p(x_i)``; the correction follows
  ``p`` without ``x_i``), and every emitted token is the one plain decoding would have sampled.
* draft logits: ``x_i`` is accepted iff ``u * q(x_i) < p(x_i)``, ``u`` uniform on the row's
  "accept" noise stream; the correction after the first rejection is a Gumbel-max over
  ``(p - q)+`` on the "residual" stream. ``p`` and ``q`` are exact integer masses over the kept
  tokens (:func:`~vocabpar.sampling.semantics.mass`), so their totals do not depend on the
  number of ranks.
* after ``k`` acceptances the bonus token is :func:`sample`'s draw at ``positions + k``.

Collectives (agreement check off): those of one :func:`sample` call over the ``B·(k+1)`` target
rows -- with draft logits, the ``k`` draft rows of every non-greedy row join the same call --
then, with draft logits and a non-greedy row, one all-reduce of 4 int64 per (such row, draft
position) (target total, the draft token's target mass, draft total, the draft token's draft
mass) and, when some such row rejected a draft, one all-gather of each rank's best correction
(score, id), 16 bytes per rejecting row. Greedy verification is one all-gather of 16 bytes per
(row, position). Bytes never depend on V.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vocabpar import comm
from vocabpar.layout import VocabLayout
from vocabpar.sampling.acceptance import DraftMasses, emitted
from vocabpar.sampling.adaptive import choose
from vocabpar.sampling.constraints import held_back
from vocabpar.sampling.params import (
    Rows,
    SamplingParams,
    check_positions,
    check_verify_inputs,
    on_device,
)
from vocabpar.sampling.ranks import Ranks, agreed, group_ranks, params_fact
from vocabpar.sampling.semantics import (
    VerifyOutput,
)
from vocabpar.sampling.stacked import stacked_index, stacked_rows
from vocabpar.wire.scripts import VerifyPath, verify_script


def verify(target_logits: torch.Tensor, layout: VocabLayout, params: SamplingParams,
           draft_tokens: torch.Tensor, *, positions: torch.Tensor, draft_logits: torch.Tensor | None = None,
           group: comm.ProcessGroup = None, check: bool | None = None,
           output_lens: torch.Tensor | None = None) -> VerifyOutput:
    """Verify ``draft_tokens`` (int64 ``[B, k]``, replicated) against this rank's FP32 shard of the
    target logits ``[B, k+1, rows]`` (storage order of the layout's shard, padding ignored) and,
    optionally, of the draft logits ``[B, k, rows]``; draft ``i`` sits at ``positions + i``. Every
    rank returns the same :class:`VerifyOutput`, equal to :func:`reference_verify` on the full
    logits. Bad input on any rank (shapes, draft ids out of range, parameters) or ranks that
    disagree on what must be replicated raise the same ``ValueError`` on every rank. Request
    constraints apply at every position as sampling applies them, draft logits included;
    ``min_tokens`` counts ``output_lens`` (tokens produced before the drafts) plus the position."""
    device = target_logits.device if isinstance(target_logits, torch.Tensor) else torch.device("cpu")
    with on_device(device):
        return _verify_on_device(target_logits, layout, params, draft_tokens, positions, draft_logits, group,
                                 check, output_lens)


def _verify_on_device(target_logits, layout, params, draft_tokens, positions, draft_logits, group,
                      check, output_lens) -> VerifyOutput:
    V = layout.vocab_size
    inputs: list[tuple[Ranks, int, int, torch.Tensor, Rows]] = []

    def facts() -> dict[str, comm.Fact]:
        ranks = group_ranks(layout, group)
        where = f" on rank {ranks.me}"
        B, k = check_verify_inputs(target_logits, draft_tokens, draft_logits, V, ranks.ids.numel(), where)
        rows = params.resolve(B, V, output_lens)
        if rows.logprobs is not None:
            raise ValueError("verify returns no logprobs: score the emitted tokens with token_logprobs")
        pos = check_positions(positions, B)
        inputs.append((ranks, B, k, pos.to(target_logits.device), rows))
        return {**layout.describe(), "rows": B, "draft tokens": draft_tokens,
                "draft logits": "given" if draft_logits is not None else "none",
                "filter_order": rows.filter_order, "sampling parameters": params_fact(rows), "positions": pos}

    checked = agreed("verify", layout, group, facts, check)
    ranks, B, k, pos, batch_rows = inputs[0]
    drafts = draft_tokens.to(pos.device)
    # the stacked rows (a greedy row ignores its draft logits)
    drafted = torch.zeros(0, dtype=torch.long)
    if draft_logits is not None and k:
        drafted = (~batch_rows.greedy).nonzero()[:, 0]
    index, offset = (torch.tensor(t, dtype=torch.long) for t in stacked_index(B, k, drafted.tolist()))
    raw = target_logits.reshape(B * (k + 1), -1)
    if drafted.numel():
        raw = torch.cat([raw, draft_logits[drafted].reshape(drafted.numel() * k, -1)])
    rows = batch_rows.take(index)
    if held_back(params.min_tokens, params.stop_token_ids, output_lens, B):  # min_tokens counts the positions
        rows = replace(rows, allowed=stacked_rows(params, B, V, index, offset, output_lens).allowed)
    targets = B * (k + 1)

    def row_name(j: int) -> str:
        if j < targets:
            return f"target row {j // (k + 1)} position {j % (k + 1)}"
        return f"draft row {drafted[(j - targets) // k].item()} position {(j - targets) % k}"

    choice, drawn_path = choose(raw, layout, ranks, rows, pos[index] + offset,
                                draws=torch.arange(index.numel()) < targets, row_name=row_name)
    drawn = choice.tokens[:targets].view(B, k + 1)
    accept = drafts == drawn[:, :k]
    weighed = torch.zeros(B, k, dtype=torch.bool)
    if drafted.numel():
        weighed = choice.sampled[:targets].view(B, k + 1)[:, :k]
    masses, path = None, VerifyPath(replace(drawn_path, checked=checked))
    if bool(weighed.any()):
        slot = torch.full((B,), -1, dtype=torch.long)
        slot[drafted] = torch.arange(drafted.numel())
        pairs = weighed.nonzero(as_tuple=True)  # the weighed pairs only
        masses = DraftMasses(choice.steps, layout, ranks, drafts, pos, weighed, pairs, slot, ranks.sum,
                             ranks.gather)
        accept = torch.where(weighed, masses.accept, accept)
        path = replace(path, weighed=masses.key.numel())
    accepted = accept.long().cumprod(1).sum(1)
    last = drawn.gather(1, accepted[:, None])[:, 0]
    rejected = None if masses is None else masses.rejected(accepted).nonzero()[:, 0]  # the rows to correct
    if rejected is not None and rejected.numel():
        last = masses.correct(last, accepted, rejected)
        path = replace(path, rejected=rejected.numel())
    tokens = emitted(drafts, accepted, last)
    return VerifyOutput(accepted, tokens, verify_script(path))
