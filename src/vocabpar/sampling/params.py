"""Sampling parameters, per-row token counts and their validation.

Every check here is local and deterministic, so all ranks (holding the same parameters) reject
bad input before any collective is issued: an invalid request never leaves a rank hanging.
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from vocabpar.hashing import M32, fmix32
from vocabpar.sampling.constraints import allowed_bits, bias_lists, per_row, per_row_ids
from vocabpar.wire.filters import FILTERS

GREEDY_BELOW = 1e-5
"""A temperature below this is greedy decoding (vLLM's ``_SAMPLING_EPS``)."""

MAX_TEMPERATURE = 1e6
"""Upper bound keeping ``logits / temperature`` (float64) free of underflow, so that the division
preserves the strict order and the ties of the float32 logits."""

Value = float | int | Sequence[float] | torch.Tensor

LOGPROBS_OF = ("raw", "processed")
"""``raw``: log-softmax of the logits as given (vLLM's default); ``processed``: of what the row
was drawn from -- after penalties and bitmask, and for sampled rows after temperature and the
top-k / top-p / min-p filters (tokens filtered out have -inf)."""

FILTER_ORDERS = ("hf", "vllm")
"""``hf``: top-k, top-p, min-p (top-p's mass is over the top-k set); ``vllm``: min-p before top-p
(top-p's mass is over the tokens that pass both top-k and min-p)."""

INT64_BOUND = 2**63

ROW_FIELDS = {"temperature": torch.float64,
              **{f.name: torch.int64 if f.kind is int else torch.float64 for f in FILTERS},
              "repetition_penalty": torch.float32, "presence_penalty": torch.float32,
              "frequency_penalty": torch.float32, "seed": torch.int64}
"""The per-row fields of :class:`SamplingParams` and the dtype each resolves to (one per filter of
:data:`vocabpar.wire.filters.FILTERS`, in its order)."""
ROW_CONSTRAINTS = ("bias_ids", "bias", "allowed")
"""The fields of :class:`Rows` that hold the resolved request constraints (``None`` when unused)."""
CONSTRAINT_IDS = ("allowed_token_ids", "stop_token_ids")
"""The constraints given as token ids, for every row (a flat list) or per row (a list of lists)."""

RULES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "temperature": (lambda t: (t >= 0) & (t <= MAX_TEMPERATURE), f"must be in [0, {MAX_TEMPERATURE:g}]"),
    **{f.name: f.rule for f in FILTERS},
    "repetition_penalty": (lambda r: (r > 0) & r.isfinite(), "must be finite and > 0"),
    "presence_penalty": (torch.isfinite, "must be finite"),
    "frequency_penalty": (torch.isfinite, "must be finite"),
    "seed": (lambda s: s >= 0, "must be >= 0 (None draws a fresh one)"),
}
"""What each per-row value must satisfy (NaN fails every rule); the filters' rules are their
:data:`vocabpar.wire.filters.FILTERS` entries'."""


def row_seeds(seed: int, batch: int) -> torch.Tensor:
    """The per-row seeds of a batch given one scalar ``seed``: int64 ``[batch]`` in ``[0, 2**63)``,
    computed on the host from ``(seed, row index)`` alone. Distinct rows get distinct seeds (the
    low word is a bijection of the row index); the same seed and batch give the same seeds, on
    every rank and for any number of ranks."""
    key = fmix32(torch.tensor((seed & M32) ^ 0x9E3779B9) ^ fmix32(torch.tensor(seed >> 32)))
    row = torch.arange(batch, dtype=torch.long) & M32
    low = fmix32(key ^ fmix32(row))
    high = fmix32(low ^ fmix32(key ^ 0x7F4A7C15)) & 0x7FFFFFFF
    return (high << 32) | low


