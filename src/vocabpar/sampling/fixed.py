"""The engine sampler's steps after round one, for whole blocks of rows: thresholds, the draw
and speculative verification's masses and correction, each with the plan's collectives only.

The numbers are those of the adaptive sampler (:mod:`vocabpar.sampling.adaptive`) and the
verifier (:mod:`vocabpar.sampling.verify`): exact integer masses, keyed Gumbel noise, the same
tie rules. What changes is how they are reached: every row goes through every step the plan
holds, masked instead of compacted, so no step reads a device value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vocabpar.kernels.fused import (
    best_kept,
    int32_sums,
    logit_histogram,
    mass_totals,
    masses,
)
from vocabpar.layout import VocabLayout
from vocabpar.sampling.acceptance import correction, weigh
from vocabpar.sampling.dense import padded, threshold
from vocabpar.sampling.failures import Check
from vocabpar.sampling.merged import Merged, merge_candidates
from vocabpar.sampling.params import Rows
from vocabpar.sampling.ranks import Ranks
from vocabpar.sampling.semantics import (
    NEG_INF,
    drawn_logits,
    kept,
    key_value,
    mass,
    mass_bits,
    merge_argmax,
    top_p_pool,
    top_p_target,
)
from vocabpar.wire.records import DRAW, Unpacked
from vocabpar.wire.scripts import EnginePlan


@dataclass
class MaskedRows:
    """A call's state after round one: this shard's ``raw`` and processed logits ``x`` ``[B,
    R]``, the columns' ``ids`` and ``real`` mask, the tokens so far, which rows are ``sampled``,
    the per-row failure ``codes`` and the folded :class:`~vocabpar.sampling.failures.Check`.
    :meth:`sample` fills in the merged candidates (temperature, min-p bound) and thresholds."""

    raw: torch.Tensor
    x: torch.Tensor
    ids: torch.Tensor
    real: torch.Tensor
    tokens: torch.Tensor
    sampled: torch.Tensor
    codes: torch.Tensor
    check: Check
    vocab: int
    m: Merged | None = None
    thr: torch.Tensor | None = None

    def settle(self, tokens: torch.Tensor) -> MaskedRows:
        """Final tokens: -1 for failed rows."""
        self.tokens = torch.where(self.codes > 0, -1, tokens)
        return self

    def drawn_from(self) -> torch.Tensor:
        """The float32 logits each row was drawn from (processed logprobs)."""
        if self.thr is None:
            return self.x
        keep = kept(self.x, self.thr, self.m.temperature, self.m.min_z)[1]
        return drawn_logits(self.x, self.m.temperature, keep, self.sampled)

    def kept_mass(self, sel: torch.Tensor) -> torch.Tensor:
        """int64 ``[F, R]``: exact masses of the kept tokens of rows ``sel``, 0 elsewhere."""
        return masses(self.x[sel], *self.m.mass_terms(sel, self.thr))

    def kept_total_and_at(self, sel: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of ``sel``, the total kept mass and the kept mass at column ``cols`` (``[F]``):
        the row sums and one entry of :meth:`kept_mass`, without its ``[F, R]``."""
        x, terms = self.x[sel], self.m.mass_terms(sel, self.thr)
        return mass_totals(x, *terms), masses(x.gather(1, cols[:, None]), *terms)[:, 0]

    def sample(self, ranks: Ranks, rows: Rows, positions: torch.Tensor, plan: EnginePlan,
               first: Unpacked, best: torch.Tensor) -> MaskedRows:
        """Thresholds and the draw for the sampled rows (``first``: round one's gathered
        fields, ``best``: each row's max). Steps:

        1. top-k: the k-th largest value from the merged candidates when ``k <= c`` (or nothing
           is unsent), else a threshold search (three histogram all-reduces);
        2. top-p: from the candidates when the top-k set lies in them -- a cut that split a tied
           group at the k-th value is counted from round one's tie counts -- else a search on
           masses whose first round measures the total;
        3. the draw: Gumbel-max over the kept tokens, among the candidates when nothing is
           unsent, else one all-gather of each rank's best (score, id)."""
        V, B, c = self.vocab, self.x.shape[0], plan.candidates
        x, sampled = self.x, self.sampled
        m = self.m = merge_candidates(first.values, first.ids, rows, positions, sampled, best,
                                      ranks.real_counts, V)
        t, z_max, min_z = m.temperature, m.z_max, m.min_z
        all_sent = not plan.draw  # the plan draws by all-gather exactly when some rank holds unsent tokens
        # 1. top-k
        k = rows.top_k
        topk = sampled & (k > 0) & (k < V)
        exact_k = topk & ((k <= c) | all_sent)
        kappa = torch.where(exact_k, m.kth_value(k), NEG_INF)
        ids, no_min = self.ids, torch.full_like(min_z, NEG_INF)

        def counted(lower: torch.Tensor, pool_z: torch.Tensor, unit: bool):
            """This shard's histogram of the tokens with ``x >= lower``, ``z >= pool_z``."""
            narrow = int32_sums(1 if unit else mass_bits(V), x.shape[1])
            return lambda shift, bits, prefix, top: logit_histogram(
                x, ids, lower, t, pool_z, z_max, m.scale, shift, bits, prefix, top, unit, narrow)

        if plan.top_k_search:
            large = topk & ~exact_k
            v = threshold(counted(torch.where(large, no_min, float("inf")), no_min, True), B, k, ranks,
                          plan.rows, x.device, plan.search_bits)
            kappa = torch.where(large, key_value(v - 2**31), kappa)
        # 2. top-p
        topp = sampled & (rows.top_p < 1)
        order = rows.filter_order
        pool_z = min_z if order == "vllm" else no_min
        pool = (m.cand_id >= 0) & top_p_pool(m.cand, m.cand_z, kappa[:, None], min_z[:, None], order)
        cand_mass = masses(m.cand, *m.mass_terms(slice(None), kappa, pool_z))
        sent_tied = ((first.values == m.last[..., None]) & (first.ids >= 0)).sum(2)
        tied = torch.where(m.unsent & (m.last == kappa[None]), first.ties - sent_tied, 0).sum(0)
        kappa_z = kappa.double() / t
        tie_in = (kappa > NEG_INF) & ((kappa_z >= min_z) if order == "vllm" else True)
        total = cand_mass.sum(1) + torch.where(tie_in, tied * mass(kappa_z, z_max, V), 0)
        reached, at = m.top_p_cut(cand_mass, top_p_target(total, rows.top_p))
        tau = torch.where(reached < pool.sum(1), at, kappa)
        from_candidates = exact_k | all_sent
        tau = torch.where(topp & from_candidates, tau, NEG_INF)
        if plan.top_p_search:
            search = topp & ~from_candidates
            pooled = counted(torch.where(search, kappa.double(), float("inf")), pool_z, False)
            v = threshold(pooled, B, lambda measured: top_p_target(measured, rows.top_p), ranks, plan.rows,
                          x.device, plan.search_bits)
            tau = torch.where(search, key_value(v - 2**31), tau)
        self.thr = torch.maximum(kappa, tau)
        # 3. the draw
        if plan.draw:
            lower = torch.where(sampled, self.thr.double(), float("inf"))
            score, arg = best_kept(x, self.ids, lower, t, min_z, m.keys)
            got = DRAW.unpack(ranks.gather(padded(DRAW.pack(score=score, id=arg), plan.rows))[:, :B])
            _, drawn = merge_argmax(got.score, got.id)
        else:
            _, drawn = m.best_candidate(self.thr)
        return self.settle(torch.where(sampled, drawn, self.tokens))


