"""Sampling parameters, per-row token counts and their validation.

Every check here is local and deterministic, so all ranks (holding the same parameters) reject
bad input before any collective is issued: an invalid request never leaves a rank hanging.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5
"""A temperature below this is greedy decoding (vLLM's ``_SAMPLING_EPS``)."""

MAX_TEMPERATURE = 1e6
"""Upper bound keeping ``logits / temperature`` (float64) free of underflow, so that the division
preserves the strict order and the ties of the float32 logits."""

Value = float | int | Sequence[float] | torch.Tensor


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling parameters; a scalar applies to every row.

    ``temperature`` 0 (or below :data:`GREEDY_BELOW`) is greedy; ``top_k`` 0, ``top_p`` 1 and
    ``min_p`` 0 are off; penalties 1 / 0 / 0 are off. ``logprobs`` is batch-wide: ``None`` (no
    logprobs) or the number ``n >= 0`` of top logprobs to return with the chosen token's."""

    temperature: Value = 1.0
    top_k: Value = 0
    top_p: Value = 1.0
    min_p: Value = 0.0
    repetition_penalty: Value = 1.0
    presence_penalty: Value = 0.0
    frequency_penalty: Value = 0.0
    seed: Value = 0
    logprobs: int | None = None

    def resolve(self, batch: int, vocab_size: int) -> Rows:
        """Broadcast to ``batch`` rows and validate; raises ``ValueError`` naming row and field."""
        def column(name: str, dtype: torch.dtype) -> torch.Tensor:
            value = getattr(self, name)
            t = torch.as_tensor(value, dtype=torch.float64 if dtype.is_floating_point else None)
            if t.dim() == 0:
                t = t.expand(batch)
            if t.shape != (batch,):
                raise ValueError(f"{name}: expected a scalar or {batch} values, got shape {tuple(t.shape)}")
            if not dtype.is_floating_point and t.dtype.is_floating_point:
                bad = (t != t.round()).nonzero().flatten()
                if bad.numel():
                    r = bad[0].item()
                    raise ValueError(f"row {r}: {name} must be an integer, got {t[r].item()}")
            return t.to(dtype=dtype, device=torch.empty(0).device)  # the current default device

        rows = Rows(
            temperature=column("temperature", torch.float64), top_k=column("top_k", torch.int64),
            top_p=column("top_p", torch.float64), min_p=column("min_p", torch.float64),
            repetition_penalty=column("repetition_penalty", torch.float32),
            presence_penalty=column("presence_penalty", torch.float32),
            frequency_penalty=column("frequency_penalty", torch.float32),
            seed=column("seed", torch.int64), logprobs=self.logprobs)
        checks = (
            ("temperature", rows.temperature, lambda t: (t >= 0) & (t <= MAX_TEMPERATURE),
             f"must be in [0, {MAX_TEMPERATURE:g}]"),
            ("top_k", rows.top_k, lambda k: k >= 0, "must be >= 0"),
            ("top_p", rows.top_p, lambda p: (p > 0) & (p <= 1), "must be in (0, 1]"),
            ("min_p", rows.min_p, lambda p: (p >= 0) & (p <= 1), "must be in [0, 1]"),
            ("repetition_penalty", rows.repetition_penalty, lambda r: (r > 0) & r.isfinite(),
             "must be finite and > 0"),
            ("presence_penalty", rows.presence_penalty, torch.isfinite, "must be finite"),
            ("frequency_penalty", rows.frequency_penalty, torch.isfinite, "must be finite"),
            ("seed", rows.seed, lambda s: s >= 0, "must be >= 0"),
        )
        for name, t, ok, rule in checks:
            bad = (~ok(t)).nonzero().flatten()  # NaN fails every rule
            if bad.numel():
                r = bad[0].item()
                raise ValueError(f"row {r}: {name} {rule}, got {t[r].item()}")
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= vocab_size):
            raise ValueError(f"logprobs must be None or an int in [0, vocab_size={vocab_size}], "
                             f"got {self.logprobs!r}")
        return rows