def _fresh_seed() -> int:
    """A batch seed drawn from torch's default generator (``torch.manual_seed`` reproduces it)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.long))


@dataclass(frozen=True)
class SamplingParams:
    r"""Per-row sampling parameters; a scalar applies to every row.

    ``temperature`` 0 (or below :data:`GREEDY_BELOW`) is greedy; ``top_k`` 0 or -1, ``top_p`` 1,
    ``min_p`` 0 and ``top_n_sigma`` 0 or ``None`` (:mod:`vocabpar.sampling.sigma`) are off;
    penalties 1 / 0 / 0 are off. ``logprobs``: ``None`` (no logprobs), the number ``n >= 0`` of
    top logprobs to return with the chosen token's, or one such value per row. ``logprobs_of``
    (one of :data:`LOGPROBS_OF`) and ``filter_order`` (one of :data:`FILTER_ORDERS`) are
    batch-wide.

    ``seed``: a scalar seeds the batch -- row ``b`` samples with :func:`row_seeds`\ ``(seed)[b]``,
    so identical prompts give independent rows and the same call gives the same tokens again; a
    list gives each row its own seed (pin a request's seed this way: it then samples the same
    wherever it sits in a batch); ``None`` draws a fresh batch seed from torch's default
    generator at construction (every rank must draw the same: seed torch alike on every rank).
    Scalars and the batch-wide fields are checked here; per-row values when resolved.

    Request constraints (:mod:`vocabpar.sampling.constraints`), each for every row or one per
    row: ``logit_bias`` (``{token_id: bias}``, added to the logits before the penalties),
    ``allowed_token_ids`` (every other id is excluded), ``min_tokens`` with ``stop_token_ids``
    (the stop ids are excluded while the row has produced fewer than ``min_tokens`` tokens: the
    call's ``output_lens``)."""

    temperature: Value = 1.0
    top_k: Value = 0
    top_p: Value = 1.0
    min_p: Value = 0.0
    top_n_sigma: Value | None = 0.0
    repetition_penalty: Value = 1.0
    presence_penalty: Value = 0.0
    frequency_penalty: Value = 0.0
    seed: Value = 0
    logprobs: int | None | Sequence[int | None] = None
    logprobs_of: str = "raw"
    filter_order: str = "hf"
    logit_bias: Mapping[int, float] | Sequence[Mapping[int, float] | None] | None = None
    allowed_token_ids: Sequence[int] | Sequence[Sequence[int] | None] | None = None
    min_tokens: int | Sequence[int] = 0
    stop_token_ids: Sequence[int] | Sequence[Sequence[int] | None] | None = None

    def __post_init__(self) -> None:
        """Draw the seed ``None`` asks for; reject a bad scalar or batch-wide field here, in one
        line naming it, rather than inside the first ``sample`` call."""
        if self.seed is None:
            object.__setattr__(self, "seed", _fresh_seed())
        if self.top_n_sigma is None:
            object.__setattr__(self, "top_n_sigma", 0.0)
        for name, choices in (("filter_order", FILTER_ORDERS), ("logprobs_of", LOGPROBS_OF)):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:
                raise ValueError(f"SamplingParams: {name} must be one of {choices}, "
                                 f"got {getattr(self, name)!r}")
        for name, dtype in ROW_FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) and getattr(value, "ndim", 0) == 0:  # a scalar
                try:
                    _column(name, value, dtype, 1)
                except ValueError as e:
                    raise ValueError(f"SamplingParams: {str(e).removeprefix('row 0: ')}") from None
        n = self.logprobs
        if n is not None and not isinstance(n, (list, tuple)) and (
                isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"SamplingParams: logprobs must be None, an int >= 0 or one such value per row, "
                             f"got {n!r}")

    def resolve(self, batch: int, vocab_size: int, output_lens: torch.Tensor | None = None) -> Rows:
        """Broadcast to ``batch`` rows (a scalar seed becomes :func:`row_seeds`) and validate;
        raises ``ValueError`` naming row and field. ``output_lens``: the tokens each row has
        produced (needed by ``min_tokens``)."""
        cols = {name: _column(name, getattr(self, name), dtype, batch, checked=False)
                for name, dtype in ROW_FIELDS.items()}
        _check_rules(cols)
        cols["top_k"] = cols["top_k"].clamp(min=0)  # -1 is vLLM's "off", our 0
        device = torch.empty(0).device  # the current default device
        bias = bias_lists(self.logit_bias, batch, vocab_size)
        bias_ids, bias = (None, None) if bias is None else (t.to(device) for t in bias)
        allowed = allowed_bits(self.allowed_token_ids, self.min_tokens, self.stop_token_ids, output_lens,
                               batch, vocab_size)
        return Rows(**cols, logprobs=self._logprob_counts(batch, vocab_size), logprobs_of=self.logprobs_of,
                    filter_order=self.filter_order, bias_ids=bias_ids, bias=bias,
                    allowed=None if allowed is None else allowed.to(device))

    def row_counts(self) -> dict[str, int]:
        """How many values each field given per row (a list or a 1-D tensor) holds, by name."""
        given = {name: getattr(self, name) for name in [*ROW_FIELDS, "logprobs", "logit_bias", "min_tokens"]}
        counts = {name: len(value) for name, value in given.items()
                  if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) == 1}
        for name in CONSTRAINT_IDS:  # per row: a list of lists (or None), not a flat list of ids
            value = getattr(self, name)
            if isinstance(value, (list, tuple)) and value and all(v is None or isinstance(v, (list, tuple))
                                                                  for v in value):
                counts[name] = len(value)
        return counts

    def with_row_seeds(self, batch: int) -> SamplingParams:
        """These parameters with a scalar seed replaced by its ``batch`` per-row seeds, so that
        any subset of the rows samples exactly as it would within the whole batch."""
        if torch.as_tensor(self.seed).dim():
            return self
        return replace(self, seed=_column("seed", self.seed, torch.int64, batch).cpu())

    def unconstrained(self) -> SamplingParams:
        """These parameters without request constraints: what resolves each row's filters,
        penalties and seed alone."""
        return replace(self, logit_bias=None, allowed_token_ids=None, min_tokens=0, stop_token_ids=None)

    def take(self, batch: int, vocab_size: int, index: torch.Tensor) -> SamplingParams:
        """These parameters, resolved for ``batch`` rows, at rows ``index`` (row ``j`` of the result
        is row ``index[j]``); logprobs are not carried."""
        rows = self.unconstrained().resolve(batch, vocab_size).take(index)
        picked = index.tolist()
        constraints = {
            "logit_bias": per_row("logit_bias", self.logit_bias, batch, Mapping),
            "min_tokens": per_row("min_tokens", self.min_tokens, batch, int),
            **{name: per_row_ids(name, getattr(self, name), batch) for name in CONSTRAINT_IDS}}
        return SamplingParams(**{name: getattr(rows, name) for name in ROW_FIELDS},
                              logprobs_of=self.logprobs_of, filter_order=self.filter_order,
                              **{name: [values[i] for i in picked] if picked else None
                                 for name, values in constraints.items()})

    def _logprob_counts(self, batch: int, vocab_size: int) -> torch.Tensor | None:
        """int64 ``[B]`` top-logprob counts, -1 for rows that want none; ``None`` if no row does."""
        per_row = self.logprobs if isinstance(self.logprobs, (list, tuple)) else [self.logprobs] * batch
        if len(per_row) != batch:
            raise ValueError(f"logprobs: expected None, an int or {batch} values, got {len(per_row)} values")
        for r, n in enumerate(per_row):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= vocab_size):
                raise ValueError(f"row {r}: logprobs must be None or an int in [0, vocab_size={vocab_size}], "
                                 f"got {n!r}")
        if self.logprobs is None or (per_row and all(n is None for n in per_row)):
            return None
        return torch.tensor([-1 if n is None else n for n in per_row], dtype=torch.long,
                            device=torch.empty(0).device)


