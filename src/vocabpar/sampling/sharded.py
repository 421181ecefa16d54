"""Sampling on vocab-sharded logits: the reference semantics, exactly, without ``[B, V]`` anywhere.

Each rank holds ``[B, rows]`` FP32 logits (its shard, padding columns ignored). Collectives, in
order, only when some row needs them (all ranks take the same branches: every decision is a
function of replicated parameters and of gathered data):

1. one all-gather: per row, the shard's (max, lowest id) with NaN folded into the max, then, if
   any row samples, the shard's top-c candidates (value desc, id asc). Greedy is this one
   collective (16 B per row).
2. top-k with k > c: a radix select over the int32 order keys, 4 bits per round (8 rounds, each
   an all-reduce of 16 counts per row). With k <= c the merged candidates are exact.
3. top-p: the integer mass of its pool (the top-k set; with ``filter_order="vllm"`` only its
   tokens that pass min-p), from the candidates when they hold the whole pool, else one
   all-reduce. Every unsent token is ``<= L`` (the highest value any rank did not send), so they
   hold it when ``kappa > L``, when nothing is unsent, or (``"vllm"``) when ``L / t < m``: no
   unsent token passes min-p. Then the candidates give the threshold if their cumulative mass
   reaches the target above ``L``; otherwise a radix select on masses (8 rounds of 16 int64 sums
   per row).
4. Gumbel-max: if every kept token is among the candidates, each rank computes it locally;
   otherwise each rank scores its kept tokens and one all-gather of (score, id) merges them.
5. logprobs (raw or processed): :func:`vocabpar.scoring.token_logprobs` of the chosen tokens,
   one all-gather of per-shard (max, sum-exp, chosen logit, top-n) and one all-reduce of rank
   counts; each logprob is ``(x - M) - log(S)``, precise for huge logits.

Before all of it, the agreement check (:func:`vocabpar.comm.agree`, one 256-byte all-gather
unless turned off).

Worst case: 1 + 8 + 1 + 8 + 1 + 2 = 21 collectives per step, each carrying at most
``16 * 8`` bytes per row beyond the candidates of round 1 (``c <= 256`` values per row).
All masses are exact integers, so the tokens equal :func:`reference_sample`'s bit for bit;
see :mod:`vocabpar.sampling.semantics` and :mod:`vocabpar.sampling.noise` for the float steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vocabpar import comm
from vocabpar.layout import VocabLayout
from vocabpar.sampling.noise import gumbel_bound, gumbel_bucket, row_keys
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
from vocabpar.sampling.semantics import (
    NEG_INF,
    PAD_KEY,
    SampleOutput,
    check_rows,
    drawn_logits,
    gumbel_argmax,
    key_value,
    mass,
    merge_argmax,
    min_p_threshold,
    order_key,
    processed_logits,
    top_p_pool,
    top_p_target,
    with_logprobs,
)
from vocabpar.scoring import token_logprobs

MAX_CANDIDATES = 256  # top-k beyond this uses the radix select
TOP_P_CANDIDATES = 64  # per rank, enough for peaked (LLM-like) rows
MIN_P_CANDIDATES = 16
RADIX_BITS = 4


@dataclass(frozen=True)
class _Ranks:
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


def _ranks(layout: VocabLayout, group: comm.ProcessGroup) -> _Ranks:
    if layout.scheme == "replicated":
        return _Ranks(group, 0, 1, layout.local_token_ids(0), (layout.vocab_size,))
    n = comm.world_size(group)
    if n != layout.world_size:
        raise ValueError(f"layout is for {layout.world_size} ranks but the group has {n}")
    me = comm.rank(group)
    counts = tuple(s.num_org + s.num_added for s in layout.shards)
    return _Ranks(group, me, n, layout.local_token_ids(me), counts)


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

    ranks: _Ranks
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
        ranks = _ranks(layout, group)
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
        per_row = [getattr(rows, name) for name in ROW_FIELDS]
        seen = [] if token_counts is None else [token_counts.ids, token_counts.counts] + (
            [] if token_counts.in_prompt is None else [token_counts.in_prompt.long()])
        return {**layout.describe(), "rows": B, "logprobs": -1 if rows.logprobs is None else rows.logprobs,
                "filter_order": rows.filter_order,
                "sampling parameters": torch.cat([t.double().view(torch.long) if t.is_floating_point() else t
                                                  for t in per_row]),
                "positions": pos, "token counts": torch.cat([t.flatten() for t in seen] + [torch.zeros(0)]),
                "bitmask": torch.zeros(0) if bitmask is None else bitmask}

    if layout.scheme == "replicated" or comm.world_size(group) == 1:
        facts()  # no collective follows: local validation only
    else:
        comm.agree("sample", group, facts, check=check)
    return checked[0]


def _sample_on_device(local_logits, layout, params, positions, group, token_counts, bitmask,
                      check) -> SampleOutput:
    inputs = _checked_inputs(local_logits, layout, params, positions, group, token_counts, bitmask, check)
    ranks, rows, positions, token_counts, bitmask = (inputs.ranks, inputs.rows, inputs.positions,
                                                     inputs.token_counts, inputs.bitmask)
    V = layout.vocab_size
    penalty = None if token_counts is None else (*layout.local_ids(token_counts.ids, ranks.me), token_counts)
    raw, ids = local_logits, ranks.ids
    x = processed_logits(raw, ids, rows, penalty, bitmask)

    c = _candidate_count(rows, V, ranks)
    r1 = _round_one(raw, x, ids, c, ranks)
    best, tokens = merge_argmax(torch.where(r1.xmax.isnan(), NEG_INF, r1.xmax), r1.xmax_id)
    nan_rows = r1.xmax.isnan().any(0)
    check_rows(nan_rows, (best == NEG_INF) & ~nan_rows)
    sampled = ~rows.greedy & (best < float("inf"))
    thr = m = t = None
    if sampled.any():
        tokens, thr, m, t = _sample(x, ids, rows, positions, sampled, best, c, r1, tokens, ranks, V)
    if rows.logprobs is None:
        return SampleOutput(tokens)
    source = raw
    if rows.logprobs_of == "processed" and thr is not None:
        source = drawn_logits(x, t, (x >= thr[:, None]) & (x.double() / t[:, None] >= m[:, None]), sampled)
    elif rows.logprobs_of == "processed":
        source = x
    # the ranks agreed on every input above: no second check
    scores = token_logprobs(source, layout, tokens, top_n=rows.top_n, group=group, check=False)
    return with_logprobs(tokens, rows.logprobs, scores.logprobs, scores.ranks, scores.top_ids,
                         scores.top_logprobs)


# ---------------------------------------------------------------------- round one
@dataclass(frozen=True)
class _RoundOne:
    """Gathered per-rank facts, each ``[n, B, ...]``."""

    xmax: torch.Tensor  # float64, NaN where the shard's row has a NaN logit
    xmax_id: torch.Tensor
    cand: torch.Tensor  # float64 [n, B, c] values (float32-exact), desc
    cand_id: torch.Tensor  # int64 [n, B, c], -1 = none


def _candidate_count(rows: Rows, V: int, ranks: _Ranks) -> int:
    sampled = ~rows.greedy
    if not sampled.any():
        return 0
    need = [1]
    k = rows.top_k[sampled]
    small_k = k[(k > 0) & (k <= MAX_CANDIDATES)]
    if small_k.numel():
        need.append(int(small_k.max()))
    if (rows.top_p[sampled] < 1).any():
        need.append(TOP_P_CANDIDATES)
    if (rows.min_p[sampled] > 0).any():
        need.append(MIN_P_CANDIDATES)
    return min(max(need), max(ranks.real_counts))


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


def _round_one(raw, x, ids, c: int, ranks: _Ranks) -> _RoundOne:
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
def _sample(x, ids, rows: Rows, positions, sampled, best, c: int, r1: _RoundOne, tokens, ranks: _Ranks,
            V: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens of the sampled rows, and the bounds of what each row keeps (``x >= thr`` and
    ``x / t >= m``)."""
    B = x.shape[0]
    real = ids >= 0
    t = torch.where(sampled, rows.temperature, 1.0)
    zmax = best / t
    # merged candidates: everything a rank holds above L[b] is among them
    n = r1.cand.shape[0]
    cand = r1.cand.permute(1, 0, 2).reshape(B, n * c)
    cand_id = r1.cand_id.permute(1, 0, 2).reshape(B, n * c)
    valid = cand_id >= 0
    unsent = torch.tensor([c < k for k in ranks.real_counts])
    L = torch.where(unsent[:, None], r1.cand[:, :, c - 1], NEG_INF).max(0).values
    nothing_unsent = L == NEG_INF  # unsent tokens (if any) are -inf: never kept in any way that matters
    ckey = torch.where(valid, order_key(cand.float()), PAD_KEY)
    ckey_sorted, corder = ckey.sort(1, descending=True)
    cz = cand / t[:, None]

    # top-k threshold kappa
    kappa = torch.full((B,), NEG_INF)
    k = rows.top_k
    topk = sampled & (k > 0) & (k < V)
    exact = topk & (k <= c)
    if exact.any():  # a padding entry at position k means the k-th largest value is -inf
        kth = ckey_sorted[exact, k[exact] - 1]
        kappa[exact] = torch.where(kth == PAD_KEY, NEG_INF, key_value(kth))
    search = (topk & ~exact).nonzero().flatten()
    if search.numel():
        u = torch.where(real, order_key(x[search]) + 2**31, -1)
        kappa[search] = key_value(_radix_select(u, None, k[search], ranks) - 2**31)

    # top-p threshold tau (exact integer masses within the pool)
    m = min_p_threshold(zmax, rows.min_p)
    order = rows.filter_order
    tau = torch.full((B,), NEG_INF)
    topp = sampled & (rows.top_p < 1)
    if topp.any():
        pool = valid & top_p_pool(cand, cz, kappa[:, None], m[:, None], order)
        cq = torch.where(pool, mass(cz, zmax[:, None], V), 0)
        total = cq.sum(1)
        # the candidates hold every token of the pool (unsent tokens are <= L)
        complete = nothing_unsent | (kappa > L)
        if order == "vllm":  # no unsent token passes min-p
            complete |= L / t < m
        missing = (topp & ~complete).nonzero().flatten()
        local_q = None
        if missing.numel():
            local_q = _local_mass(x[missing], kappa[missing], m[missing], t[missing], zmax[missing], V, order)
            total[missing] = ranks.sum(local_q.sum(1))
        target = top_p_target(total, rows.top_p)
        cum = cq.gather(1, corder).cumsum(1)
        first = (cum < target[:, None]).sum(1)
        found = first < n * c
        tau_c = key_value(ckey_sorted.gather(1, first.clamp(max=n * c - 1)[:, None])[:, 0])
        # tau_c > L: every token above it was sent. A complete pool needs no extra case: tau_c is
        # in the pool, so tau_c >= kappa, and with "vllm" tau_c / t >= m; either way tau_c > L.
        certified = topp & found & ((tau_c > L) | nothing_unsent)
        tau[certified] = tau_c[certified]
        search = (topp & ~certified).nonzero().flatten()
        if search.numel():
            if local_q is not None and torch.isin(search, missing).all():  # reuse, usual when flat
                q = local_q[torch.searchsorted(missing, search)]
            else:
                q = _local_mass(x[search], kappa[search], m[search], t[search], zmax[search], V, order)
            u = torch.where(real, order_key(x[search]) + 2**31, -1)
            tau[search] = key_value(_radix_select(u, q, target[search], ranks) - 2**31)

    thr = torch.maximum(kappa, tau)
    local = sampled & (nothing_unsent | (thr > L) | (L / t < m))
    tokens = tokens.clone()
    # the kept candidates' best score: exact where `local`, a lower bound on the winner elsewhere
    keep = valid & sampled[:, None] & (cand >= thr[:, None]) & (cz >= m[:, None])
    b, j = keep.nonzero(as_tuple=True)
    floor_score, arg = gumbel_argmax(b, cand_id[b, j], cz[b, j], rows, positions, B)
    tokens[local] = arg[local]
    spread = (sampled & ~local).nonzero().flatten()
    if spread.numel():
        r, col, z = _contenders(x[spread], ids, thr[spread], t[spread], m[spread], floor_score[spread],
                                row_keys(rows.seed, positions)[spread])
        score, arg = gumbel_argmax(spread[r], ids[col], z, rows, positions, B)
        g = ranks.gather(torch.stack([_f64_bits(score[spread]), arg[spread]], 1))
        _, tokens[spread] = merge_argmax(g[..., 0].contiguous().view(torch.float64), g[..., 1])
    return tokens, thr, m, t


