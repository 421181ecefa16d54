"""The single-device oracle: the sampling semantics written for clarity, on full ``[B, V]`` logits.

1. Penalties, then the bitmask (disallowed -> -inf); NaN rows and rows with nothing allowed
   raise ``ValueError`` naming them.
2. Greedy rows (temperature < ``GREEDY_BELOW``): argmax, ties -> lowest id.
3. Otherwise ``z = x / temperature``; top-k keeps ``x >= `` the k-th largest (ties kept); top-p
   keeps ``x >= tau``, tau the value at which the descending cumulative (exact integer) mass
   within the top-k set first reaches ``ceil(top_p * mass(top-k set))``; min-p keeps
   ``z >= zmax + ln(min_p)``. The token is the argmax of ``z + G(seed, position, id)`` over the
   kept tokens, ties -> lowest id. A row whose max is +inf takes its lowest +inf id (what
   Gumbel-max gives in IEEE arithmetic).
4. Logprobs: log-softmax of the raw logits.
"""

from __future__ import annotations

import torch

from vocabpar.sampling.params import (
    SamplingParams,
    TokenCounts,
    check_bitmask,
    check_positions,
    on_device,
    to_device,
)
from vocabpar.sampling.semantics import (
    SampleOutput,
    check_rows,
    gumbel_argmax,
    mass,
    min_p_threshold,
    processed_logits,
    top_p_target,
)


def reference_sample(full_logits: torch.Tensor, params: SamplingParams, *, positions: torch.Tensor,
                     token_counts: TokenCounts | None = None,
                     bitmask: torch.Tensor | None = None) -> SampleOutput:
    """Sample one token per row of FP32 ``full_logits`` ``[B, vocab_size]`` (on their device)."""
    with on_device(full_logits.device):
        return _reference_on_device(full_logits, params, positions, token_counts, bitmask)


def _reference_on_device(full_logits, params, positions, token_counts, bitmask) -> SampleOutput:
    if full_logits.dtype != torch.float32 or full_logits.dim() != 2:
        raise ValueError(f"logits must be float32 [B, V], got {full_logits.dtype}{tuple(full_logits.shape)}")
    B, V = full_logits.shape
    rows = params.resolve(B, V)
    positions = check_positions(positions, B)
    ids = torch.arange(V)
    if token_counts is not None:
        token_counts.check(B, V)
    if bitmask is not None:
        check_bitmask(bitmask, B, V)
    positions, token_counts, bitmask = to_device(full_logits.device, positions, token_counts, bitmask)
    penalty = None if token_counts is None else (token_counts.ids.clamp(min=0), token_counts.ids >= 0,
                                                 token_counts)
    x = processed_logits(full_logits, ids, rows, penalty, bitmask)
    xmax = x.max(1).values
    check_rows(full_logits.isnan().any(1), xmax == float("-inf"))

    tokens = x.argmax(1)  # first maximum = lowest id; final for greedy and +inf rows
    sampled = ~rows.greedy & (xmax < float("inf"))
    for b in sampled.nonzero().flatten().tolist():
        tokens[b] = _sample_row(x[b], b, rows, positions)
    out = SampleOutput(tokens)
    if rows.logprobs is not None:
        logp = torch.log_softmax(full_logits.double(), 1)
        order = torch.sort(logp, dim=1, descending=True, stable=True).indices[:, : rows.logprobs]
        out = SampleOutput(tokens, logp.gather(1, tokens[:, None])[:, 0].float(), order,
                           logp.gather(1, order).float())
    return out


def _sample_row(x: torch.Tensor, b: int, rows, positions: torch.Tensor) -> int:
    V = x.numel()
    z = x.double() / rows.temperature[b]
    zmax = z.max()
    keep = torch.ones(V, dtype=torch.bool)
    k = int(rows.top_k[b])
    if 0 < k < V:
        keep &= x >= x.sort(descending=True).values[k - 1]
    if rows.top_p[b] < 1:
        q = torch.where(keep, mass(z, zmax, V), 0)
        target = top_p_target(q.sum(), rows.top_p[b])
        order = x.sort(descending=True, stable=True).indices
        first = int((q[order].cumsum(0) < target).sum())
        keep &= x >= x[order[first]]
    keep &= z >= min_p_threshold(zmax, rows.min_p[b])
    ids = keep.nonzero().flatten()
    row = torch.full_like(ids, b)
    _, arg = gumbel_argmax(row, ids, z[ids], rows, positions, rows.seed.numel())
    return int(arg[b])