@dataclass(frozen=True)
class Rows:
    """:class:`SamplingParams` resolved to one tensor per field (length B), validated."""

    temperature: torch.Tensor  # float64
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float64
    min_p: torch.Tensor  # float64
    top_n_sigma: torch.Tensor  # float64, 0 = off
    repetition_penalty: torch.Tensor  # float32
    presence_penalty: torch.Tensor  # float32
    frequency_penalty: torch.Tensor  # float32
    seed: torch.Tensor  # int64
    logprobs: torch.Tensor | None  # int64, -1 = none for this row; None: no row wants any
    logprobs_of: str
    filter_order: str
    bias_ids: torch.Tensor | None = None  # int64 [B, K], -1 = empty slot; None: no row has a logit_bias
    bias: torch.Tensor | None = None  # float32 [B, K], 0 in empty slots
    allowed: torch.Tensor | None = None  # int32 [B, ceil(V / 32)] bitmask of the ids a row may sample

    @property
    def top_n(self) -> int:
        """The most top logprobs any row asked for (0 when none or no rows)."""
        return int(self.logprobs.max()) if self.logprobs is not None and self.logprobs.numel() else 0

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature < GREEDY_BELOW

    def take(self, index: torch.Tensor) -> Rows:
        """These rows at ``index`` (row ``j`` of the result is row ``index[j]``), without logprobs."""
        taken = {name: getattr(self, name)[index] for name in (*ROW_FIELDS, *ROW_CONSTRAINTS)
                 if getattr(self, name) is not None}
        return replace(self, **taken, logprobs=None)


