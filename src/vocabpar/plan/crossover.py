"""The small-batch crossover, and the choice ``strategy="auto"`` makes from it.

Gathering the logits (``vllm-all-gather``: one all-gather, then an engine's sampler on full rows)
pays bytes that grow with ``B·V``; sampling on shards (``vocabpar-sharded``) pays bytes that grow
with ``B`` only, but more collectives, launches and host reads per step. Below some batch the
fixed costs win and gathering is faster. :func:`crossover` finds that batch for a decode step,
a verification step or prompt scoring: the smallest batch (scored tokens, for scoring) at which
the logits path on shards is at least as fast as the gathering one (typical case); the
difference grows with the batch, so gathering wins at every smaller one. The embedding exchange
and the head's FLOPs are left out: ``auto`` switches only the logits path, whose head is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from vocabpar.plan.cost import STEPS, path_time
from vocabpar.plan.machine import mode
from vocabpar.plan.model import DESIGNS, LATENCY, LAUNCH, LIMITS, SYNC, Design, Sampling, Workload

GATHER, SHARDS = "vllm-all-gather", "vocabpar-sharded"
STRATEGIES = {GATHER: "all_gather", SHARDS: "none"}
"""The two designs compared and the collection strategy each runs."""
BY_NAME = {d.name: d for d in DESIGNS}


def _size(w: Workload, step: str) -> int:
    return w.score_tokens if step == "score" else w.batch


def _at(w: Workload, step: str, size: int) -> Workload:
    return replace(w, score_tokens=size) if step == "score" else replace(w, batch=size)


def shards_win(w: Workload, step: str, gather: Design, shards: Design) -> bool:
    """Whether the logits path on shards is at least as fast as gathering on ``w`` (typical)."""
    return path_time(shards, w, step) <= path_time(gather, w, step)


def crossover(w: Workload, step: str = "decode", gather: str = GATHER, shards: str = SHARDS) -> int | None:
    """The smallest batch (``step="score"``: scored tokens) at which ``shards`` is at least as
    fast as ``gather`` on ``w``'s logits path; gathering wins below it. 1: shards win at every
    batch; ``None``: gathering wins up to the largest batch the planner accepts."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; expected one of {STEPS}")
    if step == "verify" and not w.spec_tokens:
        raise ValueError("the verification crossover needs spec_tokens > 0")
    g, s = BY_NAME[gather], BY_NAME[shards]
    lo, hi = 1, int(LIMITS["batch"][1])
    if shards_win(_at(w, step, lo), step, g, s):
        return 1
    if not shards_win(_at(w, step, hi), step, g, s):
        return None
    while hi - lo > 1:  # gathering wins at lo, shards at hi
        mid = (lo + hi) // 2
        if shards_win(_at(w, step, mid), step, g, s):
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class Crossover:
    """One step's crossover (:func:`crossover`) with both designs' typical logits-path time at
    the workload's own batch (or scored tokens, ``size``)."""

    step: str
    batch: int | None
    size: int
    gather_s: float
    shards_s: float

    @property
    def faster(self) -> str:
        return SHARDS if self.shards_s <= self.gather_s else GATHER


def crossovers(w: Workload) -> list[Crossover]:
    """The crossovers that apply to ``w``: its decode or verification step, and scoring when it
    scores prompt tokens (none on one rank)."""
    if w.ranks == 1:
        return []
    steps = ["verify" if w.spec_tokens else "decode"] + ["score"] * bool(w.score_tokens)
    g, s = BY_NAME[GATHER], BY_NAME[SHARDS]
    return [Crossover(step, crossover(w, step), _size(w, step), path_time(g, w, step), path_time(s, w, step))
            for step in steps]


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

    def __post_init__(self) -> None:
        Workload(1, 1, ranks=1, latency=self.latency, bandwidth=self.bandwidth, launch=self.launch,
                 sync=self.sync)  # the same limits as a workload's

    @classmethod
    def for_mode(cls, name: str, bandwidth: float = 300e9) -> Switch:
        """The prices of execution mode ``name`` (:data:`vocabpar.plan.machine.MODES`)."""
        m = mode(name)
        return cls(m.latency, bandwidth, m.launch, m.sync)

    def workload(self, vocab: int, hidden: int, ranks: int, rows: int, sampling: Sampling, *,
                 pad_to: int = 64, logits_dtype_bytes: int = 4, spec_tokens: int = 0,
                 draft_logits: bool = False) -> Workload:
        """The planner's workload for one step of ``rows`` rows (FP32 logits, as vocabpar's head
        computes them)."""
        return Workload(vocab, hidden, ranks=ranks, batch=rows, pad_to=pad_to,
                        logits_dtype_bytes=logits_dtype_bytes, bandwidth=self.bandwidth, latency=self.latency,
                        launch=self.launch, sync=self.sync,
                        sampling=sampling, spec_tokens=spec_tokens, draft_logits=draft_logits)

    def crossover(self, w: Workload, step: str = "decode") -> int | None:
        """:func:`crossover` of ``w`` at this switch's prices (``w``'s batch ignored), cached."""
        priced = replace(w, latency=self.latency, bandwidth=self.bandwidth, launch=self.launch,
                         sync=self.sync)
        return _cached(_at(priced, step, 1), step)

    def strategy(self, w: Workload, step: str = "decode") -> str:
        """``"all_gather"`` when gathering is faster at ``w``'s batch, else ``"none"``."""
        at = self.crossover(w, step)
        return STRATEGIES[SHARDS if at is not None and _size(w, step) >= at else GATHER]