def _contenders(x, ids, thr, t, m, floor_score, keys) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column, z) of this shard's kept tokens that can still beat ``floor_score``: a token
    whose noise bound (16 hashed bits, :func:`gumbel_bound`) cannot reach it is dropped before
    its exact noise is computed. Never drops a possible winner (the bound is conservative)."""
    z = x.double() / t[:, None]
    reach = z + gumbel_bound().to(z.device)[gumbel_bucket(keys[:, None, :], ids)] >= floor_score[:, None]
    r, col = ((ids >= 0) & (x >= thr[:, None]) & (z >= m[:, None]) & reach).nonzero(as_tuple=True)
    return r, col, z[r, col]


def _local_mass(x, kappa, m, t, zmax, V: int, filter_order: str) -> torch.Tensor:
    """Integer masses of this shard's tokens in the top-p pool (padding is -inf: mass 0)."""
    z = x.double() / t[:, None]
    pool = top_p_pool(x, z, kappa[:, None], m[:, None], filter_order)
    return torch.where(pool, mass(z, zmax[:, None], V), 0)


def _radix_select(u: torch.Tensor, weight: torch.Tensor | None, need: torch.Tensor,
                  ranks: _Ranks) -> torch.Tensor:
    """Per row, the largest ``v`` with ``sum(weight[u >= v]) >= need`` (weight 1 when None),
    over all ranks: ``u`` are this shard's keys in [0, 2**32), -1 = not a token. 32 / RADIX_BITS
    rounds of one all-reduce of ``2**RADIX_BITS`` int64 per row."""
    F, R = u.shape
    buckets = 1 << RADIX_BITS
    w = torch.ones_like(u) if weight is None else weight
    w = torch.where((u >= 0) & (w > 0), w, 0)  # tokens of no weight cannot move the answer
    base = torch.arange(F)[:, None] * buckets
    prefix = torch.zeros(F, dtype=torch.long)
    above = torch.zeros(F, dtype=torch.long)
    for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
        digit = (u >> shift) & (buckets - 1)
        hist = torch.zeros(F * buckets, dtype=torch.long).index_add_(0, (base + digit).view(-1), w.view(-1))
        hist = ranks.sum(hist.view(F, buckets))
        suffix = hist.flip(1).cumsum(1).flip(1)  # suffix[d] = weight with digit >= d
        d = ((above[:, None] + suffix) >= need[:, None]).sum(1) - 1
        nxt = suffix.gather(1, (d + 1).clamp(max=buckets - 1)[:, None])[:, 0]
        above += torch.where(d < buckets - 1, nxt, 0)
        prefix = prefix * buckets + d
        # only tokens under the chosen prefix matter from here on; masking the weight in place
        # beats compacting, since flat rows share their leading digits
        w = torch.where(digit == d[:, None], w, 0)
    return prefix
