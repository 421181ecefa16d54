"""The engine sampler's steps after round one, for whole blocks of rows: thresholds, the draw
and speculative verification's masses and correction, each with the plan's collectives only.

The numbers are those of the adaptive sampler (:mod:`vocabpar.sampling.adaptive`) and the
verifier (:mod:`vocabpar.sampling.verify`): exact integer masses, keyed Gumbel noise, the same
tie rules. What changes is how they are reached: every row goes through every step the plan
holds, masked instead of compacted, so no step reads a device value.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from vocabpar.kernels.fused import (
    accept_uniforms,
    best_kept,
    int32_sums,
    logit_histogram,
    mass_totals,
    masses,
    residual,
    sample_keys,
)
from vocabpar.layout import VocabLayout
from vocabpar.sampling.dense import threshold
from vocabpar.sampling.failures import Check
from vocabpar.sampling.params import Rows
from vocabpar.sampling.ranks import Ranks
from vocabpar.sampling.semantics import (
    NEG_INF,
    PAD_KEY,
    accepts,
    drawn_logits,
    key_value,
    mass,
    mass_bits,
    mass_shift,
    merge_argmax,
    min_p_threshold,
    order_key,
    top_p_pool,
    top_p_target,
)
from vocabpar.wire.records import DRAW, MASSES, Unpacked
from vocabpar.wire.scripts import EnginePlan


def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` ``[T, ...]`` as ``rows`` rows (zeros after it): a message of the fixed size."""
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