@dataclass(frozen=True)
class TokenCounts:
    """The tokens each row has seen, without a ``[B, V]`` tensor: ``ids`` (int64 ``[B, K]``,
    unique per row, -1 = empty slot), how often each was generated (``counts``, int64 ``[B, K]``)
    and, optionally, whether it occurs in the row's prompt (``in_prompt``, bool ``[B, K]``, False
    at empty slots; ``None``: no prompt tokens). Repetition penalises tokens in the prompt or
    generated; presence and frequency only generated ones."""

    ids: torch.Tensor
    counts: torch.Tensor
    in_prompt: torch.Tensor | None = None

    @classmethod
    def from_history(cls, histories: Sequence[Sequence[int]],
                     prompts: Sequence[Sequence[int]] | None = None) -> TokenCounts:
        """Counts from each row's generated token ids and, when given, its prompt's ids."""
        if prompts is not None and len(prompts) != len(histories):
            raise ValueError(f"token_counts: {len(histories)} histories but {len(prompts)} prompts")
        rows = []
        for b, h in enumerate(histories):
            generated = torch.as_tensor(list(h), dtype=torch.long)
            prompt = torch.as_tensor([] if prompts is None else list(prompts[b]), dtype=torch.long)
            ids, slot = torch.unique(torch.cat([generated, prompt]), return_inverse=True)
            n = generated.numel()
            seen = torch.zeros(ids.numel(), dtype=torch.bool)
            seen[slot[n:]] = True
            rows.append((ids, torch.bincount(slot[:n], minlength=ids.numel()), seen))
        width = max([ids.numel() for ids, _, _ in rows], default=0)
        ids = torch.full((len(rows), width), -1, dtype=torch.long)
        counts = torch.zeros((len(rows), width), dtype=torch.long)
        in_prompt = torch.zeros((len(rows), width), dtype=torch.bool)
        for b, (i, c, p) in enumerate(rows):
            ids[b, : i.numel()], counts[b, : i.numel()], in_prompt[b, : i.numel()] = i, c, p
        return cls(ids, counts, None if prompts is None else in_prompt)

    def check(self, batch: int, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first problem: shapes and dtypes, ids outside
        ``[-1, vocab_size)``, negative counts, repeated ids, prompt flags on empty slots."""
        ids, counts, in_prompt = self.ids, self.counts, self.in_prompt
        if ids.dtype != torch.long or counts.dtype != torch.long or ids.dim() != 2 \
                or ids.shape != counts.shape or ids.shape[0] != batch:
            raise ValueError(f"token_counts: ids and counts must be int64 [{batch}, K] tensors of one shape, "
                             f"got {ids.dtype}{tuple(ids.shape)} and {counts.dtype}{tuple(counts.shape)}")
        if in_prompt is not None and (in_prompt.dtype != torch.bool or in_prompt.shape != ids.shape):
            raise ValueError(f"token_counts: in_prompt must be None or a bool tensor of the shape of ids "
                             f"{tuple(ids.shape)}, got {in_prompt.dtype}{tuple(in_prompt.shape)}")
        problems = [("ids must be in [-1, vocab_size)", (ids < -1) | (ids >= vocab_size)),
                    ("counts must be >= 0", counts < 0)]
        if in_prompt is not None:
            problems.append(("in_prompt must be False at empty slots (id -1)", in_prompt & (ids < 0)))
        for what, bad in problems:
            rows = bad.any(1).nonzero().flatten()
            if rows.numel():
                raise ValueError(f"row {rows[0].item()}: token_counts {what} (vocab_size={vocab_size})")
        ordered = ids.sort(1).values
        dup = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1).nonzero().flatten()
        if dup.numel():
            raise ValueError(f"row {dup[0].item()}: token_counts ids must be unique per row")

    def to(self, device: torch.device) -> TokenCounts:
        """The same counts on ``device``."""
        return self._map(lambda t: t.to(device))

    def select(self, rows: slice) -> TokenCounts:
        """The counts of batch rows ``rows``."""
        return self._map(lambda t: t[rows])

    def _map(self, f: Callable[[torch.Tensor], torch.Tensor]) -> TokenCounts:
        return TokenCounts(f(self.ids), f(self.counts), None if self.in_prompt is None else f(self.in_prompt))


def _column(name: str, value: Value, dtype: torch.dtype, batch: int, checked: bool = True) -> torch.Tensor:
    """Field ``name`` as ``batch`` values of ``dtype`` on the current default device, checked
    against :data:`RULES` (unless not ``checked``: :func:`_check_rules` then checks every field
    at once); a scalar seed becomes the batch's :func:`row_seeds`."""
    kind = "real numbers" if dtype.is_floating_point else "integers in [-2**63, 2**63)"
    try:
        t = torch.as_tensor(value, dtype=torch.float64 if dtype.is_floating_point else None)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        t = None
    if t is None or t.is_complex():
        many = isinstance(value, (list, tuple)) or getattr(value, "dim", lambda: 0)()
        wanted = f"a scalar or {batch} {kind}" if many else ("a real number" if dtype.is_floating_point
                                                             else "an integer in [-2**63, 2**63)")
        raise ValueError(f"{name}: expected {wanted}, got {reprlib.repr(value)}")
    scalar = t.dim() == 0
    if scalar:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"{name}: expected a scalar or {batch} values, got shape {tuple(t.shape)}")
    if not dtype.is_floating_point and t.dtype.is_floating_point:
        bad = ((t != t.round()) | (t.abs() >= INT64_BOUND)).nonzero().flatten()  # NaN is bad too
        if bad.numel():
            r = bad[0].item()
            raise ValueError(f"row {r}: {name} must be an integer in [-2**63, 2**63), got {t[r].item()}")
    t = t.to(dtype=dtype)
    if checked:
        _check_rules({name: t})
    if name == "seed" and scalar:
        t = row_seeds(int(value), batch)
    return t.to(device=torch.empty(0).device)  # the current default device


