"""Sampling on vocab-sharded logits: the reference semantics, exactly, without ``[B, V]`` anywhere.

Each rank holds ``[B, rows]`` FP32 logits (its shard, padding columns ignored). Steps, each
sending its collectives only when some row needs them (all ranks take the same branches: every
decision is a function of replicated parameters and of gathered data); what a call sent is its
:class:`~vocabpar.wire.scripts.SamplePath`, whose script the planner prices:

1. round one, one all-gather: per row, the shard's (max, lowest id) with NaN folded into the
   max, then, if any row samples, the shard's top-c candidates (value desc, id asc). Greedy is
   this one collective (16 B per row).
2. top-k with k > c: a threshold search (:mod:`vocabpar.sampling.search`) between the merged
   candidates' k-th value and the highest value any rank did not send (``unsent_max``). With
   k <= c the merged candidates are exact.
3. top-p: the integer mass of its pool (the top-k set; with ``filter_order="vllm"`` only its
   tokens that pass min-p). Every unsent token is ``<= unsent_max``, so the candidates hold the
   pool when ``kappa > unsent_max``, when nothing is unsent, or (``"vllm"``) when
   ``unsent_max / t < min_z``; then they give the total, else one all-reduce does -- unless the
   candidates above ``unsent_max`` are unlikely to reach the target anyway
   (:func:`~vocabpar.sampling.candidates.unsent_mass`), in which case the search measures the
   total in its first round -- for every row the candidates do not hold, once one row searches.
   The candidates give the threshold if their cumulative mass reaches the target above
   ``unsent_max``; the rows left take a threshold search on masses, which draws them too.
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

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from vocabpar import comm
from vocabpar.kernels.fused import mass_totals, masses, scored
from vocabpar.layout import VocabLayout
from vocabpar.sampling import sigma
from vocabpar.sampling.candidates import (
    RoundOne,
    candidates_per_rank,
    gather_round_one,
    merged_max,
    unsent_mass,
)
from vocabpar.sampling.merged import merge_candidates
from vocabpar.sampling.params import Rows, SamplingParams, TokenCounts, check_sample_inputs, on_device
from vocabpar.sampling.ranks import Ranks, agreed, group_ranks, params_fact
from vocabpar.sampling.scoring import token_logprobs
from vocabpar.sampling.search import Draw, contenders, threshold_search, value_key
from vocabpar.sampling.semantics import (
    NEG_INF,
    PAD_KEY,
    SampleOutput,
    check_rows,
    drawn_logits,
    kept,
    key_value,
    mass_bits,
    mass_shift,
    merge_argmax,
    processed_logits,
    row_argmax,
    top_p_target,
    with_logprobs,
)
from vocabpar.wire.records import DRAW, TOTAL
from vocabpar.wire.scripts import SamplePath, Search, sample_script

MASS_BLOCK = 2**22
"""Logits per block when mass totals read a shard for many rows: bounds the eager pass's float64
temporaries."""


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
    choice = choose(local_logits, layout, inputs.ranks, rows, inputs.positions, inputs.token_counts,
                    inputs.bitmask)
    tokens, step = choice.tokens, choice.step
    path = replace(choice.path, checked=inputs.checked, top_n=None if rows.logprobs is None else rows.top_n)
    if rows.logprobs is None:
        return SampleOutput(tokens, script=sample_script(path))
    source = local_logits
    if rows.logprobs_of == "processed":
        source = choice.x if step is None else \
            drawn_logits(choice.x, step.m.temperature, step.kept(choice.thr), choice.sampled)
    # the ranks agreed on every input above: no second check
    scores = token_logprobs(source, layout, tokens, top_n=rows.top_n, group=group, check=False)
    out = with_logprobs(tokens, rows.logprobs, scores.logprobs, scores.ranks, scores.top_ids,
                        scores.top_logprobs)
    return replace(out, script=sample_script(path))


@dataclass(frozen=True)
class Drawn:
    """The sampler's work on a batch of rows: the ``tokens`` (-1 for sampled rows not drawn),
    this shard's processed logits ``x``, which rows were ``sampled`` (not greedy, finite max),
    when any was, the rows' state ``step`` and their final thresholds ``thr`` (a row keeps
    ``step.kept(thr)``), and the ``path`` the collectives took."""

    tokens: torch.Tensor
    x: torch.Tensor
    sampled: torch.Tensor
    step: SampledRows | None
    thr: torch.Tensor | None
    path: SamplePath


def choose(raw: torch.Tensor, layout: VocabLayout, ranks: Ranks, rows: Rows, positions: torch.Tensor,
           token_counts: TokenCounts | None = None, bitmask: torch.Tensor | None = None,
           draws: torch.Tensor | None = None, row_name: Callable[[int], str] | None = None) -> Drawn:
    """The sampler's steps on validated inputs (round one, thresholds, draw), shared by
    :func:`sample` and the speculative verifier: only rows in ``draws`` (all when ``None``) are
    drawn. NaN rows and rows with nothing allowed raise on every rank, named by ``row_name``.
    ``raw``: float32 ``[B, columns]``; ``positions``, ``draws``: ``[B]``."""
    V = layout.vocab_size
    ids = ranks.ids
    x = processed_logits(raw, ids, rows, lambda t: layout.local_ids(t, ranks.me), token_counts, bitmask)
    c = candidates_per_rank(rows, V, ranks)
    with_sigma = c > 0 and bool(((rows.top_n_sigma > 0) & ~rows.greedy).any())
    first = gather_round_one(raw, x, ids, c, ranks, sigma.terms(x, ids >= 0) if with_sigma else None)
    best, tokens, nan_rows = merged_max(first.max, first.max_id)
    check_rows(nan_rows, (best == NEG_INF) & ~nan_rows, row_name)
    sampled = ~rows.greedy & (best < float("inf"))
    if with_sigma:  # top-n-sigma: a mask ahead of every other filter
        x, cand = sigma.applied(x, first.cand, first.sigma.sum(0), best, rows)
        first = replace(first, cand=cand)
    path = SamplePath(raw.shape[0], c, sigma=with_sigma)
    step = thr = None
    if sampled.any():
        step = SampledRows(x, ids, rows, positions, sampled, ranks, V, c, first, best)
        kappa = step.top_k_threshold()
        thr = torch.maximum(kappa, step.top_p_threshold(kappa))
        tokens = step.draw(tokens, thr, sampled if draws is None else sampled & draws)
        path = replace(path, top_k=step.top_k_search, total_rows=step.total_rows,
                       top_p=step.top_p_search, draw_rows=step.draw_rows)
    return Drawn(tokens, x, sampled, step, thr, path)


# ---------------------------------------------------------------------- sampling rows
@dataclass
class SampledRows:
    """Per-call state of the sampled rows' steps: this shard's processed logits ``x`` ``[B,
    columns]``, the rows' parameters, and the merged round-one candidates (everything a rank
    holds above ``unsent_max`` is among them). Records the collectives its steps sent
    (``top_k_search``, ``total_rows``, ``top_p_search``, ``draw_rows``)."""

    x: torch.Tensor
    ids: torch.Tensor
    rows: Rows
    positions: torch.Tensor
    sampled: torch.Tensor
    ranks: Ranks
    V: int
    c: int
    first: RoundOne
    best: torch.Tensor

    def __post_init__(self) -> None:
        B, self.m = self.x.shape[0], merge_candidates(self.first.cand, self.first.cand_id, self.rows,
                                                      self.positions, self.sampled, self.best,
                                                      self.ranks.real_counts, self.V)
        self.drawn = torch.full((B,), -1, dtype=torch.long)  # tokens a threshold search drew
        self.top_k_search: Search | None = None
        self.top_p_search: Search | None = None
        self.total_rows = self.draw_rows = 0

    def rows_of(self, sel: torch.Tensor) -> torch.Tensor:
        """This shard's logits of rows ``sel`` (sorted, distinct): ``x`` itself, not a copy, when
        ``sel`` holds every row."""
        return self.x if sel.numel() == self.x.shape[0] else self.x[sel]

    def kept(self, thr: torch.Tensor) -> torch.Tensor:
        """Bool ``[B, columns]``: this shard's tokens each row keeps (``x >= thr``, ``z >= min_z``)."""
        return kept(self.x, thr, self.m.temperature, self.m.min_z)[1]

    def draw_for(self, search: torch.Tensor) -> Draw:
        return Draw(self.rows_of(search), self.ids, self.m.take(search))

    def top_k_threshold(self) -> torch.Tensor:
        """``kappa`` per row (-inf without top-k): the k-th largest value. Exact from the
        candidates when k <= c; else a threshold search (2–4 collectives) between the candidates'
        k-th value and ``unsent_max``, which also draws the rows that have no top-p."""
        m, k, n = self.m, self.rows.top_k, self.m.cand.shape[1]
        topk = self.sampled & (k > 0) & (k < self.V)
        exact = topk & (k <= self.c)
        kappa = torch.where(exact, m.kth_value(k), NEG_INF)
        search = (topk & ~exact).nonzero().flatten()
        if search.numel():
            # at least the merged candidates' k-th; at most unsent_max, since fewer than k
            # candidates lie above it (else the candidates would be exact)
            kth = m.key_sorted[search, (k[search] - 1).clamp(max=n - 1)]
            lo = torch.where((k[search] <= n) & (kth != PAD_KEY), kth + 2**31, 0)
            hi = value_key(torch.where(m.nothing_unsent, self.best, m.unsent_max)[search])
            draw = None if (self.rows.top_p[search] < 1).any() else self.draw_for(search)
            v, self.drawn[search], self.top_k_search = threshold_search(
                self.rows_of(search), self.ids >= 0, None, k[search], lo, hi, self.ranks, draw)
            kappa[search] = key_value(v - 2**31)
        return kappa

    def top_p_threshold(self, kappa: torch.Tensor) -> torch.Tensor:
        """``tau`` per row (-inf without top-p), from exact integer masses of the pool. The
        candidates give the total when they hold the whole pool, else one all-reduce of 8 bytes
        per row does (or the search's first round, where the candidates are unlikely to reach the
        target); they give tau when their cumulative mass reaches the target above
        ``unsent_max``; else a threshold search (2–4 collectives), which also draws the row."""
        B, V, order, m = self.x.shape[0], self.V, self.rows.filter_order, self.m
        t, z_max, min_z, unsent_max = m.temperature, m.z_max, m.min_z, m.unsent_max
        cand = m.cand
        tau = torch.full((B,), NEG_INF)
        topp = self.sampled & (self.rows.top_p < 1)
        if not topp.any():
            return tau
        # padding: -inf, mass 0
        cand_mass = masses(cand, *m.mass_terms(slice(None), kappa, self.pool_min_z))
        total = cand_mass.sum(1)
        complete = m.nothing_unsent | (kappa > unsent_max)  # unsent tokens are <= unsent_max
        if order == "vllm":  # no unsent token passes min-p
            complete |= unsent_max / t < min_z
        # rows whose candidates above unsent_max would fall short of the target even against
        # half the guessed unsent mass measure their total in the search's first round instead of
        # an all-reduce of its own; once one row searches, every row the candidates do not hold
        # does (a search after the all-reduce would cost a collective more). Either way is exact:
        # the guess only picks the cheaper
        above_unsent = torch.where(cand > unsent_max[:, None], cand_mass, 0).sum(1)
        unsent = unsent_mass(self.first, t, z_max, self.ranks, V)
        incomplete = topp & ~complete
        short = incomplete & (above_unsent < self.rows.top_p * (total + unsent / 2))
        fold = incomplete if bool(short.any()) else short
        missing = (incomplete & ~fold).nonzero().flatten()
        if missing.numel():
            local = mass_totals(self.rows_of(missing), *m.mass_terms(missing, kappa, self.pool_min_z))
            total[missing] = TOTAL.unpack(self.ranks.sum(TOTAL.pack(mass=local))).mass
            self.total_rows = missing.numel()
        target = top_p_target(total, self.rows.top_p)
        first, tau_c = m.top_p_cut(cand_mass, target)
        found = ~fold & (first < cand.shape[1])
        # tau_c > unsent_max: every token above it was sent. A complete pool needs no extra case:
        # tau_c is in the pool, so tau_c >= kappa, and with "vllm" tau_c / t >= min_z; either way
        # tau_c > unsent_max.
        certified = topp & found & ((tau_c > unsent_max) | m.nothing_unsent)
        tau[certified] = tau_c[certified]
        search = (topp & ~certified).nonzero().flatten()
        if search.numel():
            q = masses(self.rows_of(search), *m.mass_terms(search, kappa, self.pool_min_z))
            # at least tau_c when the candidates reach the target, else at least the value below
            # which masses are 0; at most unsent_max (the candidates above it fall short)
            floor_x = t * (z_max - mass_shift(V) * math.log(2) - 1)
            lo = value_key(torch.where(found, tau_c.double(), floor_x)[search])
            folded, known, p = fold[search], target[search], self.rows.top_p[search]
            need = lambda measured: torch.where(folded, top_p_target(measured, p), known)  # noqa: E731
            v, self.drawn[search], self.top_p_search = threshold_search(
                self.rows_of(search), self.ids >= 0, q, need, lo, value_key(unsent_max[search]), self.ranks,
                self.draw_for(search), mass_bits(V))
            tau[search] = key_value(v - 2**31)
        return tau

    @property
    def pool_min_z(self) -> torch.Tensor:
        """The min-p bound of the top-p pool: ``min_z`` with ``filter_order="vllm"``, else -inf."""
        return self.m.min_z if self.rows.filter_order == "vllm" else torch.full_like(self.m.min_z, NEG_INF)

    def kept_mass(self, sel: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
        """Integer masses ``[len(sel), columns]`` of this shard's tokens of rows ``sel`` that the
        rows keep, 0 elsewhere: the rows' final distribution, unnormalised."""
        return masses(self.rows_of(sel), *self.m.mass_terms(sel, thr))

    def kept_total_and_at(self, sel: torch.Tensor, thr: torch.Tensor,
                          cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of ``sel`` (sorted, distinct), this shard's total kept mass and the kept mass
        at column ``cols`` (``[len(sel)]``): the row sums and one entry of :meth:`kept_mass`,
        without its ``[len(sel), columns]``. A row whose kept tokens all lie in round one's
        candidates sums the candidates this rank sent (the same integers); the others read the
        shard, ``MASS_BLOCK`` logits at a time (eager, the pass's float64 temporaries are that
        large). One host read."""
        lower, t, min_z, z_max, scale = terms = self.m.mass_terms(sel, thr)
        at = masses(self.x[sel, cols][:, None], *terms)[:, 0]
        sent = self.all_sent(thr)[sel]
        count = int(sent.sum())
        order = torch.argsort(~sent, stable=True)  # the rows whose kept tokens were all sent first
        head, tail = order[:count], order[count:]
        total = torch.empty_like(at)
        mine = self.first.cand[self.ranks.me, sel[head]]  # [count, c]: the candidates this rank sent
        total[head] = masses(mine, lower[head], t[head], min_z[head], z_max[head], scale).sum(1)
        block = max(1, MASS_BLOCK // max(self.x.shape[1], 1))
        for part in tail.split(block):
            total[part] = mass_totals(self.rows_of(sel[part]), *self.m.mass_terms(sel[part], thr))
        return total, at

    def all_sent(self, thr: torch.Tensor) -> torch.Tensor:
        """Bool ``[B]``: rows whose kept tokens (``x >= thr``, ``z >= min_z``) all lie in round
        one's candidates: nothing unsent, every unsent token below ``thr``, or every unsent
        token below min-p."""
        m = self.m
        return m.nothing_unsent | (thr > m.unsent_max) | (m.unsent_max / m.temperature < m.min_z)

    def draw(self, tokens: torch.Tensor, thr: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """Gumbel-max over the kept tokens (``x >= thr``, ``z >= min_z``) of the ``wanted`` rows
        (the other sampled rows get -1): rows a search drew keep its token; rows whose kept tokens
        are all candidates are drawn locally; the rest take one all-gather of
        :data:`~vocabpar.wire.records.DRAW`, each rank's best (score, id)."""
        B, m = self.x.shape[0], self.m
        drawn = wanted & (self.drawn >= 0)
        local = wanted & ~drawn & self.all_sent(thr)
        tokens = torch.where(drawn, self.drawn, torch.where(self.sampled & ~wanted, -1, tokens))
        # the kept candidates' best score: exact where `local`, a lower bound on the winner elsewhere
        floor_score, arg = m.best_candidate(thr, wanted)
        tokens[local] = arg[local]
        spread = (wanted & ~local & ~drawn).nonzero().flatten()
        if spread.numel():
            r, col, z = contenders(self.rows_of(spread), self.ids, thr[spread], m.temperature[spread],
                                   m.min_z[spread], floor_score[spread], m.keys[spread])
            rows, ids = spread[r], self.ids[col]
            score, arg = row_argmax(rows, ids, scored(z, m.keys[rows], ids), B)
            got = DRAW.unpack(self.ranks.gather(DRAW.pack(score=score[spread], id=arg[spread])))
            _, tokens[spread] = merge_argmax(got.score, got.id)
            self.draw_rows = spread.numel()
        return tokens
