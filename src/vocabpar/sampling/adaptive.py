"""Sampling on vocab-sharded logits: the reference semantics, exactly, without ``[B, V]`` anywhere.

Each rank holds ``[B, rows]`` FP32 logits (its shard, padding columns ignored). :func:`sample`
is round one, then :class:`~vocabpar.sampling.steps.Steps` on the adaptive schedule
(:class:`~vocabpar.sampling.schedules.Adaptive`): each step sends its collectives only when some
row needs them (all ranks take the same branches: every decision is a function of replicated
parameters and of gathered data); what a call sent is its
:class:`~vocabpar.wire.scripts.SamplePath`, whose script the planner prices:

1. round one, one all-gather: per row, the shard's (max, lowest id) with NaN folded into the
   max, then, if any row samples, the shard's top-c candidates (value desc, id asc). Greedy is
   this one collective (16 B per row).
2. top-k: exact from the merged candidates when k <= c or nothing is unsent; else a threshold
   search (:mod:`vocabpar.sampling.search`) between the candidates' k-th value and the highest
   value any rank did not send (``unsent_max``).
3. top-p: the integer mass of its pool. The candidates give the total where they hold the pool,
   else one all-reduce does -- unless the candidates above ``unsent_max`` are unlikely to reach
   the target anyway (:func:`~vocabpar.sampling.candidates.unsent_mass`), in which case the
   search measures the total in its first round -- for every row the candidates do not hold,
   once one row searches. The candidates give the threshold if their cumulative mass reaches
   the target above ``unsent_max``; the rows left take a threshold search on masses, which
   draws them too.
4. Gumbel-max over the kept tokens: rows a threshold search drew keep that
   token; rows whose kept tokens are all candidates are drawn locally; the rest take one
   all-gather of each rank's best (score, id).
5. logprobs (raw or processed): :func:`vocabpar.sampling.scoring.token_logprobs` of the chosen
   tokens, one all-gather of per-shard (max, sum-exp, chosen logit, top-n) and one all-reduce of
   rank counts; each logprob is ``(x - M) - log(S)``, precise for huge logits.

Collectives per call: greedy 1; candidates enough 1–2; top-p or a large top-k 4 (round one,
two histogram rounds, the settle that also draws), whatever the rows hold -- tied tokens share
one settle entry; a top-p row the candidates were expected to settle and did not, or a settle
crowded with more than ``SETTLE_TOKENS`` distinct keys in a bucket of ``2**SETTLE_BITS``, adds
one; worst case (top-k search, the total, then a top-p search, both crowded) ``1 + (2 + 1 + 1) +
1 + (2 + 1 + 1) + 1 = 11``, plus 2 for logprobs and 1 for the agreement check (unless turned
off). Bytes depend on B, n and the candidate count, never on V. All masses are exact integers,
so the tokens equal :func:`reference_sample`'s bit for bit; see :mod:`vocabpar.sampling.semantics` and
:mod:`vocabpar.sampling.noise` for the float steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from vocabpar import comm
from vocabpar.layout import VocabLayout
from vocabpar.sampling.candidates import gather_round_one, round_one_contents
from vocabpar.sampling.params import Rows, SamplingParams, TokenCounts, check_sample_inputs, on_device
from vocabpar.sampling.ranks import Ranks, agreed, group_ranks, params_fact
from vocabpar.sampling.schedules import Adaptive
from vocabpar.sampling.scoring import token_logprobs
from vocabpar.sampling.semantics import SampleOutput, processed_logits, with_logprobs
from vocabpar.sampling.steps import Drawn, draw_from_round_one
from vocabpar.wire.scripts import SamplePath, sample_script


def sample(local_logits: torch.Tensor, layout: VocabLayout, params: SamplingParams, *,
           positions: torch.Tensor, group: comm.ProcessGroup = None, token_counts: TokenCounts | None = None,
           bitmask: torch.Tensor | None = None, check: bool | None = None,
           output_lens: torch.Tensor | None = None) -> SampleOutput:
    """Sample one token per row from this rank's FP32 shard ``[B, rows]``; every rank of the
    group returns the same :class:`SampleOutput`, equal to :func:`reference_sample` on the full
    logits. Invalid input on any rank, or ranks that disagree on the layout, the batch, the
    parameters, positions, token counts or bitmask (:func:`vocabpar.comm.agree`; ``check``
    ``None`` follows ``VOCABPAR_CHECK``), raise the same ``ValueError`` on every rank before the
    first collective; NaN rows and rows with nothing allowed raise it on every rank after it.
    Works on the device of ``local_logits`` (CUDA under NCCL)."""
    with on_device(local_logits.device):
        return _sample_on_device(local_logits, layout, params, positions, group, token_counts, bitmask, check,
                                 output_lens)


@dataclass(frozen=True)
class _Inputs:
    """The validated per-call inputs, on the logits' device; ``checked``: the agreement ran."""

    ranks: Ranks
    rows: Rows
    positions: torch.Tensor
    token_counts: TokenCounts | None
    bitmask: torch.Tensor | None
    checked: bool = False


