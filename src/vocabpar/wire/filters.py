"""The sampling filters, each stated once: the request parameter and the rule its values keep,
the value that turns it off, the range the planner accepts, the round-one candidates it needs,
the words a mask filter adds to round one, the floor a filter keeps from each row's max, what
an engine's sampler on full rows spends on it, and the states a step that uses it takes in the
measured host-work tables.

The planner's summary of a step's sampling (:class:`Sampling`, one field per filter), the names
of its host-work entries (:meth:`Sampling.key`, :func:`keys`), the command line's flags, the
engines' batch summaries, the samplers' round-one sizes and records, the dense sampler's price
and the per-row checks of :class:`vocabpar.SamplingParams` read :data:`FILTERS`; a filter added
here (with its field in :class:`Sampling`) reaches all of them. The samplers compute each filter
in :mod:`vocabpar.sampling` (a mask filter: its module, listed in
:data:`vocabpar.sampling.masks.MASKS`), and :mod:`vocabpar.wire.scripts` states what each sends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product

import torch

MAX_CANDIDATES = 256
"""top-k beyond this uses the threshold search."""
TOP_P_CANDIDATES = 512
"""Round-one candidates over all ranks when a row has top-p: certifies peaked (LLM-like) rows,
which keep ~100-350 tokens."""
MIN_P_CANDIDATES = 16
TEMPERATURE = (0.0, 1e6)
"""The planner's range of a step's temperature (0: greedy)."""


@dataclass(frozen=True)
class Filter:
    """One filter. ``name``: its field in :class:`vocabpar.SamplingParams` and the planner's
    keyword; ``label``: in text; ``off``: the value that turns it off; ``limits``: what the planner
    accepts; ``kind``: ``int`` or ``float``; ``need``: the round-one candidates per rank a batch
    needs on ``ranks`` ranks, given the values of the sampled rows it is on in (0: none);
    ``rule``: what a request's per-row value must satisfy (NaN fails it) and how the error says
    so; ``examples``: a value standing for each state a step may take with it on (``"on"``, or
    top-k's ``"candidates"``, settled by round one, and ``"search"``, beyond it); ``strictest``:
    the costliest of several rows' values (the largest, or for top-p the smallest);
    ``counts_tokens``: the value is a number of tokens (top-k); ``dense_price``: the kernel launches
    and host reads an engine's own sampler on full rows spends on it beyond temperature and the
    draw (every filter states one);
    ``words``: a mask filter's int64 words per row in round one (the exact sums its floor needs;
    0: its threshold comes from the candidates); ``keeps_only_sent``: on peaked rows the mask
    typically keeps only tokens round one sent, where it sends more than one per rank;
    ``z_floor``: a floor on the tempered logits ``z`` from each row's largest ``z_max`` and its
    value (-inf where off): the filter keeps ``z >= z_floor(z_max, value)``, and the floors of
    every such filter are one bound that every step keeps."""

    name: str
    label: str
    off: float
    limits: tuple[float, float]
    kind: type
    need: Callable[[Sequence[float], int], int]
    rule: tuple[Callable[[torch.Tensor], torch.Tensor], str]
    examples: dict[str, float] = field(default_factory=dict)
    dense_price: tuple[int, int] | None = None
    strictest: Callable[[Iterable[float]], float] = max
    counts_tokens: bool = False
    words: int = 0
    keeps_only_sent: bool = False
    z_floor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.dense_price is None:
            raise ValueError(f"filter {self.name}: state its dense_price (a sampler on full rows' work)")

    def on(self, value: float, vocab: int) -> bool:
        """Whether ``value`` filters anything on a vocabulary of ``vocab`` tokens (a count of
        tokens, as top-k's, filters nothing from the whole vocabulary on)."""
        return value != self.off and not (self.counts_tokens and value >= vocab)

    def state(self, value: float, vocab: int, candidates: int) -> str | None:
        """The state a step with ``value`` takes when round one sends ``candidates`` per rank
        (``None``: off): a count of tokens is settled by the candidates when within them, else
        searched; any other filter is ``"on"``."""
        if not self.on(value, vocab):
            return None
        if self.counts_tokens:
            return "candidates" if value <= candidates else "search"
        return "on"


FILTERS: tuple[Filter, ...] = (
    Filter("top_k", "top-k", 0, (0, 2**31), int,
           lambda ks, ranks: max((k for k in ks if k <= MAX_CANDIDATES), default=0),
           (lambda k: k >= -1, "must be >= -1 (0 and -1 are off)"), {"candidates": 50, "search": 1000},
           dense_price=(6, 0), counts_tokens=True),
    Filter("top_p", "top-p", 1.0, (1e-9, 1.0), float,
           lambda ps, ranks: -(-TOP_P_CANDIDATES // ranks) if ps else 0,
           (lambda p: (p > 0) & (p <= 1), "must be in (0, 1]"), {"on": 0.9}, dense_price=(6, 0),
           strictest=min),
    Filter("min_p", "min-p", 0.0, (0.0, 1.0), float,
           lambda ms, ranks: MIN_P_CANDIDATES if ms else 0,
           (lambda p: (p >= 0) & (p <= 1), "must be in [0, 1]"), {"on": 0.05}, dense_price=(5, 1),
           z_floor=lambda z_max, p: z_max + torch.log(p)),  # p >= min_p * p_max
    Filter("top_n_sigma", "top-n-sigma", 0.0, (0.0, 1e6), float, lambda ns, ranks: 0,
           (lambda n: (n >= 0) & n.isfinite(), "must be finite and >= 0 (0 or None: off)"), {"on": 1.0},
           dense_price=(4, 0), words=5, keeps_only_sent=True),
)
"""Every filter a sampled row may ask for, in the order the planner names them. The dense prices
are typed by hand, counted outside this repository on vLLM's PyTorch-native sampler (BF16 logits
in): top-k 6 launches, top-p 6 (8 without top-k: they share the sort), min-p 5 and a host read
(its boolean-mask write). vLLM has no top-n-sigma: its price is the four full-row passes
llama.cpp's makes (the max, the mean, the variance, the mask), an estimate. Top-n-sigma is a mask:
five words of exact sums (count, sum, the sum of squares in three words) ride in round one, and
its floor, a few sigma below the max, keeps few tokens on peaked rows."""
BY_NAME = {f.name: f for f in FILTERS}
MASK_NAMES = tuple(f.name for f in FILTERS if f.words)
"""The mask filters, in the order they are applied (each to the logits before any mask)."""
Z_FLOORS = tuple(f for f in FILTERS if f.z_floor is not None)
"""The filters that keep a floor on the tempered logits from each row's max (min-p)."""


def candidate_count(ranks: int, widest: int, values: Mapping[str, Sequence[float]]) -> int:
    """Round-one candidates per rank and sampled row: enough for every filter's need given the
    sampled rows' ``values`` (per filter name; a filter left out is off; a row has a filter on
    where its value is positive and not the filter's off value, so top-k's -1 is off), at most
    ``widest`` (the most real tokens one rank holds)."""
    return int(min(max([1] + [f.need(_on_rows(f, values), ranks) for f in FILTERS]), widest))


def masks_on(values: Mapping[str, Sequence[float]]) -> tuple[str, ...]:
    """The mask filters whose sums ride in round one: those on (positive, not off) in some row of
    ``values`` (per filter name, the sampled rows' values; a filter left out is off)."""
    return tuple(name for name in MASK_NAMES if _on_rows(BY_NAME[name], values))


def _on_rows(f: Filter, values: Mapping[str, Sequence[float]]) -> list[float]:
    """``f``'s values in the rows it is on in (positive and not off, so top-k's -1 is off)."""
    return [v for v in values.get(f.name, ()) if v > 0 and v != f.off]


@dataclass(frozen=True)
class Sampling:
    """A decode step's sampling, the same for every row: ``temperature`` 0 is greedy (the filters
    then do nothing); one field per filter of :data:`FILTERS`, in its order, each off at the
    filter's ``off`` value and within its ``limits``. ``Sampling(0.8, top_p=0.9)``."""

    temperature: float = 0.0
    top_k: int = BY_NAME["top_k"].off
    top_p: float = BY_NAME["top_p"].off
    min_p: float = BY_NAME["min_p"].off
    top_n_sigma: float = BY_NAME["top_n_sigma"].off

    def __post_init__(self) -> None:
        for name, limits in (("temperature", TEMPERATURE), *((f.name, f.limits) for f in FILTERS)):
            check_range(name, getattr(self, name), limits)
        for f in FILTERS:
            if f.kind is int and getattr(self, f.name) != int(getattr(self, f.name)):
                raise ValueError(f"{f.name} must be an integer, got {getattr(self, f.name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def values(self) -> dict[str, list[float]]:
        """Each filter's value, as the one-row lists :func:`candidate_count` and the scripts read."""
        return {f.name: [getattr(self, f.name)] for f in FILTERS}

    def candidates(self, ranks: int, widest: int) -> int:
        """Round-one candidates per rank on ``ranks`` ranks whose widest shard holds ``widest``."""
        return 0 if self.greedy else candidate_count(ranks, widest, self.values())

    def masks(self) -> tuple[str, ...]:
        """The mask filters on in this step (none when greedy)."""
        return () if self.greedy else masks_on(self.values())

    def key(self, vocab: int, candidates: int) -> str:
        """The name of this step's entries in the host-work tables: ``greedy``, or the states of
        the filters on joined by ``+`` (``temperature`` alone when none is)."""
        if self.greedy:
            return "greedy"
        return name_of({f.name: f.state(getattr(self, f.name), vocab, candidates) for f in FILTERS})

    def describe(self) -> str:
        """``"greedy"`` or the parameters in use, e.g. ``"temperature 0.8, top-p 0.9"``."""
        if self.greedy:
            return "greedy"
        return ", ".join([f"temperature {self.temperature:g}"] + [
            f"{f.label} {getattr(self, f.name):g}" for f in FILTERS if getattr(self, f.name) != f.off])


def name_of(states: dict[str, str | None]) -> str:
    """A sampled step's entry name from each filter's state (``None``: off)."""
    parts = [name if state == "on" else f"{name}={state}" for name, state in states.items() if state]
    return "+".join(parts) or "temperature"


def keys() -> tuple[str, ...]:
    """Every entry name a step may take: greedy, then each combination of the filters' states."""
    choices = [(None, *f.examples) for f in FILTERS]
    return ("greedy",) + tuple(name_of(dict(zip(BY_NAME, states))) for states in product(*choices))


def states(key: str) -> dict[str, str]:
    """The filters on in entry ``key`` and their states (``{}`` for greedy and temperature alone)."""
    if key in ("greedy", "temperature"):
        return {}
    pairs = (part.partition("=") for part in key.split("+"))
    found = {name: state or "on" for name, _, state in pairs}
    unknown = [name for name in found if name not in BY_NAME or found[name] not in BY_NAME[name].examples]
    if unknown or name_of({name: found.get(name) for name in BY_NAME}) != key:
        raise ValueError(f"{key!r} is no entry name (unknown: {unknown}); known: {', '.join(keys())}")
    return found


def example(key: str) -> Sampling:
    """A step's sampling that takes ``key``'s states (temperature 1 unless greedy), from each
    filter's example values: what the launch counts are measured on."""
    if key == "greedy":
        return Sampling()
    return Sampling(1.0, **{name: BY_NAME[name].examples[state] for name, state in states(key).items()})


def strictest(columns: Mapping[str, Sequence[float]]) -> Sampling:
    """The planner's view of a batch's sampled rows (per filter, every sampled row's value, top-k
    0 where off): each filter's value that takes the costliest branch -- the largest top-k, min-p
    and top-n-sigma, the smallest top-p -- brought within the planner's range (a top-n-sigma of
    1e9 is on, as 1e6 is); greedy when there is no sampled row."""
    if not any(len(column) for column in columns.values()):
        return Sampling()
    def within(f: Filter, value: float) -> float:
        low, high = f.limits
        return f.kind(min(max(value, low), high))
    return Sampling(1.0, **{f.name: within(f, f.strictest(columns[f.name])) for f in FILTERS})


def check_range(name: str, value: float, limits: tuple[float, float]) -> None:
    """Raise ``ValueError`` unless ``value`` lies in ``limits`` (NaN never does)."""
    low, high = limits
    if not low <= value <= high:
        span = ", ".join(str(x) if isinstance(x, int) else f"{x:g}" for x in (low, high))
        raise ValueError(f"{name} must be in [{span}], got {value!r}")