class DraftPairs:
    """Verification with draft logits: per (row, draft position), the target's and the draft's
    exact kept masses and each one's mass of the draft token, summed over ranks in one
    all-reduce of ``max_rows`` rows; and the correction after a rejection, drawn from
    ``(p - q)+`` by one all-gather of ``max_rows`` rows."""

    def __init__(self, ranks: Ranks, layout: VocabLayout, max_rows: int, choice: MaskedRows, rows: Rows,
                 positions: torch.Tensor, drafts: torch.Tensor) -> None:
        B, k = drafts.shape
        device = drafts.device
        self.ranks, self.max_rows, self.choice, self.rows, self.positions, self.k = (
            ranks, max_rows, choice, rows, positions, k)
        # pair (b, i): target row b·(k+1) + i, draft row B·(k+1) + b·k + i (every row is stacked)
        pair = torch.arange(B * k, device=device)
        self.target_rows = pair + pair // k  # b·k + i -> b·(k+1) + i
        self.draft_rows = pair + B * (k + 1)
        self.weighed = choice.sampled[: B * (k + 1)].view(B, k + 1)[:, :k]
        cols, owned = layout.local_ids(drafts.reshape(-1), ranks.me)
        cols, owned = cols.to(device), owned.to(device)
        seeds = rows.seed[:, None].expand(B, k).reshape(-1)
        at = (positions[:, None] + torch.arange(k, device=device)).reshape(-1)
        self.total, accept = weigh(choice.kept_total_and_at, self.target_rows, self.draft_rows, cols, owned,
                                   seeds, at, lambda t: ranks.sum(padded(t, max_rows))[: B * k])
        self.accept = accept.view(B, k)

    def correct(self, last: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """The correction of each row that rejected a weighed draft, else ``last``; a row where
        ``p <= q`` everywhere (only when rounding makes them equal) keeps the target's draw."""
        k, choice = self.k, self.choice
        B = last.shape[0]
        j = accepted.clamp(max=k - 1)
        rejected = (accepted < k) & self.weighed.gather(1, j[:, None])[:, 0]
        pair = torch.arange(B, device=last.device) * k + j
        gather = lambda t: self.ranks.gather(padded(t, self.max_rows))[:, :B]  # noqa: E731
        token = correction(choice.kept_mass(self.target_rows[pair]), self.total.target_total[pair],
                           choice.kept_mass(self.draft_rows[pair]), self.total.draft_total[pair],
                           self.rows.seed, self.positions + j, choice.ids, gather)
        return torch.where(rejected & (token >= 0), token, last)
