"""The single-device oracle: the sampling semantics written for clarity, on full ``[B, V]`` logits.

1. Penalties (repetition over prompt and generated tokens; presence and frequency over generated
   ones), then the bitmask (disallowed -> -inf); NaN rows and rows with nothing allowed raise
   ``ValueError`` naming them.
2. Greedy rows (temperature < ``GREEDY_BELOW``): argmax, ties -> lowest id.
3. Otherwise ``z = x / temperature``; top-k keeps ``x >= `` the k-th largest (ties kept); min-p
   keeps ``z >= zmax + ln(min_p)``; top-p keeps ``x >= tau``, tau the value at which the
   descending cumulative (exact integer) mass of the pool first reaches
   ``ceil(top_p * mass(pool))``. The pool is the top-k set (``filter_order="hf"``, Hugging Face's
   order) or the tokens passing top-k and min-p (``"vllm"``). The token is the argmax of
   ``z + G(seed, position, id)`` over the kept tokens (:func:`kept_tokens`), ties -> lowest id.
   A row whose max is +inf takes its lowest +inf id (what Gumbel-max gives in IEEE arithmetic).
4. Logprobs: log-softmax, in float64 as ``(x - max) - log(sum(exp(x - max)))``, of the raw
   logits or (``logprobs_of="processed"``) of what the row was drawn from
   (:func:`~vocabpar.sampling.semantics.drawn_logits`); the top-n are ordered by that logit,
   ties -> lowest id; the rank counts strictly larger logits.
"""

from __future__ import annotations

import torch

from vocabpar.sampling import masks
from vocabpar.sampling.params import (
    Rows,
    SamplingParams,
    TokenCounts,
    check_positions,
    check_sample_inputs,
    check_verify_inputs,
    on_device,
)
from vocabpar.sampling.semantics import (
    NEG_INF,
    SampleOutput,
    VerifyOutput,
    accept_uniform,
    accepts,
    check_rows,
    drawn_logits,
    gumbel_argmax,
    mass,
    processed_logits,
    residual_scores,
    row_argmax,
    top_p_pool,
    top_p_target,
    with_logprobs,
    z_floor,
)
from vocabpar.sampling.stacked import stacked_rows


def reference_sample(full_logits: torch.Tensor, params: SamplingParams, *, positions: torch.Tensor,
                     token_counts: TokenCounts | None = None, bitmask: torch.Tensor | None = None,
                     output_lens: torch.Tensor | None = None) -> SampleOutput:
    """Sample one token per row of FP32 ``full_logits`` ``[B, vocab_size]`` (on their device)."""
    with on_device(full_logits.device):
        return _reference_on_device(full_logits, params, positions, token_counts, bitmask, output_lens)


def _reference_on_device(full_logits, params, positions, token_counts, bitmask, output_lens) -> SampleOutput:
    rows, positions, token_counts, bitmask = check_sample_inputs("logits", full_logits, None, None, params,
                                                                 positions, token_counts, bitmask,
                                                                 output_lens=output_lens)
    B, V = full_logits.shape
    ids = torch.arange(V)
    x = processed_logits(full_logits, ids, rows, lambda t: (t.clamp(min=0), t >= 0), token_counts, bitmask)
    xmax = x.max(1).values
    check_rows(full_logits.isnan().any(1), xmax == float("-inf"))

    tokens = x.argmax(1)  # first maximum = lowest id; final for greedy and +inf rows
    sampled = ~rows.greedy & (xmax < float("inf"))
    keep = torch.ones_like(x, dtype=torch.bool)
    for b in sampled.nonzero().flatten().tolist():
        keep[b] = kept_tokens(x[b], rows, b)
        tokens[b] = _sample_row(x[b], keep[b], b, rows, positions)
    if rows.logprobs is None:
        return SampleOutput(tokens)
    source = full_logits if rows.logprobs_of == "raw" else drawn_logits(x, rows.temperature, keep, sampled)
    logp = torch.log_softmax(source.double(), 1)
    chosen = source.gather(1, tokens[:, None])
    # by logit value, ties by lowest id: the logprob order without the ties rounding x - max creates
    order = torch.sort(source, dim=1, descending=True, stable=True).indices[:, : rows.top_n]
    return with_logprobs(tokens, rows.logprobs, logp.gather(1, tokens[:, None])[:, 0].float(),
                         1 + (source > chosen).sum(1), order, logp.gather(1, order).float())


def kept_tokens(x: torch.Tensor, rows: Rows, b: int) -> torch.Tensor:
    """Bool ``[V]``: the tokens that row ``b`` of the processed logits ``x`` (``[V]``, finite max)
    may sample after the mask filters (:func:`vocabpar.sampling.masks.kept`), then top-k, top-p
    and min-p in the order ``rows.filter_order``."""
    V = x.numel()
    above = masks.kept(x, rows, b)
    x = torch.where(above, x, float("-inf"))
    z = x.double() / rows.temperature[b]
    zmax = z.max()
    k = int(rows.top_k[b])
    kappa = x.sort(descending=True).values[k - 1] if 0 < k < V else torch.tensor(float("-inf"))
    m = z_floor(zmax, rows, b)
    keep = (x >= kappa) & (z >= m)
    if rows.top_p[b] < 1:
        q = torch.where(top_p_pool(x, z, kappa, m, rows.filter_order), mass(z, zmax, V), 0)
        target = top_p_target(q.sum(), rows.top_p[b])
        order = x.sort(descending=True, stable=True).indices
        first = int((q[order].cumsum(0) < target).sum())
        keep &= x >= x[order[first]]
    return keep & above


