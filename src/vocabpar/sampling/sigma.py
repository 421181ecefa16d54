"""top-n-sigma (llama.cpp's ``top_n_sigma``): a sampled row keeps the tokens whose processed logit
is at least ``max - n * sigma``, sigma the population standard deviation of the row's finite
processed logits (after penalties, bias and exclusions, before temperature, so the kept set does
not depend on the temperature), ahead of top-k, top-p and min-p, which see only what it kept.

Sigma must not depend on how the vocabulary is split, so it is built from exact integer sums:
each finite logit counts as ``q = round(x * 2**16)`` (``|x|`` capped at ``2**20``), and every rank
sends, in its round-one message, the count, ``sum(q)`` and ``sum(q**2)`` in three 18-bit-split
words (:func:`terms`). Integer sums are the same in any order, so every rank, at any rank count,
computes the same float64 sigma from the same integers (:func:`floor`). It differs from
llama.cpp's float32 sums by the rounding of the logits to ``2**-16``, and only for a logit within
that of the cut."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
SCALE = 2**16
"""A logit counts as a multiple of ``1 / SCALE``."""
CAP = 2.0**20
"""Logits beyond ``+-CAP`` count as ``+-CAP``."""
SPLIT = 18
"""``|q| = a * 2**SPLIT + b``: ``q**2`` summed as three words that cannot overflow int64 for any
vocabulary below ``2**18`` tokens per row."""


def terms(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, 5]``: this shard's exact sums over each row's finite logits -- count,
    ``sum(q)``, ``sum(a*a)``, ``sum(2*a*b)``, ``sum(b*b)``: top-n-sigma's round-one words.
    ``x``: float32 ``[B, columns]``; ``real``: ``[columns]`` (padding counts for nothing)."""
    finite = x.isfinite() & real
    q = torch.where(finite, (x.double().clamp(-CAP, CAP) * SCALE).round(), 0.0).long()
    m = q.abs()
    a, b = m >> SPLIT, m & (2**SPLIT - 1)
    return torch.stack([finite.sum(1), q.sum(1), (a * a).sum(1), (2 * a * b).sum(1), (b * b).sum(1)], 1)


def floor(summed: torch.Tensor, top: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """float32 ``[B]``: the least value a kept token may have, ``max - n * sigma`` rounded up to
    float32 (so that ``x >= floor`` for a float32 ``x`` is the rule itself); -inf where the row
    has ``n == 0``, no finite logit, or an infinite max. ``summed``: :func:`terms` summed over
    ranks; ``top``: each row's max (float64); ``n``: float64 ``[B]``."""
    count, total, a2, ab2, b2 = summed.unbind(1)
    rows = count.double().clamp(min=1)
    squares = a2.double() * 2.0 ** (2 * SPLIT) + ab2.double() * 2.0**SPLIT + b2.double()
    mean = total.double() / rows
    sigma = ((squares / rows - mean * mean).clamp(min=0) / SCALE**2).sqrt()
    bound = top - n * sigma
    f = bound.float()
    f = torch.where(f.double() < bound, torch.nextafter(f, torch.full_like(f, float("inf"))), f)
    return torch.where((n > 0) & top.isfinite() & (count > 0), f, NEG_INF)
