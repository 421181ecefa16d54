"""The small-batch crossover, and the choice ``strategy="auto"`` makes from it.

Gathering the logits (``vllm-all-gather``: one all-gather, then an engine's sampler on full rows)
pays bytes that grow with ``B·V``; sampling on shards (``vocabpar-sharded``) pays bytes that grow
with ``B`` only, but more collectives, launches and host reads per step. Below some batch the
fixed costs win and gathering is faster. :func:`crossover` finds that batch for a decode step,
a verification step or prompt scoring: the smallest batch (scored tokens, for scoring) at which
the design on shards is at least as fast as the gathering one (typical case); the difference
grows with the batch (up to the rounding of an all-to-all's row blocks, a few rows), so gathering
wins at every smaller one. By default it compares the logits
path alone (the embedding exchange and the head's FLOPs left out): ``auto`` switches only the
logits path, whose head is the same. The report's :func:`crossovers` compare whole steps, as its
table prices them, between the fastest design on shards and the fastest collecting the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from vocabpar.plan.cost import STEPS, path_time, step_time
from vocabpar.plan.machine import mode
from vocabpar.plan.model import DESIGNS, LATENCY, LAUNCH, LIMITS, SYNC, Design, Workload
from vocabpar.wire.filters import Sampling
from vocabpar.wire.strategies import strategy

GATHER, SHARDS = "vllm-all-gather", "vocabpar-sharded"
STRATEGIES = {GATHER: "all_gather", SHARDS: "none"}
"""The two designs ``strategy="auto"`` compares and the collection strategy each runs."""
BY_NAME = {d.name: d for d in DESIGNS}
ON_SHARDS = tuple(d for d in DESIGNS if strategy(d.strategy).on_shards and not d.single_device)
COLLECTING = tuple(d for d in DESIGNS if not strategy(d.strategy).on_shards and d.strategy != "replicated")
"""The tensor-parallel designs that sample on shards, and those that gather or exchange logits
rows to sample full rows: the two sides of the report's crossovers."""
SEARCHED = (1, int(LIMITS["batch"][1]))
"""The batches (scored tokens, for scoring) :func:`crossover` searches."""


def _size(w: Workload, step: str) -> int:
    return w.score_tokens if step == "score" else w.batch


def _at(w: Workload, step: str, size: int) -> Workload:
    return replace(w, score_tokens=size) if step == "score" else replace(w, batch=size)


def shards_win(w: Workload, step: str, gather: Design, shards: Design, whole: bool = False) -> bool:
    """Whether ``shards`` is at least as fast as ``gather`` on ``w`` (typical): the logits path,
    or with ``whole`` the step as the report's table prices it (:func:`step_time`)."""
    timed = step_time if whole else path_time
    return timed(shards, w, step) <= timed(gather, w, step)