@dataclass
class MaskedRows:
    """A call's state after round one: this shard's ``raw`` and processed logits ``x`` ``[B,
    R]``, the columns' ``ids`` and ``real`` mask, the tokens so far, which rows are ``sampled``,
    the per-row failure ``codes`` and the folded :class:`~vocabpar.sampling.failures.Check`.
    :meth:`sample` fills in the temperature, min-p bound and thresholds."""

    raw: torch.Tensor
    x: torch.Tensor
    ids: torch.Tensor
    real: torch.Tensor
    tokens: torch.Tensor
    sampled: torch.Tensor
    codes: torch.Tensor
    check: Check
    vocab: int
    temperature: torch.Tensor | None = None
    z_max: torch.Tensor | None = None
    min_z: torch.Tensor | None = None
    thr: torch.Tensor | None = None

    def settle(self, tokens: torch.Tensor) -> MaskedRows:
        """Final tokens: -1 for failed rows."""
        self.tokens = torch.where(self.codes > 0, -1, tokens)
        return self

    def drawn_from(self) -> torch.Tensor:
        """The float32 logits each row was drawn from (processed logprobs)."""
        if self.thr is None:
            return self.x
        return drawn_logits(self.x, self.temperature, self.kept(), self.sampled)

    def kept(self, sel: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Bool ``[F, R]``: the kept tokens of rows ``sel``."""
        return (self.x[sel] >= self.thr[sel, None]) & (self.z[sel] >= self.min_z[sel, None])

    def kept_mass(self, sel: torch.Tensor) -> torch.Tensor:
        """int64 ``[F, R]``: exact masses of the kept tokens of rows ``sel``, 0 elsewhere."""
        return masses(*self._mass_inputs(sel))

    def kept_total_and_at(self, sel: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of ``sel``, the total kept mass and the kept mass at column ``cols`` (``[F]``):
        the row sums and one entry of :meth:`kept_mass`, without its ``[F, R]``."""
        x, *rest = self._mass_inputs(sel)
        return mass_totals(x, *rest), masses(x.gather(1, cols[:, None]), *rest)[:, 0]

    def _mass_inputs(self, sel: torch.Tensor) -> tuple:
        """The :func:`~vocabpar.kernels.fused.masses` arguments of the kept tokens of rows ``sel``."""
        return (self.x[sel], self.thr[sel].double(), self.temperature[sel], self.min_z[sel], self.z_max[sel],
                mass_shift(self.vocab))

    @cached_property
    def z(self) -> torch.Tensor:
        """float64 ``[B, R]``: ``x / t``, computed once, on the first step that needs it."""
        return self.x.double() / self.temperature[:, None]

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
        n, x, sampled = ranks.n, self.x, self.sampled
        t = torch.where(sampled, rows.temperature, 1.0)
        z_max = torch.where(sampled, best / t, 0.0)
        min_z = min_p_threshold(z_max, rows.min_p)
        self.temperature, self.z_max, self.min_z = t, z_max, min_z
        cand = first.values.permute(1, 0, 2).reshape(B, n * c)  # [B, n·c]
        cand_id = first.ids.permute(1, 0, 2).reshape(B, n * c)
        cand_z = cand / t[:, None]
        valid = cand_id >= 0
        key_sorted, key_order = torch.where(valid, order_key(cand.float()), PAD_KEY).sort(1, descending=True)
        unsent = torch.tensor([c < count for count in ranks.real_counts], device=x.device)
        all_sent = not plan.draw  # the plan draws by all-gather exactly when some rank holds unsent tokens
        # 1. top-k
        k = rows.top_k
        topk = sampled & (k > 0) & (k < V)
        exact_k = topk & ((k <= c) | all_sent)
        kth = key_sorted.gather(1, (k - 1).clamp(0, max(n * c - 1, 0))[:, None])[:, 0]
        kappa = torch.where(exact_k, torch.where(kth == PAD_KEY, NEG_INF, key_value(kth)), NEG_INF)
        ids, no_min, scale = self.ids, torch.full_like(min_z, NEG_INF), mass_shift(V)

        def counted(lower: torch.Tensor, pool_z: torch.Tensor, unit: bool):
            """This shard's histogram of the tokens with ``x >= lower``, ``z >= pool_z``."""
            narrow = int32_sums(1 if unit else mass_bits(V), x.shape[1])
            return lambda shift, bits, prefix, top: logit_histogram(
                x, ids, lower, t, pool_z, z_max, scale, shift, bits, prefix, top, unit, narrow)

        if plan.top_k_search:
            large = topk & ~exact_k
            v = threshold(counted(torch.where(large, no_min, float("inf")), no_min, True), B, k, ranks,
                          plan.rows, x.device, plan.search_bits)
            kappa = torch.where(large, key_value(v - 2**31), kappa)
        # 2. top-p
        topp = sampled & (rows.top_p < 1)
        order = rows.filter_order
        pool = valid & top_p_pool(cand, cand_z, kappa[:, None], min_z[:, None], order)
        cand_mass = masses(cand, kappa.double(), t, min_z if order == "vllm" else no_min, z_max, scale)
        last = first.values[..., c - 1]  # [n, B]: each rank's c-th value
        sent_tied = ((first.values == last[..., None]) & (first.ids >= 0)).sum(2)
        tied = torch.where(unsent[:, None] & (last == kappa[None]), first.ties - sent_tied, 0).sum(0)
        kappa_z = kappa.double() / t
        tie_in = (kappa > NEG_INF) & ((kappa_z >= min_z) if order == "vllm" else True)
        total = cand_mass.sum(1) + torch.where(tie_in, tied * mass(kappa_z, z_max, V), 0)
        target = top_p_target(total, rows.top_p)
        reached = (cand_mass.gather(1, key_order).cumsum(1) < target[:, None]).sum(1)
        at = key_value(key_sorted.gather(1, reached.clamp(max=max(n * c - 1, 0))[:, None])[:, 0])
        tau = torch.where(reached < pool.sum(1), at, kappa)
        from_candidates = exact_k | all_sent
        tau = torch.where(topp & from_candidates, tau, NEG_INF)
        if plan.top_p_search:
            search = topp & ~from_candidates
            pool_z = min_z if order == "vllm" else no_min
            pooled = counted(torch.where(search, kappa.double(), float("inf")), pool_z, False)
            v = threshold(pooled, B, lambda measured: top_p_target(measured, rows.top_p), ranks, plan.rows,
                          x.device, plan.search_bits)
            tau = torch.where(search, key_value(v - 2**31), tau)
        self.thr = torch.maximum(kappa, tau)
        # 3. the draw
        keys = sample_keys(rows.seed, positions)
        if plan.draw:
            lower = torch.where(sampled, self.thr.double(), float("inf"))
            score, arg = best_kept(x, self.ids, lower, t, min_z, keys)
            got = DRAW.unpack(ranks.gather(padded(DRAW.pack(score=score, id=arg), plan.rows))[:, :B])
            _, drawn = merge_argmax(got.score, got.id)
        else:
            # the same pass over the merged candidates (ids per entry): z = cand / t is cand_z
            _, drawn = best_kept(cand, cand_id, self.thr.double(), t, min_z, keys)
        return self.settle(torch.where(sampled, drawn, self.tokens))


class DraftPairs:
    """Verification with draft logits: per (row, draft position), the target's and the draft's
    exact kept masses and each one's mass of the draft token, summed over ranks in one
    all-reduce of ``max_rows`` rows; and the correction after a rejection, drawn from
    ``(p - q)+`` by one all-gather of ``max_rows`` rows."""

    def __init__(self, ranks: Ranks, layout: VocabLayout, max_rows: int, choice: MaskedRows, rows: Rows,
                 positions: torch.Tensor, drafts: torch.Tensor, drafted: list[int]) -> None:
        B, k = drafts.shape
        device = drafts.device
        self.ranks, self.max_rows, self.choice, self.rows, self.positions, self.k = (
            ranks, max_rows, choice, rows, positions, k)
        slot = [-1] * B
        for s, b in enumerate(drafted):
            slot[b] = s
        pair_b = [b for b in range(B) for _ in range(k)]
        pair_i = [i for _ in range(B) for i in range(k)]
        # the draft row of a pair (the target row itself for rows without a draft: never weighed)
        draft_row = [B * (k + 1) + slot[b] * k + i if slot[b] >= 0 else b * (k + 1) + i
                     for b, i in zip(pair_b, pair_i)]
        self.target_rows = torch.tensor([b * (k + 1) + i for b, i in zip(pair_b, pair_i)], device=device)
        self.draft_rows = torch.tensor(draft_row, device=device)
        has_draft = torch.tensor([s >= 0 for s in slot], device=device)
        self.weighed = choice.sampled[: B * (k + 1)].view(B, k + 1)[:, :k] & has_draft[:, None]
        cols, owned = layout.local_ids(drafts.reshape(-1), ranks.me)
        cols, owned = cols.to(device), owned.to(device)
        local = {}
        for side, sel in (("target", self.target_rows), ("draft", self.draft_rows)):
            total, at = choice.kept_total_and_at(sel, cols)
            local[f"{side}_total"], local[f"{side}_token"] = total, torch.where(owned, at, 0)
        total = MASSES.pack(**local)
        self.total = MASSES.unpack(ranks.sum(padded(total, max_rows))[: B * k])
        seeds = rows.seed[:, None].expand(B, k)
        u = accept_uniforms(seeds, positions[:, None] + torch.arange(k, device=device)).reshape(-1)
        self.accept = accepts(u, self.total.target_token, self.total.target_total, self.total.draft_token,
                              self.total.draft_total).view(B, k)

    def correct(self, last: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """The correction of each row that rejected a weighed draft, else ``last``; a row where
        ``p <= q`` everywhere (only when rounding makes them equal) keeps the target's draw."""
        k, choice = self.k, self.choice
        B = last.shape[0]
        j = accepted.clamp(max=k - 1)
        rejected = (accepted < k) & self.weighed.gather(1, j[:, None])[:, 0]
        pair = torch.arange(B, device=last.device) * k + j
        best, arg = residual(choice.kept_mass(self.target_rows[pair]), self.total.target_total[pair],
                             choice.kept_mass(self.draft_rows[pair]), self.total.draft_total[pair],
                             self.rows.seed, self.positions + j, choice.ids)
        message = padded(DRAW.pack(score=best, id=arg), self.max_rows)
        got = DRAW.unpack(self.ranks.gather(message)[:, :B])
        score, token = merge_argmax(got.score, got.id)
        return torch.where(rejected & (score > NEG_INF), token, last)