def _sample_row(x: torch.Tensor, keep: torch.Tensor, b: int, rows: Rows, positions: torch.Tensor) -> int:
    ids = keep.nonzero().flatten()
    z = x[ids].double() / rows.temperature[b]
    _, arg = gumbel_argmax(torch.full_like(ids, b), ids, z, rows, positions, rows.seed.numel())
    return int(arg[b])


def reference_verify(full_target_logits: torch.Tensor, params: SamplingParams, draft_tokens: torch.Tensor, *,
                     positions: torch.Tensor, draft_logits: torch.Tensor | None = None,
                     output_lens: torch.Tensor | None = None) -> VerifyOutput:
    """Verify ``draft_tokens`` (int64 ``[B, k]``) against the full FP32 target logits
    ``[B, k+1, V]`` and optional draft logits ``[B, k, V]``, one row and position at a time (the
    semantics of :mod:`vocabpar.sampling.verify`)."""
    with on_device(full_target_logits.device):
        V = full_target_logits.shape[-1] if isinstance(full_target_logits, torch.Tensor) else 0
        B, k = check_verify_inputs(full_target_logits, draft_tokens, draft_logits, V, V)
        rows = params.resolve(B, V, output_lens)
        positions = check_positions(positions, B).to(full_target_logits.device)
        # what plain sampling draws at every position (raises on NaN / empty target rows)
        every = torch.arange(B).repeat_interleave(k + 1)
        offset = torch.arange(k + 1).repeat(B)
        at = positions[every] + offset
        stacked = params.take(B, V, every)
        lens = None if output_lens is None else torch.as_tensor(output_lens)[every] + offset
        drawn = reference_sample(full_target_logits.reshape(B * (k + 1), V), stacked, positions=at,
                                 output_lens=lens).tokens.view(B, k + 1)
        # the logits each position was drawn from: the request's constraints at that position
        by_position = stacked_rows(params, B, V, every, offset, output_lens)
        target_x = _constrained(full_target_logits.reshape(B * (k + 1), V), by_position).view(B, k + 1, V)
        if draft_logits is not None:  # a greedy row ignores its draft logits
            draft_x = _constrained(torch.cat([draft_logits, draft_logits[:, :1]], 1).reshape(B * (k + 1), V),
                                   by_position).view(B, k + 1, V)[:, :k]
            flat = draft_x[~rows.greedy].reshape(-1, V)
            check_rows(draft_logits[~rows.greedy].reshape(-1, V).isnan().any(1), (flat == NEG_INF).all(1))
        accepted = torch.zeros(B, dtype=torch.long)
        tokens = torch.full((B, k + 1), -1, dtype=torch.long)
        for b in range(B):
            for i in range(k + 1):
                if i == k:  # every draft accepted: the bonus token
                    tokens[b, i] = drawn[b, i]
                    break
                x = int(draft_tokens[b, i])
                target = target_x[b, i]
                if draft_logits is None or rows.greedy[b] or target.max() == float("inf"):
                    ok, correction = x == int(drawn[b, i]), int(drawn[b, i])
                else:
                    p, q = _kept_mass(target, rows, b), _kept_mass(draft_x[b, i], rows, b)
                    u = accept_uniform(rows.seed[b: b + 1], positions[b: b + 1] + i)
                    ok = bool(accepts(u, p[x], p.sum(), q[x], q.sum()))
                    scores = residual_scores(p[None], p.sum()[None], q[None], q.sum()[None],
                                             rows.seed[b: b + 1], positions[b: b + 1] + i, torch.arange(V))[0]
                    best, arg = row_argmax(torch.zeros(V, dtype=torch.long), torch.arange(V), scores, 1)
                    correction = int(arg[0]) if best[0] > NEG_INF else int(drawn[b, i])
                if not ok:
                    tokens[b, i] = correction
                    break
                tokens[b, i] = x
                accepted[b] += 1
        return VerifyOutput(accepted, tokens)


def _constrained(logits: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Full rows ``[F, V]`` with each row's ``logit_bias`` and exclusions applied (no penalties)."""
    return processed_logits(logits, torch.arange(logits.shape[1]), rows, lambda t: (t.clamp(min=0), t >= 0),
                            None, None)


def _kept_mass(x: torch.Tensor, rows: Rows, b: int) -> torch.Tensor:
    """Exact integer masses of row ``b``'s kept tokens (0 elsewhere): its final distribution."""
    z = x.double() / rows.temperature[b]
    return torch.where(kept_tokens(x, rows, b), mass(z, z.max(), x.numel()), 0)