def crossover(w: Workload, step: str = "decode", gather: str = GATHER, shards: str = SHARDS, *,
              whole: bool = False) -> int | None:
    """The smallest batch (``step="score"``: scored tokens) at which ``shards`` is at least as
    fast as ``gather`` on ``w``'s logits path (``whole``: on the whole step, :func:`step_time`);
    gathering wins below it. 1: shards win at every batch; ``None``: gathering wins at every
    batch of :data:`SEARCHED`, up to the largest the planner accepts."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; expected one of {STEPS}")
    if step == "verify" and not w.spec_tokens:
        raise ValueError("the verification crossover needs spec_tokens > 0")
    g, s = BY_NAME[gather], BY_NAME[shards]
    lo, hi = SEARCHED
    if shards_win(_at(w, step, lo), step, g, s, whole):
        return 1
    if not shards_win(_at(w, step, hi), step, g, s, whole):
        return None
    while hi - lo > 1:  # gathering wins at lo, shards at hi
        mid = (lo + hi) // 2
        if shards_win(_at(w, step, mid), step, g, s, whole):
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class Crossover:
    """One step's crossover (:func:`crossover`, ``whole``) between ``shards``, the fastest design
    sampling on shards (:data:`ON_SHARDS`), and ``gather``, the fastest collecting the logits
    (:data:`COLLECTING`), both picked at the workload's own batch (or scored tokens, ``size``),
    with their typical seconds there (:func:`step_time`: the whole step, or scoring's logits
    path)."""

    step: str
    batch: int | None
    size: int
    gather: str
    shards: str
    gather_s: float
    shards_s: float


def crossovers(w: Workload) -> list[Crossover]:
    """The crossovers that apply to ``w``: its decode or verification step, and scoring when it
    scores prompt tokens (none on one rank)."""
    if w.ranks == 1:
        return []
    out = []
    for step in ["verify" if w.spec_tokens else "decode"] + ["score"] * bool(w.score_tokens):
        timed = {d.name: step_time(d, w, step) for d in ON_SHARDS + COLLECTING}
        s, g = (min(side, key=lambda d: timed[d.name]).name for side in (ON_SHARDS, COLLECTING))
        out.append(Crossover(step, crossover(w, step, g, s, whole=True), _size(w, step), g, s, timed[g],
                             timed[s]))
    return out


@lru_cache(maxsize=256)
def _cached(w: Workload, step: str) -> int | None:
    return crossover(w, step)


@dataclass(frozen=True)
class Switch:
    """How ``strategy="auto"`` prices a step: seconds per collective, per kernel launch and per
    host read, and the link's bytes/s. Its choice depends only on these, the model's shape, the
    batch size and the sampling parameters, which every rank agrees on: every rank picks the same
    strategy without a collective."""

    latency: float = LATENCY
    bandwidth: float = 300e9
    launch: float = LAUNCH
    sync: float = SYNC
    compiled: bool = False
    """The engine Sampler's calls run compiled whole (:attr:`vocabpar.plan.Workload.compiled`)."""

    def __post_init__(self) -> None:
        Workload(1, 1, ranks=1, latency=self.latency, bandwidth=self.bandwidth, launch=self.launch,
                 sync=self.sync)  # the same limits as a workload's

    @classmethod
    def for_mode(cls, name: str, bandwidth: float = 300e9) -> Switch:
        """The prices of execution mode ``name`` (:data:`vocabpar.plan.machine.MODES`)."""
        m = mode(name)
        return cls(m.latency, bandwidth, m.launch, m.sync, m.compiled)

    def workload(self, vocab: int, hidden: int, ranks: int, rows: int, sampling: Sampling, *,
                 pad_to: int = 64, logits_dtype_bytes: int = 4, spec_tokens: int = 0,
                 draft_logits: bool = False) -> Workload:
        """The planner's workload for one step of ``rows`` rows (FP32 logits, as vocabpar's head
        computes them)."""
        return Workload(vocab, hidden, ranks=ranks, batch=rows, pad_to=pad_to,
                        logits_dtype_bytes=logits_dtype_bytes, bandwidth=self.bandwidth, latency=self.latency,
                        launch=self.launch, sync=self.sync, compiled=self.compiled,
                        sampling=sampling, spec_tokens=spec_tokens, draft_logits=draft_logits)

    def crossover(self, w: Workload, step: str = "decode") -> int | None:
        """:func:`crossover` of ``w`` at this switch's prices (``w``'s batch ignored), cached."""
        priced = replace(w, latency=self.latency, bandwidth=self.bandwidth, launch=self.launch,
                         sync=self.sync, compiled=self.compiled)
        return _cached(_at(priced, step, 1), step)

    def strategy(self, w: Workload, step: str = "decode") -> str:
        """``"all_gather"`` when gathering is faster at ``w``'s batch, else ``"none"``."""
        at = self.crossover(w, step)
        return STRATEGIES[SHARDS if at is not None and _size(w, step) >= at else GATHER]