def _checked_inputs(local_logits, layout, params, positions, group, token_counts, bitmask,
                    check, output_lens) -> _Inputs:
    """Validate this rank's input, then (when the logits are sharded) agree with the other ranks
    on everything that must be replicated: one 256-byte all-gather."""
    checked: list[_Inputs] = []

    def facts() -> dict[str, comm.Fact]:
        ranks = group_ranks(layout, group)
        V = layout.vocab_size
        rows, pos, counts, mask = check_sample_inputs("local logits", local_logits, ranks.ids.numel(), V,
                                                      params, positions, token_counts, bitmask,
                                                      f" on rank {ranks.me}", output_lens)
        checked.append(_Inputs(ranks, rows, pos, counts, mask))
        seen = [] if counts is None else [counts.ids, counts.counts] + (
            [] if counts.in_prompt is None else [counts.in_prompt.long()])
        wanted = torch.full((local_logits.shape[0],), -1) if rows.logprobs is None else rows.logprobs
        return {**layout.describe(), "rows": local_logits.shape[0], "logprobs": wanted,
                "filter_order": rows.filter_order,
                "sampling parameters": params_fact(rows),
                "positions": pos, "token counts": torch.cat([t.flatten() for t in seen] + [torch.zeros(0)]),
                "bitmask": torch.zeros(0) if mask is None else mask}

    ran = agreed("sample", layout, group, facts, check)
    return replace(checked[0], checked=ran)


def _sample_on_device(local_logits, layout, params, positions, group, token_counts, bitmask,
                      check, output_lens) -> SampleOutput:
    inputs = _checked_inputs(local_logits, layout, params, positions, group, token_counts, bitmask, check,
                             output_lens)
    rows = inputs.rows
    choice, path = choose(local_logits, layout, inputs.ranks, rows, inputs.positions, inputs.token_counts,
                          inputs.bitmask)
    tokens = choice.tokens
    path = replace(path, checked=inputs.checked, top_n=None if rows.logprobs is None else rows.top_n)
    if rows.logprobs is None:
        return SampleOutput(tokens, script=sample_script(path))
    source = choice.drawn_from() if rows.logprobs_of == "processed" else local_logits
    # the ranks agreed on every input above: no second check
    scores = token_logprobs(source, layout, tokens, top_n=rows.top_n, group=group, check=False)
    out = with_logprobs(tokens, rows.logprobs, scores.logprobs, scores.ranks, scores.top_ids,
                        scores.top_logprobs)
    return replace(out, script=sample_script(path))


def choose(raw: torch.Tensor, layout: VocabLayout, ranks: Ranks, rows: Rows, positions: torch.Tensor,
           token_counts: TokenCounts | None = None, bitmask: torch.Tensor | None = None,
           draws: torch.Tensor | None = None,
           row_name: Callable[[int], str] | None = None) -> tuple[Drawn, SamplePath]:
    """Round one, then the steps on the adaptive schedule, on validated inputs; shared by
    :func:`sample` and the speculative verifier: only rows in ``draws`` (all when ``None``) are
    drawn. NaN rows and rows with nothing allowed raise on every rank, named by ``row_name``.
    ``raw``: float32 ``[B, columns]``; ``positions``, ``draws``: ``[B]``. Returns the draw and
    the path its collectives took."""
    V = layout.vocab_size
    ids = ranks.ids
    x = processed_logits(raw, ids, rows, lambda t: layout.local_ids(t, ranks.me), token_counts, bitmask)
    c, masks = round_one_contents(rows, ranks)
    first = gather_round_one(raw, x, ids, c, ranks, masks)
    schedule = Adaptive(row_name)
    drawn = draw_from_round_one(x, ids, rows, positions, ranks, V, first, schedule, masks=masks,
                                draws=draws)
    return drawn, SamplePath(raw.shape[0], c, top_k=schedule.top_k, total_rows=schedule.total_rows,
                             top_p=schedule.top_p, draw_rows=schedule.draw_rows, masks=masks)
