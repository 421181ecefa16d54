"""Sampling on vocab-sharded logits: the reference semantics, exactly, without ``[B, V]`` anywhere.

Each rank holds ``[B, rows]`` FP32 logits (its shard, padding columns ignored). Collectives, in
order, only when some row needs them (all ranks take the same branches: every decision is a
function of replicated parameters and of gathered data):

1. one all-gather: per row, the shard's (max, lowest id) with NaN folded into the max, then, if
   any row samples, the shard's top-c candidates (value desc, id asc). Greedy is this one
   collective (16 B per row).
2. top-k with k > c: a threshold search (:func:`_threshold`) between the merged candidates'
   k-th value and ``L`` (the highest value any rank did not send). With k <= c the merged
   candidates are exact.
3. top-p: the integer mass of its pool (the top-k set; with ``filter_order="vllm"`` only its
   tokens that pass min-p). Every unsent token is ``<= L``, so the candidates hold the pool when
   ``kappa > L``, when nothing is unsent, or (``"vllm"``) when ``L / t < m``; then they give the
   total, else one all-reduce does -- unless the candidates above ``L`` are unlikely to reach the
   target anyway (:func:`_unsent_mass`), in which case the search measures the total in its
   first round. The candidates give the threshold if their cumulative mass reaches the target
   above ``L``; otherwise a threshold search on masses.
4. Gumbel-max over the kept tokens: a threshold search draws its rows itself, in its settling
   all-gather; rows whose kept tokens are all candidates are drawn locally; the rest take one
   all-gather of each rank's best (score, id).
5. logprobs (raw or processed): :func:`vocabpar.sampling.scoring.token_logprobs` of the chosen tokens,
   one all-gather of per-shard (max, sum-exp, chosen logit, top-n) and one all-reduce of rank
   counts; each logprob is ``(x - M) - log(S)``, precise for huge logits.

A threshold search starts in the key bucket that its two bounds share and takes at most two
histogram all-reduces (``2**SEARCH_BITS + 1`` int64 per row, only for the rows searched), then
one settling all-gather of ``(1 + 4·SETTLE_TOKENS + 2)`` int64 per row; a row whose final bucket
holds more than ``SETTLE_TOKENS`` tokens on some rank (many ties) takes one more all-reduce and
the draw's all-gather. Collectives per call: greedy 1; candidates enough 1–2; one search 4
(5 with ties); worst case (top-k search, then top-p search, both with ties)
``1 + (2 + 1 + 1) + 1 + (2 + 1 + 1) + 1 = 11``, plus 2 for logprobs and 1 for the agreement
check (unless turned off). Bytes depend on B, n and the candidate count, never on V.
All masses are exact integers, so the tokens equal :func:`reference_sample`'s bit for bit;
see :mod:`vocabpar.sampling.semantics` and :mod:`vocabpar.sampling.noise` for the float steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vocabpar import comm
from vocabpar.layout import VocabLayout
from vocabpar.sampling.noise import gumbel, gumbel_bound, gumbel_bucket, row_keys
from vocabpar.sampling.params import (
    ROW_FIELDS,
    Rows,
    SamplingParams,
    TokenCounts,
    check_bitmask,
    check_positions,
    on_device,
    to_device,
)
from vocabpar.sampling.scoring import token_logprobs
from vocabpar.sampling.semantics import (
    NEG_INF,
    PAD_KEY,
    SampleOutput,
    check_rows,
    drawn_logits,
    gumbel_argmax,
    key_value,
    mass,
    mass_shift,
    merge_argmax,
    min_p_threshold,
    order_key,
    processed_logits,
    row_argmax,
    top_p_pool,
    top_p_target,
    with_logprobs,
)
from vocabpar.wire.sampler import MAX_CANDIDATES, SEARCH_BITS, SETTLE_BITS, SETTLE_TOKENS, candidate_count


@dataclass(frozen=True)
class Ranks:
    """This rank's view of the group; ``n == 1`` (no collective) for a replicated layout."""

    group: comm.ProcessGroup
    me: int  # rank used for layout lookups
    n: int
    ids: torch.Tensor  # global id of each local column, -1 = padding
    real_counts: tuple[int, ...]  # real columns on each rank

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0) if self.n == 1 else comm.all_gather(t, self.group)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.n == 1 else comm.all_reduce(t, self.group)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.n == 1 else comm.all_reduce_max(t, self.group)


