"""The per-request constraints OpenAI-compatible servers accept, resolved to what the samplers
apply to a row's logits: ``logit_bias`` to a short list of (id, bias) per row, added before the
penalties; ``allowed_token_ids`` and ``min_tokens`` (with ``stop_token_ids``, excluded while the
row has produced fewer than ``min_tokens`` tokens) to one bitmask of the ids each row may sample,
in xgrammar's format (bit ``id & 31`` of word ``id >> 5``), combined with a grammar's bitmask.
Every check is local and names the row and the field, so all ranks reject bad input alike."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

Ids = Sequence[int] | None
"""One row's token ids (``None``: none given)."""


def per_row(name: str, value: object, batch: int, one: type | tuple[type, ...]) -> list:
    """``value`` as ``batch`` per-row entries: ``None`` or one entry of type ``one`` for every
    row, or a list / tuple of ``batch`` entries (each ``None`` or of type ``one``)."""
    if value is None or isinstance(value, one):
        return [value] * batch
    if not isinstance(value, (list, tuple)) or not all(v is None or isinstance(v, one) for v in value):
        raise ValueError(f"{name}: expected None, {_kind(one)} for every row, or one per row, "
                         f"got {type(value).__name__}")
    if len(value) != batch:
        raise ValueError(f"{name}: expected one value per row ({batch}), got {len(value)}")
    return list(value)


def per_row_ids(name: str, value: object, batch: int) -> list[Ids]:
    """Token ids given for every row (a flat list of ints) or per row (a list of lists or None)."""
    if value is None:
        return [None] * batch
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: expected None, a list of token ids for every row, or one list (or None) "
                         f"per row, got {type(value).__name__}")
    if all(_is_int(v) for v in value):
        return [list(value)] * batch
    if not all(v is None or isinstance(v, (list, tuple)) for v in value):
        raise ValueError(f"{name}: expected a list of token ids or one list (or None) per row, got a list "
                         f"mixing both")
    if len(value) != batch:
        raise ValueError(f"{name}: expected one list (or None) per row ({batch}), got {len(value)}")
    return [None if v is None else list(v) for v in value]


def check_ids(name: str, rows: list[Ids], vocab_size: int) -> None:
    """Every id an int in ``[0, vocab_size)``; ``ValueError`` naming the first row and id that is not."""
    for r, ids in enumerate(rows):
        for i in ids or ():
            if not _is_int(i) or not 0 <= i < vocab_size:
                raise ValueError(f"row {r}: {name} id {i!r} is outside [0, vocab_size={vocab_size})")


