"""Speculative decoding through a vocab-parallel model: drafts from a small vocab-parallel draft
model or from the row's own context (prompt lookup), verified on the target's vocabulary shards.

Every row advances in lockstep, one verification step at a time: the draft proposes ``k`` tokens,
the target runs once over the last emitted token and the drafts (``k + 1`` positions), and
:func:`~vocabpar.sampling.verify` keeps a prefix of the drafts and emits one more token. Rows
accept different numbers of drafts, so each model's KV cache grows by the same number of entries
for every row and the rejected drafts' entries become holes in the attention mask; positions are
passed explicitly, so a row's tokens see exactly its own history.

Sampling is keyed on (seed, position) exactly as the plain loop's: with deterministic drafts
(prompt lookup, or a greedy step) every emitted token is the one the plain loop would emit, at
any number of ranks. A draft model's sampled proposals use a seed derived from the row's, so
they are independent of the target's noise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from vocabpar import comm
from vocabpar.integrations.decode import (
    Generation,
    KVStream,
    Step,
    can_verify,
    checked_request,
    last_rows,
    open_request,
    uses_penalties,
)
from vocabpar.sampling import SamplingParams
from vocabpar.sampling.constraints import per_row
from vocabpar.wire.strategies import STRATEGIES

DRAFT_SEED = 0x5DEECE66D  # xor'ed into a row's seed for its draft model's proposals


@dataclass(frozen=True)
class PromptLookup:
    """Drafts copied from the row's own tokens (prompt and output so far): the ``k`` tokens that
    followed the latest earlier occurrence of its last ``n`` tokens, for the largest ``n`` in
    ``[min_ngram, max_ngram]`` that occurs; a row without a match (or a short one) repeats its
    last token."""

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                             f"{self.max_ngram}")

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = list(context[-n:])
            for start in range(len(context) - n - 1, -1, -1):
                if list(context[start: start + n]) == tail:
                    found = list(context[start + n: start + n + k])
                    return found + [found[-1]] * (k - len(found))
        return [context[-1]] * k


def speculative_generate(lm, prompts: Sequence[Sequence[int]], params: SamplingParams | None,
                         max_new_tokens: int, draft, k: int) -> Generation:
    """The speculative decode loop behind ``ParallelCausalLM.generate(draft=, num_draft_tokens=)``:
    ``draft`` is a :class:`~vocabpar.integrations.hf.ParallelCausalLM` over the same layout and
    group, or a :class:`PromptLookup`. Returns a ``Generation`` whose steps after the prefill are
    verification steps (the draft model's traffic is booked as ``"draft"``), with
    ``drafted``/``accepted`` counts. ``lm`` and ``draft`` are used only through their ``model``,
    ``embedding``, ``layout``, ``strategy``, ``group`` and ``step`` (this module never imports
    ``hf``)."""
    params = checked_request(params, max_new_tokens)  # its error first; open_request checks it again
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_draft_tokens must be a positive int, got {k!r}")
    if not can_verify(lm.strategy):
        raise ValueError(f"speculative decoding verifies on shards or on logits every rank holds in full "
                         f"(strategies {[n for n in STRATEGIES if can_verify(n)]}), not with "
                         f"strategy={lm.strategy!r}")
    model_draft = not isinstance(draft, PromptLookup)
    if model_draft:
        if not isinstance(draft, type(lm)):
            raise ValueError(f"draft must be a parallelized model or a PromptLookup, "
                             f"got {type(draft).__name__}")
        if draft.layout.describe() != lm.layout.describe() \
                or draft.strategy != lm.strategy or not comm.same_group(draft.group, lm.group):
            raise ValueError("the draft model must be parallelized like the target: same vocabulary layout, "
                             "strategy and group")
    V, B = lm.layout.vocab_size, len(prompts)
    if uses_penalties(params, B, V):
        raise ValueError("speculative decoding does not apply repetition, presence or frequency penalties")
    if any(per_row("min_tokens", params.min_tokens, B, int)):
        raise ValueError("speculative decoding in generate does not count min_tokens (rows accept drafts at "
                         "different rates); verify(..., output_lens=) does")
    rows = params.resolve(B, V)
    req = open_request(lm.model, lm.embedding, V, prompts, params, max_new_tokens)
    ids, mask, start_positions, device = req.ids, req.mask, req.position_ids, req.device
    target, out = req.stream, req.out
    context = [list(p) for p in prompts]
    greedy = bool(rows.greedy.all())
    draft_params = replace(params.take(B, V, torch.arange(B)), seed=rows.seed ^ DRAFT_SEED)
    # strategy "auto": each kind of step resolved once, from the batch size and parameters alone
    first_step = lm.step.resolved(B, params)
    step = lm.step.resolved(B, params, spec_tokens=k, draft_logits=model_draft and not greedy)

    with torch.inference_mode():
        before, began = comm.traffic(), time.perf_counter()
        states = target.feed(ids, start_positions, mask.bool())
        first = first_step.draw(first_step.logits(last_rows(states)), params, req.positions)
        drafter = None
        if model_draft:
            drafter = KVStream(draft.model.base_model, draft.embedding, B, device)
            with comm.booked_as("draft"):
                drafter.feed(ids, start_positions, mask.bool())
        out.record(before, began, ids)
        out.strategies.append(first_step.strategy)
        unfed = [[t] for t in first.tolist()]  # emitted tokens the draft model has not seen
        for b, t in enumerate(first.tolist()):
            out.tokens[b].append(t)
            context[b].append(t)
        while min(len(t) for t in out.tokens) < max_new_tokens:
            before, began = comm.traffic(), time.perf_counter()
            positions = _lengths(context, device)  # of the first draft token
            if model_draft:
                with comm.booked_as("draft"):
                    drafts, draft_logits = _propose(draft.step.resolved(B, draft_params), drafter, unfed,
                                                    positions, draft_params, k, greedy)
            else:
                drafts = torch.tensor([draft.propose(c, k) for c in context], dtype=torch.long, device=device)
                draft_logits = None
            last = torch.tensor([c[-1] for c in context], dtype=torch.long, device=device)
            fed = torch.cat([last[:, None], drafts], 1)
            states = target.feed(fed, positions[:, None] - 1 + torch.arange(k + 1, device=device),
                                 torch.ones_like(fed, dtype=torch.bool))
            logits = step.logits(states.reshape(B * (k + 1), -1))
            result = step.verify(logits.view(B, k + 1, -1), params, drafts, positions, draft_logits)
            accepted = result.accepted
            # rejected drafts become holes: entry j of the target's is draft j (0 is the last token);
            # the draft model was fed drafts 1..k-1
            target.drop(torch.arange(k + 1, device=device) > accepted[:, None])
            if drafter is not None:
                drafter.drop(torch.arange(1, k, device=device) > accepted[:, None])
            for b in range(B):
                emitted = result.emitted(b)
                out.tokens[b].extend(emitted)
                context[b].extend(emitted)
                a = int(accepted[b])
                unfed[b] = ([int(drafts[b, k - 1])] if a == k else []) + [emitted[-1]]
            out.drafted += B * k
            out.accepted += int(accepted.sum())
            out.record(before, began, fed)
            out.strategies.append(step.strategy)
    out.tokens = [t[:max_new_tokens] for t in out.tokens]
    return out


def _lengths(context: list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor([len(c) for c in context], dtype=torch.long, device=device)


def _propose(step: Step, stream: KVStream, unfed: list[list[int]], positions: torch.Tensor,
             params: SamplingParams, k: int, greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``k`` tokens per row from the draft model, and its logits at each (``None`` when every row
    is greedy: its drafts are then deterministic). The tokens it has not seen are fed first,
    right-aligned (a row with fewer has a hole in front)."""
    B, device = len(unfed), positions.device
    width = max(len(u) for u in unfed)
    ids = torch.zeros(B, width, dtype=torch.long, device=device)
    valid = torch.zeros(B, width, dtype=torch.bool, device=device)
    for b, u in enumerate(unfed):
        ids[b, width - len(u):] = torch.tensor(u, dtype=torch.long)
        valid[b, width - len(u):] = True
    # the last unfed token sits just before the first draft position
    states = stream.feed(ids, positions[:, None] - width + torch.arange(width, device=device), valid)
    tokens, logits = [], []
    for i in range(k):
        row_logits = step.logits(states[:, -1])
        token = step.draw(row_logits, params, positions + i)
        tokens.append(token)
        logits.append(row_logits)
        if i + 1 < k:
            states = stream.feed(token[:, None], (positions + i)[:, None], torch.ones(B, 1, dtype=torch.bool,
                                                                                    device=device))
    return torch.stack(tokens, 1), None if greedy else torch.stack(logits, 1)