@dataclass(frozen=True)
class Rows:
    """:class:`SamplingParams` resolved to one tensor per field (length B), validated."""

    temperature: torch.Tensor  # float64
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float64
    min_p: torch.Tensor  # float64
    repetition_penalty: torch.Tensor  # float32
    presence_penalty: torch.Tensor  # float32
    frequency_penalty: torch.Tensor  # float32
    seed: torch.Tensor  # int64
    logprobs: int | None

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class TokenCounts:
    """What each row has generated so far, without a ``[B, V]`` tensor: ``ids`` (int64 ``[B, K]``,
    unique per row, -1 = empty slot) and how often each occurred (``counts``, int64 ``[B, K]``)."""

    ids: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def from_history(cls, histories: Sequence[Sequence[int]]) -> TokenCounts:
        """Counts from each row's generated token ids."""
        per_row = [torch.unique(torch.as_tensor(list(h), dtype=torch.long), return_counts=True)
                   for h in histories]
        width = max([ids.numel() for ids, _ in per_row], default=0)
        ids = torch.full((len(per_row), width), -1, dtype=torch.long)
        counts = torch.zeros((len(per_row), width), dtype=torch.long)
        for b, (i, c) in enumerate(per_row):
            ids[b, : i.numel()], counts[b, : c.numel()] = i, c
        return cls(ids, counts)

    def check(self, batch: int, vocab_size: int) -> None:
        ids, counts = self.ids, self.counts
        if ids.dtype != torch.long or counts.dtype != torch.long or ids.dim() != 2 \
                or ids.shape != counts.shape or ids.shape[0] != batch:
            raise ValueError(f"token_counts: ids and counts must be int64 [{batch}, K] tensors of one shape, "
                             f"got {ids.dtype}{tuple(ids.shape)} and {counts.dtype}{tuple(counts.shape)}")
        for what, bad in (("ids must be in [-1, vocab_size)", (ids < -1) | (ids >= vocab_size)),
                          ("counts must be >= 0", counts < 0)):
            rows = bad.any(1).nonzero().flatten()
            if rows.numel():
                raise ValueError(f"row {rows[0].item()}: token_counts {what} (vocab_size={vocab_size})")
        ordered = ids.sort(1).values
        dup = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1).nonzero().flatten()
        if dup.numel():
            raise ValueError(f"row {dup[0].item()}: token_counts ids must be unique per row")


def check_positions(positions: torch.Tensor | Sequence[int], batch: int) -> torch.Tensor:
    """The per-row decode positions as int64 ``[B]``, all >= 0."""
    positions = torch.as_tensor(positions)
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.shape != (batch,):
        raise ValueError(f"positions must be {batch} integers, got {positions.dtype}{tuple(positions.shape)}")
    positions = positions.long()
    bad = (positions < 0).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"row {bad[0].item()}: position must be >= 0, got {positions[bad[0]].item()}")
    return positions


def check_bitmask(bitmask: torch.Tensor, batch: int, vocab_size: int) -> None:
    words = math.ceil(vocab_size / 32)
    if bitmask.dtype != torch.int32 or bitmask.shape != (batch, words):
        raise ValueError(f"bitmask must be int32 [{batch}, {words}] (xgrammar format), "
                         f"got {bitmask.dtype}{tuple(bitmask.shape)}")


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Within the block, tensor factories default to ``device`` (nothing to do on the CPU)."""
    return torch.device(device) if device.type != "cpu" else contextlib.nullcontext()


def to_device(device: torch.device, positions: torch.Tensor, token_counts: TokenCounts | None,
              bitmask: torch.Tensor | None) -> tuple[torch.Tensor, TokenCounts | None, torch.Tensor | None]:
    """The caller's per-row inputs on the logits' device."""
    counts = None if token_counts is None else TokenCounts(token_counts.ids.to(device),
                                                           token_counts.counts.to(device))
    return positions.to(device), counts, None if bitmask is None else bitmask.to(device)