def group_ranks(layout: VocabLayout, group: comm.ProcessGroup) -> Ranks:
    """This rank's view of ``group`` for ``layout``; raises if the group does not fit it."""
    if layout.scheme == "replicated":
        return Ranks(group, 0, 1, layout.local_token_ids(0), (layout.vocab_size,))
    n = comm.world_size(group)
    if n != layout.world_size:
        raise ValueError(f"layout is for {layout.world_size} ranks but the group has {n}")
    me = comm.rank(group)
    counts = tuple(s.num_org + s.num_added for s in layout.shards)
    return Ranks(group, me, n, layout.local_token_ids(me), counts)


def sample(local_logits: torch.Tensor, layout: VocabLayout, params: SamplingParams, *,
           positions: torch.Tensor, group: comm.ProcessGroup = None, token_counts: TokenCounts | None = None,
           bitmask: torch.Tensor | None = None, check: bool | None = None) -> SampleOutput:
    """Sample one token per row from this rank's FP32 shard ``[B, rows]``; every rank of the
    group returns the same :class:`SampleOutput`, equal to :func:`reference_sample` on the full
    logits. Invalid input on any rank, or ranks that disagree on the layout, the batch, the
    parameters, positions, token counts or bitmask (:func:`vocabpar.comm.agree`; ``check``
    ``None`` follows ``VOCABPAR_CHECK``), raise the same ``ValueError`` on every rank before the
    first collective; NaN rows and rows with nothing allowed raise it on every rank after it.
    Works on the device of ``local_logits`` (CUDA under NCCL)."""
    with on_device(local_logits.device):
        return _sample_on_device(local_logits, layout, params, positions, group, token_counts, bitmask, check)


@dataclass(frozen=True)
class _Inputs:
    """The validated per-call inputs, on the logits' device."""

    ranks: Ranks
    rows: Rows
    positions: torch.Tensor
    token_counts: TokenCounts | None
    bitmask: torch.Tensor | None


def _checked_inputs(local_logits, layout, params, positions, group, token_counts, bitmask,
                    check) -> _Inputs:
    """Validate this rank's input, then (when the logits are sharded) agree with the other ranks
    on everything that must be replicated: one 256-byte all-gather."""
    checked: list[_Inputs] = []

    def facts() -> dict[str, comm.Fact]:
        ranks = group_ranks(layout, group)
        if not isinstance(local_logits, torch.Tensor) or local_logits.dtype != torch.float32 \
                or local_logits.dim() != 2 or local_logits.shape[1] != ranks.ids.numel():
            raise ValueError(f"local logits must be float32 [B, {ranks.ids.numel()}] on rank {ranks.me}, "
                             f"got {getattr(local_logits, 'dtype', type(local_logits).__name__)}"
                             f"{tuple(getattr(local_logits, 'shape', ()))}")
        B, V = local_logits.shape[0], layout.vocab_size
        rows = params.resolve(B, V)
        pos = check_positions(positions, B)
        if token_counts is not None:
            token_counts.check(B, V)
        if bitmask is not None:
            check_bitmask(bitmask, B, V)
        checked.append(_Inputs(ranks, rows, *to_device(local_logits.device, pos, token_counts, bitmask)))
        seen = [] if token_counts is None else [token_counts.ids, token_counts.counts] + (
            [] if token_counts.in_prompt is None else [token_counts.in_prompt.long()])
        counts = torch.full((B,), -1) if rows.logprobs is None else rows.logprobs
        return {**layout.describe(), "rows": B, "logprobs": counts,
                "filter_order": rows.filter_order,
                "sampling parameters": params_fact(rows),
                "positions": pos, "token counts": torch.cat([t.flatten() for t in seen] + [torch.zeros(0)]),
                "bitmask": torch.zeros(0) if bitmask is None else bitmask}

    agreed("sample", layout, group, facts, check)
    return checked[0]


def agreed(where: str, layout: VocabLayout, group: comm.ProcessGroup,
           facts: Callable[[], dict[str, comm.Fact]], check: bool | None) -> None:
    """Run ``facts`` (it validates this rank's input and returns what must be replicated) and,
    when a collective follows (sharded logits, several ranks), agree on them across the group."""
    if layout.scheme == "replicated" or comm.world_size(group) == 1:
        facts()
    else:
        comm.agree(where, group, facts, check=check)


def params_fact(rows: Rows) -> torch.Tensor:
    """The per-row sampling parameters as one int64 tensor, for the agreement check."""
    return torch.cat([getattr(rows, name).double().view(torch.long) if dtype.is_floating_point
                      else getattr(rows, name) for name, dtype in ROW_FIELDS.items()])