def bias_lists(logit_bias: object, batch: int,
               vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``logit_bias`` -- one ``{token_id: bias}`` mapping for every row, or one per row (``None``:
    none) -- as int64 ids and float32 biases ``[B, K]`` (id -1 and bias 0 in empty slots);
    ``None`` when no row has one."""
    rows = per_row("logit_bias", logit_bias, batch, Mapping)
    check_ids("logit_bias", [None if m is None else list(m) for m in rows], vocab_size)
    for r, m in enumerate(rows):
        for i, bias in (m or {}).items():
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise ValueError(f"row {r}: logit_bias of id {i} must be finite (a number), got {bias!r}")
    width = max((len(m) for m in rows if m), default=0)
    if not width:
        return None
    ids = torch.full((batch, width), -1, dtype=torch.long)
    bias = torch.zeros((batch, width), dtype=torch.float32)
    for r, m in enumerate(rows):
        if m:
            ids[r, : len(m)] = torch.tensor(list(m), dtype=torch.long)
            bias[r, : len(m)] = torch.tensor(list(m.values()), dtype=torch.float32)
    return ids, bias


def allowed_bits(allowed_token_ids: object, min_tokens: object, stop_token_ids: object,
                 output_lens: torch.Tensor | None, batch: int, vocab_size: int) -> torch.Tensor | None:
    """The ids each row may sample as an int32 bitmask ``[B, ceil(V / 32)]``: those of
    ``allowed_token_ids`` (every id where not given), less the row's ``stop_token_ids`` while its
    ``output_lens`` (tokens produced so far) is below its ``min_tokens``. ``None`` when no row is
    constrained."""
    allowed = per_row_ids("allowed_token_ids", allowed_token_ids, batch)
    check_ids("allowed_token_ids", allowed, vocab_size)
    for r, ids in enumerate(allowed):
        if ids is not None and not ids:
            raise ValueError(f"row {r}: allowed_token_ids is empty (None allows every id)")
    stops = per_row_ids("stop_token_ids", stop_token_ids, batch)
    check_ids("stop_token_ids", stops, vocab_size)
    held = held_back(min_tokens, stop_token_ids, output_lens, batch)
    if all(ids is None for ids in allowed) and not held:
        return None
    may = torch.ones(batch, vocab_size, dtype=torch.bool)
    for r, ids in enumerate(allowed):
        if ids is not None:
            may[r] = False
            may[r, torch.tensor(ids, dtype=torch.long)] = True
    for r in held:
        may[r, torch.tensor(stops[r], dtype=torch.long)] = False
    return pack_bits(may)


def held_back(min_tokens: object, stop_token_ids: object, output_lens: object, batch: int) -> list[int]:
    """The rows whose stop ids are excluded: fewer than ``min_tokens`` produced (``output_lens``)."""
    least = per_row("min_tokens", min_tokens, batch, int)
    for r, n in enumerate(least):
        if n is None or isinstance(n, bool) or n < 0:
            raise ValueError(f"row {r}: min_tokens must be an int >= 0, got {n!r}")
    stops = per_row_ids("stop_token_ids", stop_token_ids, batch)
    held = [r for r in range(batch) if least[r] and stops[r]]
    if held and output_lens is None:
        raise ValueError(f"row {held[0]}: min_tokens with stop_token_ids needs output_lens (the tokens each "
                         f"row has produced)")
    lens = check_output_lens(output_lens, batch) if held else None
    return [r for r in held if int(lens[r]) < least[r]]


@dataclass(frozen=True)
class HeldStops:
    """A batch's ``min_tokens`` exclusions as device tensors, for rows any number of tokens on:
    per row the ids it may sample but for ``min_tokens`` (``allowed``) and its stop ids
    (``stops``), int32 bitmasks ``[B, words]``; its ``min_tokens`` (``least``) and
    ``output_lens`` (``lens``), int64 ``[B]``."""

    allowed: torch.Tensor
    stops: torch.Tensor
    least: torch.Tensor
    lens: torch.Tensor

    def at(self, index: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """The bitmask of the ids rows ``index`` may sample ``offset`` tokens on (both int64
        ``[S]``): a row's stop ids stay out while ``output_lens + offset < min_tokens``."""
        still = self.lens[index] + offset < self.least[index]
        return self.allowed[index] & ~torch.where(still[:, None], self.stops[index], 0)


def held_stops(allowed_token_ids: object, min_tokens: object, stop_token_ids: object, output_lens: object,
               batch: int, vocab_size: int, device: torch.device) -> HeldStops | None:
    """:class:`HeldStops` on ``device`` of a batch holding back some row's stop ids, else ``None``."""
    if not held_back(min_tokens, stop_token_ids, output_lens, batch):
        return None
    lens = check_output_lens(output_lens, batch)
    allowed = allowed_bits(allowed_token_ids, 0, None, None, batch, vocab_size)
    if allowed is None:
        allowed = pack_bits(torch.ones(batch, vocab_size, dtype=torch.bool))
    no_stops = allowed_bits(None, 1, stop_token_ids, torch.zeros_like(lens), batch, vocab_size)
    least = torch.tensor(per_row("min_tokens", min_tokens, batch, int), dtype=torch.long)
    return HeldStops(allowed.to(device), (~no_stops).to(device), least.to(device), lens.to(device))


def check_output_lens(output_lens: object, batch: int) -> torch.Tensor:
    """The tokens each row has produced: int64 ``[B]``, all >= 0."""
    lens = torch.as_tensor(output_lens)
    if lens.dtype.is_floating_point or lens.dtype == torch.bool or lens.shape != (batch,):
        raise ValueError(f"output_lens must be {batch} integers, got {lens.dtype}{tuple(lens.shape)}")
    bad = (lens < 0).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"row {bad[0].item()}: output_lens must be >= 0, got {lens[bad[0]].item()}")
    return lens.long().cpu()


def pack_bits(may: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, V]`` as an xgrammar int32 bitmask ``[B, ceil(V / 32)]``."""
    B, V = may.shape
    words = math.ceil(V / 32)
    bits = torch.zeros(B, words * 32, dtype=torch.long)
    bits[:, :V] = may.long()
    packed = (bits.view(B, words, 32) << torch.arange(32)).sum(2)
    return torch.where(packed >= 2**31, packed - 2**32, packed).int()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(one: type | tuple[type, ...]) -> str:
    names = [t.__name__ for t in (one if isinstance(one, tuple) else (one,))]
    return "a " + " or ".join(names)
