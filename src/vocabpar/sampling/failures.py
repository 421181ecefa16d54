"""Failures of an engine call, kept on the device as flags, and the one host copy that reads them.

An engine call never raises from inside and never reads a device value: a bad row (NaN
logits, nothing allowed), a rank whose input was bad (logits of the wrong dtype, shape or
device, a draft or token id out of range) and ranks that disagree on what must be replicated
become flags in the output. Every flag is computed from gathered data, so every rank holds the
same ones, and :meth:`Failures.raise_if_failed` raises the same ``ValueError`` on every rank.
The other rows' results are exact; the next call starts clean.

The engine writes a call's ids and flags into one int64 device tensor (:class:`Packed`): its
output's ``to_host()`` copies that tensor to the host once, and the host result raises from
what was copied, reading nothing more from the device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from vocabpar.sampling.params import shard_hint
from vocabpar.wire.records import INPUT_WORDS, Unpacked

ROW_PROBLEMS = {1: "contain NaN logits", 2: "have no allowed token (all -inf)"}
"""Per-row codes (0: the row is fine)."""

INPUT_PROBLEMS = {1: "local_logits", 5: "target_logits", 6: "draft_logits"}
"""Per-rank codes of a rejected logits tensor, by the argument's name; the check's ``input``
words say what it was."""

RANK_PROBLEMS = {2: "passed a draft token outside [0, vocab_size)",
                 3: "passed a token id outside [0, vocab_size)",
                 4: "passed draft logits holding +inf in a sampled row"}
"""The other per-rank codes of the folded check (0: the rank's input was fine)."""

LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes an engine call takes its logits in (it upcasts to float32 inside the call)."""

DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool)
"""Codes of the dtypes an input description names: 0 is not a tensor, ``len(DTYPES)`` another dtype."""


def rejected_input(value: object, shape: Sequence[int], device: torch.device) -> list[int] | None:
    """``None`` when ``value`` is a tensor of one of :data:`LOGITS_DTYPES`, of ``shape``, on
    ``device``; else its :data:`~vocabpar.wire.records.INPUT_WORDS` words (dtype code, on
    ``device``, dimensions, first three sizes, expected sizes). Host metadata only: no read."""
    tensor = isinstance(value, torch.Tensor)
    if tensor and value.dtype in LOGITS_DTYPES and value.shape == tuple(shape) and value.device == device:
        return None
    if not tensor:
        return [0, 1, 0, -1, -1, -1, *_three(shape)]
    code = DTYPES.index(value.dtype) if value.dtype in DTYPES else len(DTYPES)
    return [code, int(value.device == device), value.dim(), *_three(value.shape), *_three(shape)]


def _three(shape: Sequence[int]) -> list[int]:
    return [*list(shape)[:3], *[-1] * (3 - min(len(shape), 3))]


@dataclass(frozen=True)
class Check:
    """The folded check as every rank gathered it (fields ``[n, ...]``): each rank's ``problems``
    code and the row it concerns (``problem_rows``, -1: none) and ``inputs`` (int64 ``[n,
    INPUT_WORDS]``, what a rejected tensor was); ``differ``: int64 ``[n, facts]``, each rank's
    fact words minus rank 0's (0 where they agree); ``first_row``: int64 ``[n]``, ``rows - b``
    for the first row ``b`` whose fingerprint differs from rank 0's (0: none), of a message of
    ``rows`` rows."""

    problems: torch.Tensor
    problem_rows: torch.Tensor
    inputs: torch.Tensor
    differ: torch.Tensor
    first_row: torch.Tensor
    rows: int

    @staticmethod
    def of(got: Unpacked, countdown: torch.Tensor) -> Check:
        """From a gathered :func:`~vocabpar.wire.records.folded` message; ``countdown``: int64
        ``rows, rows - 1, ..., 1`` on its device. No host read."""
        first_row = ((got.row_facts != got.row_facts[:1]) * countdown).amax(1)
        return Check(got.problem, got.row, got.input, got.facts - got.facts[:1], first_row, countdown.numel())

    def failed(self) -> torch.Tensor:
        """Whether the whole call failed (a rank's input was bad or ranks disagree), 0-dim bool."""
        return (self.problems != 0).any() | (self.differ != 0).any()

    def flags(self, codes: torch.Tensor) -> list[torch.Tensor]:
        """The int64 flag words of a call with row ``codes``, in :class:`Failures` order."""
        return [codes, self.problems, self.problem_rows, self.inputs.reshape(-1), self.differ.reshape(-1),
                self.first_row]


@dataclass(frozen=True)
class Failures:
    """An engine call's flags, int64 ``words``: the ``rows`` codes ``[batch]``; each of the
    ``ranks`` ranks' problem code, the row it concerns and its rejected input's description;
    per rank, ``facts`` words, nonzero where its fact differs from rank 0's (the first ones
    named by ``fact_names``); per rank, where its row fingerprints first differ from rank 0's
    (:class:`Check`, of a ``row_bound``-row message). ``where``: the call, for the message;
    ``vocab_size``: for its hints; ``host``: the same words already read on the host (by
    ``to_host()``)."""

    where: str
    words: torch.Tensor
    batch: int
    ranks: int
    fact_names: tuple[str, ...]
    facts: int
    vocab_size: int
    row_bound: int
    host: tuple[int, ...] | None = None

    @property
    def rows(self) -> torch.Tensor:
        """int64 ``[B]``: each row's code (:data:`ROW_PROBLEMS`, 0: fine)."""
        return self.words[: self.batch]

    def _starts(self) -> tuple[int, int, int, int]:
        """Where the problem codes, their rows, the inputs and the fact flags start."""
        B, n = self.batch, self.ranks
        return B, B + n, B + 2 * n, B + n * (2 + INPUT_WORDS)

    def failed(self) -> torch.Tensor:
        """bool ``[B]``: rows whose result is not valid (every row when a rank's input was bad or
        the ranks disagree). No host read."""
        codes, rows, _, facts = self._starts()
        call = (self.words[codes:rows] != 0).any() | (self.words[facts: -self.ranks] != 0).any()
        return (self.rows != 0) | call

    def on_host(self, words: torch.Tensor, values: Sequence[int]) -> Failures:
        """These flags as copied to the host: ``words`` (a CPU tensor) and their ``values``."""
        return dataclasses.replace(self, words=words, host=tuple(values))

    def raise_if_failed(self) -> None:
        """Raise one ``ValueError`` naming every failure; nothing when all is well. On the device
        the one host read of an engine call (all flags are copied at once); on a host copy none."""
        flags = list(self.host) if self.host is not None else self.words.tolist()
        n, F = self.ranks, self.facts
        codes, at, inputs, facts = self._starts()
        parts = []
        for r in range(n):
            code, row = flags[codes + r], flags[at + r]
            if code in INPUT_PROBLEMS:
                words = flags[inputs + r * INPUT_WORDS: inputs + (r + 1) * INPUT_WORDS]
                parts.append(f"rank {r}: {_rejected(INPUT_PROBLEMS[code], words, r, self.vocab_size)}")
            elif code:
                parts.append(f"rank {r} {RANK_PROBLEMS.get(code, f'had problem {code}')}"
                             + (f" at row {row}" if row >= 0 else ""))
        differ = [flags[facts + r * F: facts + (r + 1) * F] for r in range(n)]
        names = [name for f, name in enumerate(self.fact_names) if any(d[f] != 0 for d in differ)]
        if names:
            rank = next(r for r in range(n) if any(differ[r]))
            countdown = flags[facts + n * F + rank]
            first = f" first at row {self.row_bound - countdown}" if countdown else ""
            parts.append(f"ranks disagree on {', '.join(names)} (rank {rank} differs from rank 0{first}; "
                         f"they must be the same on every rank)")
        for code, what in ROW_PROBLEMS.items():
            bad = [b for b, c in enumerate(flags[: self.batch]) if c == code]
            if bad:
                parts.append(f"rows {bad} {what}")
        if parts:
            raise ValueError(f"{self.where}: " + "; ".join(parts))


def _rejected(name: str, words: Sequence[int], rank: int, vocab_size: int) -> str:
    """"local_logits must be float32, bfloat16 or float16 [6, 512] on the batch's device, got
    torch.float64(6, 512): convert them with .float()" from a rejected input's words."""
    code, on_device, dims, *sizes = words
    expected = [s for s in sizes[3:] if s >= 0]
    names = [str(d).removeprefix("torch.") for d in LOGITS_DTYPES]
    want = f"{name} must be {', '.join(names[:-1])} or {names[-1]} {expected} on the batch's device"
    if code == 0:
        return f"{want}, got something other than a tensor"
    dtype = DTYPES[code] if code < len(DTYPES) else None
    shown = sizes[: min(dims, 3)] + ["..."] * (dims > 3)
    got = f"{dtype or 'a tensor of another dtype'}({', '.join(map(str, shown))}{',' * (dims == 1)})"
    if dtype not in LOGITS_DTYPES:
        hint = ": convert them with .float()"
    elif dims == len(expected) and shown[:-1] == expected[:-1] and shown[-1] != expected[-1]:
        hint = shard_hint(shown[-1], expected[-1], vocab_size, f"rank {rank}")
    else:
        hint = " on another device" * (not on_device)
    return f"{want}, got {got}{hint}"


@dataclass(frozen=True)
class Packed:
    """An engine call's results and flags in one int64 tensor ``words`` (a float field as its
    float64 bits): ``slots`` give each field's name, first word, shape and dtype. The device
    output's int64 fields are views of ``words``; one copy of it is the whole host result."""

    words: torch.Tensor
    slots: tuple[tuple[str, int, tuple[int, ...], torch.dtype], ...]

    @staticmethod
    def of(fields: dict[str, torch.Tensor | list[torch.Tensor]]) -> Packed:
        """``fields`` packed in order, in one concatenation: int64 or float tensors of any shape,
        or a list of 1-D int64 tensors that makes one field."""
        flat, slots, start = [], [], 0
        for name, t in fields.items():
            parts = t if isinstance(t, list) else [t.reshape(-1)]
            shape = (sum(p.numel() for p in parts),) if isinstance(t, list) else tuple(t.shape)
            dtype = torch.long if isinstance(t, list) else t.dtype
            flat += [p.long() if dtype == torch.long else p.double().view(torch.long) for p in parts]
            slots.append((name, start, shape, dtype))
            start += math.prod(shape)
        return Packed(torch.cat(flat), tuple(slots))

    def on_device(self, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``fields`` as given to :meth:`of`, each int64 one replaced by its view of ``words``."""
        return {name: self._field(slot) if slot[3] == torch.long else fields[name]
                for slot in self.slots if (name := slot[0]) in fields}

    def fields(self) -> dict[str, torch.Tensor]:
        """Each field read from ``words``: an int64 field as a view, a float field converted back."""
        return {slot[0]: self._field(slot) for slot in self.slots}

    def _field(self, slot: tuple[str, int, tuple[int, ...], torch.dtype]) -> torch.Tensor:
        _, start, shape, dtype = slot
        part = self.words[start: start + math.prod(shape)]
        return (part if dtype == torch.long else part.view(torch.float64).to(dtype)).view(shape)

    def span(self, name: str) -> slice:
        """The words of field ``name``."""
        start, shape = next((start, shape) for slot, start, shape, _ in self.slots if slot == name)
        return slice(start, start + math.prod(shape))


Result = TypeVar("Result", bound="EngineResult")


class EngineResult:
    """What the engine's outputs (:class:`~vocabpar.sampling.semantics.SampleOutput`,
    :class:`~vocabpar.sampling.semantics.VerifyOutput`,
    :class:`~vocabpar.sampling.scoring.TokenLogprobs`) share: their ``failures`` and, from an
    engine call, the ``packed`` words that hold their tensors and flags."""

    failures: Failures | None
    packed: Packed | None

    def raise_if_failed(self) -> None:
        """Raise the engine call's failures (the same ``ValueError`` on every rank), if any: one
        host read on a device output, none on a :meth:`to_host` copy."""
        if self.failures is not None:
            self.failures.raise_if_failed()

    def to_host(self: Result) -> Result:
        """This result on the host. From an engine call: one device-to-host copy of the tensor
        its ids and failure flags share, so the copy's ``raise_if_failed()`` reads nothing more.
        Otherwise each tensor is copied."""
        if self.packed is None:
            return dataclasses.replace(self, **{f.name: getattr(self, f.name).cpu()
                                                for f in dataclasses.fields(self)
                                                if isinstance(getattr(self, f.name), torch.Tensor)})
        values = self.packed.words.tolist()  # the one host read
        packed = dataclasses.replace(self.packed, words=torch.tensor(values, dtype=torch.long))
        fields = packed.fields()
        flags = fields.pop("flags")
        failures = self.failures.on_host(flags, values[packed.span("flags")])
        return dataclasses.replace(self, **fields, failures=failures, packed=packed)


def fold_problem(problem: torch.Tensor, bad: torch.Tensor, code: int) -> torch.Tensor:
    """This rank's (code, row) ``problem`` with a bad-input mask ``[B, ...]`` folded in: the
    first problem wins; its row is the first bad one. No host read."""
    per_row = bad.reshape(bad.shape[0], -1).any(1)
    any_bad = per_row.any()
    first = per_row.long().argmax() if per_row.numel() else torch.tensor(0, device=bad.device)
    new = torch.stack([torch.where(any_bad, code, 0), torch.where(any_bad, first, -1)])
    return torch.where(problem[0] != 0, problem, new)