def _check_rules(cols: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the first field (in order) that breaks its :data:`RULES`
    entry, and its first bad row: one host read for all the fields when none does."""
    failing = torch.stack([(~RULES[name][0](t)).any() for name, t in cols.items()]).tolist()
    for (name, t), bad in zip(cols.items(), failing):
        if bad:
            r = int((~RULES[name][0](t)).nonzero()[0, 0])
            raise ValueError(f"row {r}: {name} {RULES[name][1]}, got {t[r].item()}")


def check_row_counts(B: int, params: SamplingParams, token_counts: TokenCounts | None,
                     bitmask: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming each per-row argument whose length is not ``positions``' ``B``."""
    lengths = params.row_counts()
    if isinstance(token_counts, TokenCounts) and isinstance(token_counts.ids, torch.Tensor) \
            and token_counts.ids.dim():
        lengths["token_counts"] = token_counts.ids.shape[0]
    if isinstance(bitmask, torch.Tensor) and bitmask.dim():
        lengths["bitmask"] = bitmask.shape[0]
    wrong = [f"{name} has {n}" for name, n in lengths.items() if n != B]
    if wrong:
        raise ValueError(f"positions has {B} rows but {' and '.join(wrong)}: every per-row argument needs "
                         f"one value per row (positions sets the batch)")


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
    counts = None if token_counts is None else token_counts.to(device)
    return positions.to(device), counts, None if bitmask is None else bitmask.to(device)


def check_sample_inputs(name: str, logits: torch.Tensor, columns: int | None, vocab_size: int | None,
                        params: SamplingParams,
                        positions: torch.Tensor | Sequence[int], token_counts: TokenCounts | None,
                        bitmask: torch.Tensor | None, where: str = "", output_lens: torch.Tensor | None = None
                        ) -> tuple[Rows, torch.Tensor, TokenCounts | None, torch.Tensor | None]:
    """Validate one sampling call's inputs -- ``logits`` float32 ``[B, columns]`` (``name`` in
    the error), the parameters, positions, token counts and bitmask of ``B`` rows over
    ``vocab_size`` ids (``None`` for both: full rows of any width), ``output_lens`` for
    ``min_tokens`` -- and return the resolved rows and the per-row inputs on the logits' device."""
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 or logits.dim() != 2 \
            or columns not in (None, logits.shape[1]):
        raise ValueError(f"{name} must be float32 [B, {'V' if columns is None else columns}]{where}, "
                         f"got {describe(logits)}{_logits_hint(logits, columns, vocab_size)}")
    B, vocab_size = logits.shape[0], vocab_size or logits.shape[1]
    rows = params.resolve(B, vocab_size, output_lens)
    pos = check_positions(positions, B)
    if token_counts is not None:
        token_counts.check(B, vocab_size)
    if bitmask is not None:
        check_bitmask(bitmask, B, vocab_size)
    return rows, *to_device(logits.device, pos, token_counts, bitmask)


def _logits_hint(logits: object, columns: int | None, vocab_size: int | None) -> str:
    """What a rejected logits tensor most likely is, and the fix."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        return ""
    width = logits.shape[1]
    if columns is not None and width != columns:
        return shard_hint(width, columns, vocab_size, "this rank")
    return f": convert them with .float() (from {logits.dtype})" if logits.dtype != torch.float32 else ""


def shard_hint(width: int, columns: int, vocab_size: int, who: str) -> str:
    """Why logits ``width`` wide do not fit ``who``'s ``columns`` columns of the layout, and the fix."""
    if width == vocab_size:
        return (f": these are full rows of the vocabulary ({vocab_size} ids) but the layout gives {who} "
                f"{columns} columns; pass {'this' if who == 'this rank' else 'each'} rank's shard "
                f"(compute_logits(strategy='none')) or sample full rows with reference_sample")
    return (f": the layout gives {who} {columns} columns of a {vocab_size}-id vocabulary; build it "
            f"with the model's vocabulary size and this group's world size")


def describe(t: object) -> str:
    """A value's dtype and shape (or type) for error messages."""
    return f"{getattr(t, 'dtype', type(t).__name__)}{tuple(getattr(t, 'shape', ()))}"


def check_drafts(draft_tokens: torch.Tensor, batch: int, vocab_size: int, where: str = "") -> int:
    """Validate the draft tokens (int64 ``[B, k]``, ids in ``[0, vocab_size)``); returns ``k``."""
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dtype != torch.long \
            or draft_tokens.dim() != 2 or draft_tokens.shape[0] != batch:
        raise ValueError(f"draft_tokens must be int64 [{batch}, k]{where}, got {describe(draft_tokens)}")
    bad = ((draft_tokens < 0) | (draft_tokens >= vocab_size)).nonzero()
    if bad.numel():
        b, i = bad[0].tolist()
        raise ValueError(f"draft token {draft_tokens[b, i].item()} at row {b}, position {i} is outside "
                         f"[0, vocab_size={vocab_size}){where}")
    return draft_tokens.shape[1]


def check_logits(name: str, logits: torch.Tensor | None, shape: tuple[int, ...], where: str) -> None:
    """FP32 logits of exactly ``shape`` (``None`` passes); draft logits may not hold +inf (their
    distribution would be a point mass the acceptance rule cannot weigh)."""
    if logits is None:
        return
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 or tuple(logits.shape) != shape:
        raise ValueError(f"{name} must be float32 {list(shape)}{where}, got {describe(logits)}")
    if name == "draft_logits" and bool(logits.isposinf().any()):
        b, i = logits.isposinf().any(-1).nonzero()[0].tolist()
        raise ValueError(f"draft_logits{where} hold +inf at row {b}, position {i}")


def check_verify_inputs(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                        draft_logits: torch.Tensor | None, vocab_size: int, columns: int,
                        where: str = "") -> tuple[int, int]:
    """Validate the logits (``[B, k+1, columns]``, draft ``[B, k, columns]``) and the draft tokens;
    returns ``(B, k)``."""
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3:
        raise ValueError(f"target_logits must be float32 [B, k+1, {columns}]{where}, got "
                         f"{describe(target_logits)}")
    B = target_logits.shape[0]
    k = check_drafts(draft_tokens, B, vocab_size, where)
    check_logits("target_logits", target_logits, (B, k + 1, columns), where)
    check_logits("draft_logits", draft_logits, (B, k, columns), where)
    return B, k