def _sample_on_device(local_logits, layout, params, positions, group, token_counts, bitmask,
                      check) -> SampleOutput:
    inputs = _checked_inputs(local_logits, layout, params, positions, group, token_counts, bitmask, check)
    rows = inputs.rows
    choice = choose(local_logits, layout, inputs.ranks, rows, inputs.positions, inputs.token_counts,
                    inputs.bitmask)
    tokens, step = choice.tokens, choice.step
    if rows.logprobs is None:
        return SampleOutput(tokens)
    source = local_logits
    if rows.logprobs_of == "processed":
        source = choice.x if step is None else drawn_logits(choice.x, step.t, step.kept(choice.thr),
                                                             choice.sampled)
    # the ranks agreed on every input above: no second check
    scores = token_logprobs(source, layout, tokens, top_n=rows.top_n, group=group, check=False)
    return with_logprobs(tokens, rows.logprobs, scores.logprobs, scores.ranks, scores.top_ids,
                         scores.top_logprobs)


@dataclass(frozen=True)
class Choice:
    """The sampler's work on a batch of rows: the ``tokens`` (-1 for sampled rows not drawn),
    this shard's processed logits ``x``, which rows were ``sampled`` (not greedy, finite max),
    and, when any was, the rows' state ``step`` and their final thresholds ``thr`` (a row keeps
    ``step.kept(thr)``)."""

    tokens: torch.Tensor
    x: torch.Tensor
    sampled: torch.Tensor
    step: _Rows | None
    thr: torch.Tensor | None


def choose(raw: torch.Tensor, layout: VocabLayout, ranks: Ranks, rows: Rows, positions: torch.Tensor,
           token_counts: TokenCounts | None = None, bitmask: torch.Tensor | None = None,
           draws: torch.Tensor | None = None, row_name: Callable[[int], str] | None = None) -> Choice:
    """The sampler's steps on validated inputs (round one, thresholds, draw), shared by
    :func:`sample` and the speculative verifier: only rows in ``draws`` (all when ``None``) are
    drawn. NaN rows and rows with nothing allowed raise on every rank, named by ``row_name``."""
    V = layout.vocab_size
    penalty = None if token_counts is None else (*layout.local_ids(token_counts.ids, ranks.me), token_counts)
    ids = ranks.ids
    x = processed_logits(raw, ids, rows, penalty, bitmask)
    c = _candidate_count(rows, V, ranks)
    r1 = _round_one(raw, x, ids, c, ranks)
    best, tokens = merge_argmax(torch.where(r1.xmax.isnan(), NEG_INF, r1.xmax), r1.xmax_id)
    nan_rows = r1.xmax.isnan().any(0)
    check_rows(nan_rows, (best == NEG_INF) & ~nan_rows, row_name)
    sampled = ~rows.greedy & (best < float("inf"))
    step = thr = None
    if sampled.any():
        step = _Rows(x, ids, rows, positions, sampled, ranks, V, c, r1, best)
        kappa = step.top_k_threshold()
        thr = torch.maximum(kappa, step.top_p_threshold(kappa))
        tokens = step.draw(tokens, thr, sampled if draws is None else sampled & draws)
    return Choice(tokens, x, sampled, step, thr)


# ---------------------------------------------------------------------- round one
@dataclass(frozen=True)
class _RoundOne:
    """Gathered per-rank facts, each ``[n, B, ...]``."""

    xmax: torch.Tensor  # float64, NaN where the shard's row has a NaN logit
    xmax_id: torch.Tensor
    cand: torch.Tensor  # float64 [n, B, c] values (float32-exact), desc
    cand_id: torch.Tensor  # int64 [n, B, c], -1 = none


def _candidate_count(rows: Rows, V: int, ranks: Ranks) -> int:
    sampled = ~rows.greedy
    if not sampled.any():
        return 0
    k = rows.top_k[sampled]
    small_k = k[(k > 0) & (k <= MAX_CANDIDATES)]
    top_k = int(small_k.max()) if small_k.numel() else 0
    return candidate_count(ranks.n, max(ranks.real_counts), top_k=top_k,
                           top_p=bool((rows.top_p[sampled] < 1).any()),
                           min_p=bool((rows.min_p[sampled] > 0).any()))


