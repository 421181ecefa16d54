"""The sampler's steps after round one, written once for both schedules.

After round one every rank holds the same merged candidates (:class:`Merged`).
:func:`draw_from_round_one` takes each row's max and failure, applies the mask filters, and runs
:class:`Steps`, which computes from the candidates and this shard every number a call needs --
each filter's threshold from the candidates and whether the candidates certify it, the pool's
total, the draw among the candidates, the kept masses verification weighs -- and hands the rest
to its schedule (:mod:`vocabpar.sampling.schedules`), which chooses the rows each search, total
and draw runs on, the messages that carry them and how the shard is read:

1. top-k: the k-th largest value, certified by the candidates when ``k <= c`` or nothing is
   unsent; the other rows take the schedule's threshold search.
2. top-p: the integer mass of its pool (the top-k set; with ``filter_order="vllm"`` only its
   tokens that pass min-p). From round one's values alone, the candidates hold the pool when
   nothing is unsent, when ``kappa`` exceeds every unsent value or (``"vllm"``) when no unsent
   token passes min-p, and certify a cut that lies above every unsent value. With round one's
   tie counts (the fixed schedule sends them), they hold it when nothing is unsent or the top-k
   set lies in the candidates but for unsent tokens tied at ``kappa``, which they count, and
   certify its cut. The schedule measures the other totals and searches the other rows.
3. the draw: Gumbel-max over the kept tokens (``x >= thr``, ``z >= min_z``): the search's token
   where a search drew it, among the candidates where the schedule draws locally (the kept
   tokens were all sent), else the schedule's all-gather of each rank's best (score, id).

Every mass is an exact integer, so both schedules give :func:`reference_sample`'s tokens bit for
bit whatever rows they choose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from vocabpar.kernels.fused import masses
from vocabpar.sampling import masks as mask_filters
from vocabpar.sampling.candidates import merged_max
from vocabpar.sampling.merged import Merged, merge_candidates
from vocabpar.sampling.params import Rows
from vocabpar.sampling.ranks import Ranks
from vocabpar.sampling.semantics import NEG_INF, drawn_logits, kept, mass, top_p_target
from vocabpar.wire.records import Unpacked


class Schedule(Protocol):
    """How a call reaches the numbers :class:`Steps` defines: which rows each step runs on, what
    it sends, how it reads the shard and how it reports a failed row
    (:mod:`vocabpar.sampling.schedules`). Each method fills in the rows it chose with the steps'
    own functions and returns the others as given."""

    def any(self, rows: torch.Tensor) -> bool:
        """Whether a step over ``rows`` (bool ``[B]``) runs at all."""

    def failed(self, nan_rows: torch.Tensor, best: torch.Tensor) -> torch.Tensor | None:
        """Per-row failure codes (1 NaN, 2 nothing allowed: ``best``, the row's max, is -inf), or
        None having raised for them."""

    def top_k_search(self, steps: Steps, search: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
        """``kappa`` with the rows ``search`` found by a threshold search."""

    def pool_totals(self, steps: Steps, incomplete: torch.Tensor, cand_mass: torch.Tensor,
                    total: torch.Tensor, kappa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-p pool's totals, the ``incomplete`` rows' measured or left to the search's
        first round (``folded``, returned second)."""

    def top_p_search(self, steps: Steps, search: torch.Tensor, folded: torch.Tensor, found: torch.Tensor,
                     cut: torch.Tensor, target: torch.Tensor, kappa: torch.Tensor,
                     tau: torch.Tensor) -> torch.Tensor:
        """``tau`` with the rows ``search`` found by a threshold search on masses."""

    def drawn_locally(self, steps: Steps, wanted: torch.Tensor) -> torch.Tensor | None:
        """The rows of ``wanted`` drawn among the candidates (None: none)."""

    def spread_draw(self, steps: Steps, spread: torch.Tensor, floor_score: torch.Tensor | None,
                    tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` with the rows ``spread`` drawn over every rank's kept tokens."""

    def kept_total_and_at(self, steps: Steps, sel: torch.Tensor, cols: torch.Tensor,
                          terms: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Steps.kept_total_and_at`, reading the shard as the schedule chooses."""


@dataclass
class Steps:
    """A call's state after round one: this shard's processed logits ``x`` ``[B, columns]``, the
    columns' ``ids``, the rows' parameters, which rows are ``sampled``, the merge ``m`` of the
    ``c`` candidates each rank sent, after the mask filters (everything a rank holds above
    ``m.unsent_max`` is among them); ``tied`` (int64 ``[n, B]``, when round one counts them):
    each rank's unsent tokens equal to the last value it sent. :meth:`thresholds`
    sets ``thr`` (a row keeps ``x >= thr``, ``z >= min_z``)."""

    x: torch.Tensor
    ids: torch.Tensor
    rows: Rows
    sampled: torch.Tensor
    ranks: Ranks
    V: int
    c: int
    m: Merged
    schedule: Schedule
    tied: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.drawn: torch.Tensor | None = None
        """int64 ``[B]`` once a search drew its rows: their tokens, -1 elsewhere."""
        self.thr: torch.Tensor | None = None

    @property
    def sent(self) -> torch.Tensor:
        """float64 ``[n, B, c]``: the candidates each rank sent (a view of the merged ones)."""
        return self.m.cand.unflatten(1, (self.ranks.n, self.c)).transpose(0, 1)

    def rows_of(self, sel: torch.Tensor) -> torch.Tensor:
        """This shard's logits of rows ``sel`` (sorted, distinct): ``x`` itself, not a copy, when
        ``sel`` holds every row."""
        return self.x if sel.numel() == self.x.shape[0] else self.x[sel]

    @property
    def pool_min_z(self) -> torch.Tensor:
        """The min-p bound of the top-p pool: ``min_z`` with ``filter_order="vllm"``, else -inf."""
        return self.m.min_z if self.rows.filter_order == "vllm" else torch.full_like(self.m.min_z, NEG_INF)

    def thresholds(self) -> torch.Tensor:
        """``thr`` per row: the larger of the top-k and the top-p threshold (-inf where off)."""
        k = self.rows.top_k
        topk = self.sampled & (k > 0) & (k < self.V)
        k_sent = topk & (k <= self.c)  # the top-k set lies in every rank's candidates
        kappa = self.top_k_threshold(topk, k_sent)
        self.thr = torch.maximum(kappa, self.top_p_threshold(kappa, k_sent))
        return self.thr

    def top_k_threshold(self, topk: torch.Tensor, k_sent: torch.Tensor) -> torch.Tensor:
        """``kappa`` per row (-inf outside ``topk``, the rows with top-k): the k-th largest value,
        from the candidates where they certify it (``k_sent``: the top-k set lies in them; or
        nothing is unsent), else from the schedule's threshold search."""
        m = self.m
        exact = k_sent | (topk & m.nothing_unsent)
        kappa = torch.where(exact, m.kth_value(self.rows.top_k), NEG_INF)
        return self.schedule.top_k_search(self, topk & ~exact, kappa)

    def top_p_threshold(self, kappa: torch.Tensor, k_sent: torch.Tensor) -> torch.Tensor:
        """``tau`` per row (-inf without top-p), from exact integer masses of the pool: the
        candidates' cut where they hold the pool's total and every token above the cut, else the
        schedule's totals and threshold search. ``k_sent``: rows whose top-k set lies in the
        candidates."""
        m, order = self.m, self.rows.filter_order
        t, min_z, unsent_max = m.temperature, m.min_z, m.unsent_max
        tau = torch.full_like(kappa, NEG_INF)
        topp = self.sampled & (self.rows.top_p < 1)
        if not self.schedule.any(topp):
            return tau
        cand_mass = masses(m.cand, *m.mass_terms(slice(None), kappa, self.pool_min_z))  # padding: 0
        total = cand_mass.sum(1)
        if self.tied is None:  # unsent tokens are <= unsent_max
            complete = m.nothing_unsent | (kappa > unsent_max)
            if order == "vllm":  # no unsent token passes min-p
                complete |= unsent_max / t < min_z
        else:  # a top-k set in the candidates, but for unsent tokens tied at kappa: counted
            kappa_z = kappa.double() / t
            tie_in = (kappa > NEG_INF) & ((kappa_z >= min_z) if order == "vllm" else True)
            tied = torch.where(m.unsent & (m.last == kappa[None]), self.tied, 0).sum(0)
            total = total + torch.where(tie_in, tied * mass(kappa_z, m.z_max, self.V), 0)
            complete = k_sent | m.nothing_unsent
        total, folded = self.schedule.pool_totals(self, topp & ~complete, cand_mass, total, kappa)
        target = top_p_target(total, self.rows.top_p)
        reached, cut = m.top_p_cut(cand_mass, target)
        found = ~folded & (reached < m.cand.shape[1])
        if self.tied is None:
            # a cut above unsent_max has every token above it sent; a complete pool needs no extra
            # case (the cut lies in the pool, so cut >= kappa and, with "vllm", cut / t >= min_z)
            certified = found & ((cut > unsent_max) | m.nothing_unsent)
        else:  # a cut not reached among the sent tokens falls in the tied ones
            cut = torch.where(found, cut, kappa)
            certified = complete
        tau = torch.where(topp & certified, cut, tau)
        return self.schedule.top_p_search(self, topp & ~certified, folded, found, cut, target, kappa, tau)

    def all_sent(self) -> torch.Tensor:
        """Bool ``[B]``: rows whose kept tokens all lie in round one's candidates: nothing
        unsent, every unsent token below ``thr``, or every unsent token below min-p."""
        m = self.m
        return m.nothing_unsent | (self.thr > m.unsent_max) | (m.unsent_max / m.temperature < m.min_z)

    def draw(self, tokens: torch.Tensor, draws: torch.Tensor | None = None) -> torch.Tensor:
        """Gumbel-max over the kept tokens of the sampled rows in ``draws`` (bool ``[B]``; all
        when None), the other sampled rows -1 and the rest keeping ``tokens``: a search's token
        where it drew one, the best candidate where the schedule draws locally, else the
        schedule's all-gather of each rank's best."""
        wanted = self.sampled if draws is None else self.sampled & draws
        if draws is not None:
            tokens = torch.where(self.sampled & ~draws, -1, tokens)
        if self.drawn is not None:
            tokens = torch.where(wanted & (self.drawn >= 0), self.drawn, tokens)
            wanted = wanted & (self.drawn < 0)
        local, floor_score = self.schedule.drawn_locally(self, wanted), None
        if local is not None:
            # the kept candidates' best score: exact where `local`, a lower bound on the winner elsewhere
            floor_score, arg = self.m.best_candidate(self.thr, wanted)
            tokens = torch.where(local, arg, tokens)
            wanted = wanted & ~local
        return self.schedule.spread_draw(self, wanted, floor_score, tokens)

    def kept(self) -> torch.Tensor:
        """Bool ``[B, columns]``: this shard's tokens each row keeps."""
        return kept(self.x, self.thr, self.m.temperature, self.m.min_z)[1]

    def drawn_from(self) -> torch.Tensor:
        """The float32 logits each row was drawn from (processed logprobs)."""
        return drawn_logits(self.x, self.m.temperature, self.kept(), self.sampled)

    def kept_mass(self, sel: torch.Tensor) -> torch.Tensor:
        """int64 ``[len(sel), columns]``: exact masses of this shard's tokens of rows ``sel`` that
        the rows keep, 0 elsewhere: the rows' final distribution, unnormalised."""
        return masses(self.rows_of(sel), *self.m.mass_terms(sel, self.thr))

    def kept_total_and_at(self, sel: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of ``sel`` (sorted, distinct), this shard's total kept mass and the kept mass
        at column ``cols`` (``[len(sel)]``): the row sums and one entry of :meth:`kept_mass`,
        without its ``[len(sel), columns]`` (the schedule chooses how it reads the shard)."""
        return self.schedule.kept_total_and_at(self, sel, cols, self.m.mass_terms(sel, self.thr))


@dataclass(frozen=True)
class Drawn:
    """A call's tokens (-1 for sampled rows not drawn; failed rows hold their greedy id), this
    shard's processed logits ``x`` (the mask filters applied), which rows were ``sampled`` (not greedy,
    finite max, not failed), the per-row failure ``codes`` (1 NaN, 2 nothing allowed; None where
    the schedule raised instead) and the sampled rows' :class:`Steps` (None when none samples)."""

    tokens: torch.Tensor
    x: torch.Tensor
    sampled: torch.Tensor
    codes: torch.Tensor | None
    steps: Steps | None

    def drawn_from(self) -> torch.Tensor:
        """The float32 logits each row was drawn from (processed logprobs)."""
        return self.x if self.steps is None else self.steps.drawn_from()


def draw_from_round_one(x: torch.Tensor, ids: torch.Tensor, rows: Rows, positions: torch.Tensor, ranks: Ranks,
                        V: int, first: Unpacked, schedule: Schedule, *, masks: tuple[str, ...] = (),
                        ties: bool = False, draws: torch.Tensor | None = None) -> Drawn:
    """Everything after round one, on either schedule: each row's max and greedy id, its failure
    (the schedule raises or flags it), the mask filters ``masks`` (round one carried their sums),
    then the sampled rows' :class:`Steps` -- thresholds and the draw (only rows in
    ``draws``, all when None). ``first``: round one's gathered fields
    (:func:`~vocabpar.wire.records.round_one`, each ``[n, B, ...]``; with ``ties``, its tie counts);
    ``x``: this shard's processed logits ``[B, columns]``."""
    best, tokens, nan_rows = merged_max(first.max, first.max_id)
    codes = schedule.failed(nan_rows, best)
    sampled = ~rows.greedy & (best < float("inf"))
    sampled = sampled if codes is None else sampled & (codes == 0)
    values, c = first.values, first.values.shape[2]
    if masks:  # the mask filters, ahead of every other filter
        x, values = mask_filters.applied(masks, x, values, first, best, rows)
    steps = None
    if c and schedule.any(sampled):
        merged = merge_candidates(values, first.ids, rows, positions, sampled, best, ranks.real_counts, V)
        # each rank's unsent tokens equal to the last value it sent: its ties less those it sent
        tied = first.ties - ((values == merged.last[..., None]) & (first.ids >= 0)).sum(2) if ties else None
        steps = Steps(x, ids, rows, sampled, ranks, V, c, merged, schedule, tied)
        steps.thresholds()
        tokens = steps.draw(tokens, draws)
    return Drawn(tokens, x, sampled, codes, steps)