def _top(x: torch.Tensor, ids: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's ``c`` largest values with their ids, padded with (-inf, -1). Ties at the c-th
    value are broken arbitrarily: thresholds only need the values, and a padding column may
    stand in for a real -inf token."""
    B, R = x.shape
    vals = torch.full((B, c), NEG_INF, dtype=torch.float64)
    cid = torch.full((B, c), -1, dtype=torch.long)
    m = min(c, R)
    if m:
        cols = x.topk(m, 1).indices
        vals[:, :m], cid[:, :m] = x.gather(1, cols).double(), ids[cols]
    return vals, cid


def _f64_bits(t: torch.Tensor) -> torch.Tensor:
    return t.double().contiguous().view(torch.long)


def _round_one(raw, x, ids, c: int, ranks: Ranks) -> _RoundOne:
    """One all-gather, per row: the shard's (max, lowest id) with NaN folded into the max, then
    its top-``c`` candidates: ``(2 + 2c)·8`` bytes per row and rank."""
    B, R = x.shape
    if R:
        xmax, col = x.max(1)  # first maximum: storage order is id order
        xmax_id = ids[col]
    else:
        xmax, xmax_id = torch.full((B,), NEG_INF), torch.full((B,), -1)
    has_nan = xmax.isnan() if x is raw else torch.where(ids >= 0, raw, 0.0).isnan().any(1)
    cand, cand_id = _top(x, ids, c)
    g = ranks.gather(torch.cat([_f64_bits(torch.where(has_nan, float("nan"), xmax.double()))[:, None],
                                xmax_id[:, None], _f64_bits(cand), cand_id], 1))
    f64 = lambda t: t.contiguous().view(torch.float64)
    return _RoundOne(f64(g[..., 0]), g[..., 1], f64(g[..., 2: 2 + c]), g[..., 2 + c: 2 + 2 * c])


# ---------------------------------------------------------------------- sampling rows
@dataclass
class _Rows:
    """Per-call state of the sampled rows' steps: this shard's processed logits, the rows'
    parameters, and the merged round-one candidates (everything a rank holds above ``L`` is among
    them)."""

    x: torch.Tensor
    ids: torch.Tensor
    rows: Rows
    positions: torch.Tensor
    sampled: torch.Tensor
    ranks: Ranks
    V: int
    c: int
    r1: _RoundOne
    best: torch.Tensor

    def __post_init__(self) -> None:
        B, n, c = self.x.shape[0], self.r1.cand.shape[0], self.c
        self.t = torch.where(self.sampled, self.rows.temperature, 1.0)
        self.zmax = self.best / self.t
        self.m = min_p_threshold(self.zmax, self.rows.min_p)
        self.noise_keys = row_keys(self.rows.seed, self.positions)
        self.cand = self.r1.cand.permute(1, 0, 2).reshape(B, n * c)
        self.cand_id = self.r1.cand_id.permute(1, 0, 2).reshape(B, n * c)
        self.cz = self.cand / self.t[:, None]
        self.valid = self.cand_id >= 0
        unsent = torch.tensor([c < k for k in self.ranks.real_counts])
        self.L = torch.where(unsent[:, None], self.r1.cand[:, :, c - 1], NEG_INF).max(0).values
        self.nothing_unsent = self.L == NEG_INF  # unsent tokens (if any) are -inf: never kept
        self.ckey_sorted, self.corder = torch.where(self.valid, order_key(self.cand.float()), PAD_KEY).sort(
            1, descending=True)
        self.drawn = torch.full((B,), -1, dtype=torch.long)  # tokens a threshold search drew

    def kept(self, thr: torch.Tensor) -> torch.Tensor:
        """Bool ``[B, columns]``: this shard's tokens each row keeps (``x >= thr``, ``z >= m``)."""
        return (self.x >= thr[:, None]) & (self.x.double() / self.t[:, None] >= self.m[:, None])

    def draw_for(self, search: torch.Tensor) -> _Draw:
        return _Draw(self.x[search], self.ids, self.t[search], self.m[search], self.noise_keys[search],
                     self.cand[search], self.cand_id[search], self.cz[search])

    def top_k_threshold(self) -> torch.Tensor:
        """``kappa`` per row (-inf without top-k): the k-th largest value. Exact from the
        candidates when k <= c; else a threshold search (2–4 collectives) between the candidates'
        k-th value and ``L``, which also draws the rows that have no top-p."""
        B, k, n = self.x.shape[0], self.rows.top_k, self.cand.shape[1]
        kappa = torch.full((B,), NEG_INF)
        topk = self.sampled & (k > 0) & (k < self.V)
        exact = topk & (k <= self.c)
        if exact.any():  # a padding entry at position k means the k-th largest value is -inf
            kth = self.ckey_sorted[exact, k[exact] - 1]
            kappa[exact] = torch.where(kth == PAD_KEY, NEG_INF, key_value(kth))
        search = (topk & ~exact).nonzero().flatten()
        if search.numel():
            # at least the merged candidates' k-th; at most L, since fewer than k candidates lie
            # above L (else the candidates would be exact)
            kth = self.ckey_sorted[search, (k[search] - 1).clamp(max=n - 1)]
            lo = torch.where((k[search] <= n) & (kth != PAD_KEY), kth + 2**31, 0)
            hi = _key(torch.where(self.nothing_unsent, self.best, self.L)[search])
            draw = None if (self.rows.top_p[search] < 1).any() else self.draw_for(search)
            v, self.drawn[search] = _threshold(_keys(self.x[search], self.ids >= 0), None, k[search], lo, hi,
                                               self.ranks, draw)
            kappa[search] = key_value(v - 2**31)
        return kappa

    def top_p_threshold(self, kappa: torch.Tensor) -> torch.Tensor:
        """``tau`` per row (-inf without top-p), from exact integer masses of the pool. The
        candidates give the total when they hold the whole pool, else one all-reduce of 8 bytes
        per row does (or the search's first round, where the candidates are unlikely to reach the
        target); they give tau when their cumulative mass reaches the target above ``L``; else a
        threshold search (2–4 collectives), which also draws the row."""
        B, V, order = self.x.shape[0], self.V, self.rows.filter_order
        t, zmax, m, L, cand = self.t, self.zmax, self.m, self.L, self.cand
        tau = torch.full((B,), NEG_INF)
        topp = self.sampled & (self.rows.top_p < 1)
        if not topp.any():
            return tau
        cq = torch.where(self.valid & top_p_pool(cand, self.cz, kappa[:, None], m[:, None], order),
                         mass(self.cz, zmax[:, None], V), 0)
        total = cq.sum(1)
        complete = self.nothing_unsent | (kappa > L)  # unsent tokens are <= L
        if order == "vllm":  # no unsent token passes min-p
            complete |= L / t < m
        # rows whose candidates above L would fall short of the target even against half the
        # guessed unsent mass skip the all-reduce of the total; either way is exact, this only
        # picks the cheaper (a wrong guess costs one collective either way)
        above_l = torch.where(cand > L[:, None], cq, 0).sum(1)
        unsent = _unsent_mass(self.r1, t, zmax, self.ranks, V)
        fold = topp & ~complete & (above_l < self.rows.top_p * (total + unsent / 2))
        missing = (topp & ~complete & ~fold).nonzero().flatten()
        local_q = None
        if missing.numel():
            local_q = self.local_mass(missing, kappa)
            total[missing] = self.ranks.sum(local_q.sum(1))
        target = top_p_target(total, self.rows.top_p)
        first = (cq.gather(1, self.corder).cumsum(1) < target[:, None]).sum(1)
        found = ~fold & (first < cand.shape[1])
        tau_c = key_value(self.ckey_sorted.gather(1, first.clamp(max=cand.shape[1] - 1)[:, None])[:, 0])
        # tau_c > L: every token above it was sent. A complete pool needs no extra case: tau_c is
        # in the pool, so tau_c >= kappa, and with "vllm" tau_c / t >= m; either way tau_c > L.
        certified = topp & found & ((tau_c > L) | self.nothing_unsent)
        tau[certified] = tau_c[certified]
        search = (topp & ~certified).nonzero().flatten()
        if search.numel():
            if local_q is not None and torch.isin(search, missing).all():  # reuse, usual when flat
                q = local_q[torch.searchsorted(missing, search)]
            else:
                q = self.local_mass(search, kappa)
            # at least tau_c when the candidates reach the target, else at least the value below
            # which masses are 0; at most L (the candidates above L fall short)
            floor_x = t * (zmax - mass_shift(V) * math.log(2) - 1)
            lo = _key(torch.where(found, tau_c.double(), floor_x)[search])
            folded, known, p = fold[search], target[search], self.rows.top_p[search]
            need = lambda measured: torch.where(folded, top_p_target(measured, p), known)  # noqa: E731
            v, self.drawn[search] = _threshold(_keys(self.x[search], self.ids >= 0), q, need, lo,
                                               _key(L[search]), self.ranks, self.draw_for(search))
            tau[search] = key_value(v - 2**31)
        return tau

    def local_mass(self, sel: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
        """Integer masses of this shard's tokens of rows ``sel`` in their top-p pool."""
        order = self.rows.filter_order
        return self._masses(sel, lambda x, z: top_p_pool(x, z, kappa[sel, None], self.m[sel, None], order))

    def kept_mass(self, sel: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
        """Integer masses of this shard's tokens of rows ``sel`` that the rows keep, 0 elsewhere:
        the rows' final distribution, unnormalised."""
        return self._masses(sel, lambda x, z: (x >= thr[sel, None]) & (z >= self.m[sel, None]))

    def _masses(self, sel: torch.Tensor, where: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        x = self.x[sel]
        z = x.double() / self.t[sel, None]
        return torch.where(where(x, z), mass(z, self.zmax[sel, None], self.V), 0)

    def draw(self, tokens: torch.Tensor, thr: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """Gumbel-max over the kept tokens (``x >= thr``, ``z >= m``) of the ``wanted`` rows (the
        other sampled rows get -1): rows a search drew keep its token; rows whose kept tokens are
        all candidates are drawn locally; the rest take one all-gather of each rank's best
        (score, id), 16 bytes per row."""
        B, L, m, t = self.x.shape[0], self.L, self.m, self.t
        drawn = wanted & (self.drawn >= 0)
        local = wanted & ~drawn & (self.nothing_unsent | (thr > L) | (L / t < m))
        tokens = torch.where(drawn, self.drawn, torch.where(self.sampled & ~wanted, -1, tokens))
        # the kept candidates' best score: exact where `local`, a lower bound on the winner elsewhere
        keep = self.valid & wanted[:, None] & (self.cand >= thr[:, None]) & (self.cz >= m[:, None])
        b, j = keep.nonzero(as_tuple=True)
        floor_score, arg = gumbel_argmax(b, self.cand_id[b, j], self.cz[b, j], self.rows, self.positions, B)
        tokens[local] = arg[local]
        spread = (wanted & ~local & ~drawn).nonzero().flatten()
        if spread.numel():
            r, col, z = _contenders(self.x[spread], self.ids, thr[spread], t[spread], m[spread],
                                    floor_score[spread], self.noise_keys[spread])
            score, arg = gumbel_argmax(spread[r], self.ids[col], z, self.rows, self.positions, B)
            g = self.ranks.gather(torch.stack([_f64_bits(score[spread]), arg[spread]], 1))
            _, tokens[spread] = merge_argmax(g[..., 0].contiguous().view(torch.float64), g[..., 1])
        return tokens


def _contenders(x, ids, thr, t, m, floor_score, keys) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column, z) of this shard's kept tokens that can still beat ``floor_score``: a token
    whose noise bound (16 hashed bits, :func:`gumbel_bound`) cannot reach it is dropped before
    its exact noise is computed. Never drops a possible winner (the bound is conservative)."""
    z = x.double() / t[:, None]
    r, col = ((ids >= 0) & (x >= thr[:, None]) & (z >= m[:, None])).nonzero(as_tuple=True)
    z = z[r, col]
    reach = z + gumbel_bound().to(z.device)[gumbel_bucket(keys[r], ids[col])] >= floor_score[r]
    return r[reach], col[reach], z[reach]


@dataclass(frozen=True)
class _Draw:
    """What a threshold search needs to draw the token of rows whose kept set is ``key >= v``
    and ``z >= m`` (``v`` the threshold it finds): their logits ``x`` ``[F, R]``, temperature,
    min-p bound and noise keys per row, and the merged candidates (values, ids, float64 z)."""

    x: torch.Tensor
    ids: torch.Tensor
    t: torch.Tensor
    m: torch.Tensor
    keys: torch.Tensor
    cand: torch.Tensor
    cand_id: torch.Tensor
    cz: torch.Tensor

    def certain_best(self, top_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's best (score, id) per row among the kept tokens with key >= ``top_key``
        (all kept whatever the threshold within the bucket below). The certainly kept candidates
        give a lower bound on it, so the noise bound prunes most tokens first."""
        F = top_key.shape[0]
        top_value = key_value(top_key.clamp(max=2**32 - 1) - 2**31).double()
        thr = torch.where(top_key < 2**32, top_value, float("inf"))
        sure = (self.cand_id >= 0) & (self.cand >= thr[:, None]) & (self.cz >= self.m[:, None])
        b, j = sure.nonzero(as_tuple=True)
        sure_ids = self.cand_id[b, j]
        floor, _ = row_argmax(b, sure_ids, self.cz[b, j] + gumbel(self.keys[b], sure_ids), F)
        r, col, z = _contenders(self.x, self.ids, thr, self.t, self.m, floor, self.keys)
        return row_argmax(r, self.ids[col], z + gumbel(self.keys[r], self.ids[col]), F)

    def score(self, r: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """``z + G`` of the listed tokens, -inf where min-p drops them."""
        z = self.x[r, col].double() / self.t[r]
        return torch.where(z >= self.m[r], z + gumbel(self.keys[r], self.ids[col]), NEG_INF)


def _threshold(u: torch.Tensor, weight: torch.Tensor | None, need: torch.Tensor | Callable,
               lo: torch.Tensor, hi: torch.Tensor, ranks: Ranks,
               draw: _Draw | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the largest key ``v`` with ``sum(weight[u >= v]) >= need`` over all ranks, given
    ``lo <= v <= hi`` (``u``: this shard's keys in [0, 2**32), -1 = not a token; weight 1 when
    None). ``need`` may be a function of the rows' total weight, which the first round then
    measures. With ``draw``, also the token drawn from ``key >= v`` and ``z >= m``. Returns
    ``(v, token)`` (token -1 where not drawn).

    The keys ``lo`` and ``hi`` share their top bits: the search starts in that bucket. Each round
    all-reduces a histogram of ``2**SEARCH_BITS`` weights per row (plus the weight above the
    bucket) and keeps the digit holding ``v``, until a bucket spans at most ``2**SETTLE_BITS``
    keys: at most ``ceil(22 / SEARCH_BITS) = 2`` rounds. Then one all-gather settles it: each rank
    sends the ``SETTLE_TOKENS`` largest keys of the bucket with their weights -- and, to draw, their
    scores and its best score above the bucket. A row whose bucket holds more on some rank takes
    one more round of ``2**SETTLE_BITS`` sums (and is not drawn). Only the bucket's tokens are
    carried from round to round."""
    F = u.shape[0]
    w = torch.where(u >= 0, 1 if weight is None else weight, 0)
    shift = _bit_length(lo ^ hi)
    prefix = hi >> shift
    bits = (shift - SETTLE_BITS).clamp(0, SEARCH_BITS)
    above, total = torch.zeros(F, dtype=torch.long), None
    # rounds run on the tokens of the bucket and above only; when some row's bucket is the whole
    # key range, the first round runs on the shard in place instead of copying it out
    if bool((shift < 32).all()):  # host syncs here and below: branches every rank takes alike
        r, col = ((u >= (prefix << shift)[:, None]) & (w > 0)).nonzero(as_tuple=True)
    else:
        shift, prefix, above, total, need, keep = _histogram_round(u, w, torch.arange(F)[:, None], bits,
                                                                   shift, prefix, above, total, need, ranks)
        r, col = (keep & (w > 0)).nonzero(as_tuple=True)
    key, wt = u[r, col], w[r, col]
    while True:
        bits = (shift - SETTLE_BITS).clamp(0, SEARCH_BITS)
        if (total is not None or not callable(need)) and not bool((bits > 0).any()):
            break
        shift, prefix, above, total, need, keep = _histogram_round(key, wt, r, bits, shift, prefix, above,
                                                                   total, need, ranks)
        r, col, key, wt = r[keep], col[keep], key[keep], wt[keep]
    count = torch.bincount(r, minlength=F)
    order = torch.argsort(r * 2**33 + (2**32 - 1 - key))  # by row, then key descending
    r, col, key, wt = r[order], col[order], key[order], wt[order]
    slot = torch.arange(r.numel()) - (count.cumsum(0) - count)[r]
    sent = slot < SETTLE_TOKENS
    fields = [key, wt] + ([] if draw is None else [draw.ids[col], _f64_bits(draw.score(r, col))])
    pads = [-1, 0, -1, _f64_bits(torch.tensor(NEG_INF)).item()]
    table = torch.stack([torch.full((F, SETTLE_TOKENS), pad, dtype=torch.long)
                         for pad in pads[: len(fields)]])
    table[:, r[sent], slot[sent]] = torch.stack(fields)[:, sent]
    parts = [count[:, None], *table]
    if draw is not None:
        best, best_id = draw.certain_best((prefix + 1) << shift)
        parts += [_f64_bits(best)[:, None], best_id[:, None]]
    g = ranks.gather(torch.cat(parts, 1))  # [n, F, 1 + fields * SETTLE_TOKENS (+ 2)]
    merged = [g[..., 1 + i * SETTLE_TOKENS: 1 + (i + 1) * SETTLE_TOKENS].permute(1, 0, 2).reshape(F, -1)
              for i in range(len(fields))]
    ordered, by_key = merged[0].sort(1, descending=True)
    reached = above[:, None] + merged[1].gather(1, by_key).cumsum(1) >= need[:, None]
    v = ordered.gather(1, (~reached).sum(1).clamp(max=ordered.shape[1] - 1)[:, None])[:, 0]
    overflow = (g[..., 0] > SETTLE_TOKENS).any(0)
    token = torch.full((F,), -1, dtype=torch.long)
    if draw is not None:  # the best of: every rank's best above the bucket, the bucket's kept tokens
        kept = merged[0] >= v[:, None]
        scores = torch.cat([g[..., -2].contiguous().view(torch.float64).T, merged[3].view(torch.float64)], 1)
        ids = torch.cat([g[..., -1].T, torch.where(kept, merged[2], -1)], 1)
        _, token = merge_argmax(scores.T, ids.T)
    if bool(overflow.any()):  # a host sync that saves a collective for every other row
        mine = overflow[r]
        _, exact, *_ = _histogram_round(key[mine], wt[mine], r[mine], torch.where(overflow, shift, 0), shift,
                                        prefix, above, total, need, ranks)
        v, token = torch.where(overflow, exact, v), torch.where(overflow, -1, token)
    return v, token


def _histogram_round(key, wt, r, bits, shift, prefix, above, total, need, ranks):
    """One all-reduce: per row, the weights of the ``2**bits`` digits below the bucket's prefix
    (and, in the first round, of everything above the bucket); keep the digit holding the
    threshold. Returns the narrowed (shift, prefix, above), the total and ``need`` once known, and
    which tokens stay in the bucket."""
    F = prefix.shape[0]
    rs, rb = shift[r], bits[r]
    high = key >> rs
    inside = high == prefix[r]
    top = 1 << SEARCH_BITS  # the column of the weight above the bucket; below it weighs nothing
    digit = torch.where(inside, (key >> (rs - rb)) & ((1 << rb) - 1), top)
    weight = torch.where(inside | (high > prefix[r]), wt, 0)
    hist = torch.zeros(F * (top + 1), dtype=torch.long).index_add_(0, (r * (top + 1) + digit).reshape(-1),
                                                                  weight.reshape(-1))
    hist = ranks.sum(hist.view(F, top + 1))
    if total is None:
        total, above = hist.sum(1), hist[:, top]
        need = need(total) if callable(need) else need
    suffix = hist[:, :top].flip(1).cumsum(1).flip(1)  # suffix[d] = weight of digits >= d
    d = ((above[:, None] + suffix) >= need[:, None]).sum(1).clamp(min=1) - 1
    above = above + torch.where(d + 1 < top, suffix.gather(1, (d + 1).clamp(max=top - 1)[:, None])[:, 0], 0)
    keep = inside & (digit == d[r])
    return shift - bits, (prefix << bits) | d, above, total, need, keep


def _unsent_mass(r1: _RoundOne, t: torch.Tensor, zmax: torch.Tensor, ranks: Ranks, V: int) -> torch.Tensor:
    """A guess (float64 ``[B]``, in the units of :func:`mass`) of the mass of the tokens no rank
    sent: each rank's tail continues the power law through its candidates of ranks c/2 and c
    (geometric tails, flat tails and Zipf tails all fit one), for as many tokens as it holds.
    Used only to choose between two exact paths."""
    c = r1.cand.shape[2]
    half = max(c // 2, 1)
    last = torch.exp(r1.cand[..., c - 1] / t - zmax).nan_to_num(0.0)
    middle = torch.exp(r1.cand[..., half - 1] / t - zmax)
    a = (torch.log(middle / last) / math.log(c / half)).nan_to_num(0.0).clamp(min=0.0, max=50.0)
    unsent = torch.tensor([max(count - c, 0) for count in ranks.real_counts], dtype=torch.float64)[:, None]
    # sum over j in (c, c + unsent] of last * (c / j)**a, as an integral
    one = (a - 1).abs() < 1e-6
    power = torch.where(one, 0.5, 1 - a)
    grown = ((1 + unsent / c) ** power - 1) / power
    tail = last * c * torch.where(one, torch.log1p(unsent / c), grown)
    return tail.sum(0) * 2.0 ** mass_shift(V)


def _keys(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Unsigned order keys in [0, 2**32) of this shard's tokens (-1 for padding columns)."""
    return torch.where(real, order_key(x) + 2**31, -1)


def _key(values: torch.Tensor) -> torch.Tensor:
    """The unsigned order key of float values (rounded to float32, clamped to the finite-or-inf
    range of keys)."""
    return order_key(values.float()) + 2**31


def _bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bits needed for each non-negative int64 below 2**53 (0 for 0)."""
    return torch.frexp(x.double()).exponent.long()
