"""Kernel launches and host reads per decode step, per design: the data the planner prices at
``launch`` and ``sync`` seconds each.

Collectives are counted from the wire scripts; launches and host reads are counted from the code
paths, measured by running them (``tests/host_probe.py``: every ATen operation that does work is
a launch, and so is each compiled pass of :mod:`vocabpar.sampling.fused`; a host read is a read
of a device value or an op whose output size depends on the data, :mod:`vocabpar.host_reads`).
``tests/test_host_work.py`` measures vocabpar's own paths again and fails when a table below no
longer matches the code. Counts are per call, independent of the batch size.

Each design names the sampler it runs (:attr:`vocabpar.plan.Design.sampler`):

* ``"functional"``: :func:`vocabpar.sample` (and :func:`vocabpar.sampling.verify`) on the shards,
  adaptive: its launches and reads depend on the path a call takes. Typical: LLM-like peaked
  rows; worst: the most measured on peaked, flat, Zipf and heavily tied rows.
* ``"engine"``: :class:`vocabpar.sampling.Sampler` on the shards: one fixed script, no host read.
  Its launches are the same whatever the logits (:data:`ENGINE`), its host reads one per step
  (the failure flags).
* ``"dense"``: an engine's own sampler on the full rows a collecting or replicated design holds:
  vLLM's PyTorch-native sampler (``vllm/v1/sample``, ``Sampler.sample`` with
  ``TopKTopPSampler.forward_native``, min-p's ``MinPLogitsProcessor.apply``), counted the same
  way by running its functions at vllm-project/vllm@01fa3fe (top-k/top-p), 3e34265 (sampler),
  bf17660 (min-p), 7f6fc1c (rejection sampler, its Triton kernels interpreted) and a0aaf7f
  (logprobs), outside this repository: vLLM does not install here, so no test re-counts these.
  Its Triton and FlashInfer paths launch fewer kernels; its min-p writes through a boolean mask
  (one host read).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product


@dataclass(frozen=True)
class HostWork:
    """Launches and host reads of a step: typical, and at most ``*_worst``. Host work adds up."""

    launches: int = 0
    reads: int = 0
    launches_worst: int = 0
    reads_worst: int = 0

    def __add__(self, other: HostWork) -> HostWork:
        return HostWork(self.launches + other.launches, self.reads + other.reads,
                        self.launches_worst + other.launches_worst, self.reads_worst + other.reads_worst)


def fixed(launches: int, reads: int) -> HostWork:
    """Host work that does not depend on the data."""
    return HostWork(launches, reads, launches, reads)


@dataclass(frozen=True)
class SamplerKey:
    """The branches that decide a sampler's host work: greedy, or sampled with a top-k that is
    off, within round one's candidates or beyond them (a threshold search), top-p, min-p."""

    greedy: bool
    top_k: str = "none"
    top_p: bool = False
    min_p: bool = False


SAMPLER_KEYS: tuple[SamplerKey, ...] = (SamplerKey(True),) + tuple(
    SamplerKey(False, k, p, m) for k, p, m in product(("none", "candidates", "search"), (False, True),
                                                       (False, True)))


def sampler_key(temperature: float, top_k: int, top_p: float, min_p: float, vocab: int,
                candidates: int) -> SamplerKey:
    """The key of a step's sampling; ``candidates``: round one's candidates per rank."""
    if temperature == 0:
        return SamplerKey(True)
    k = "none" if not 0 < top_k < vocab else "candidates" if top_k <= candidates else "search"
    return SamplerKey(False, k, top_p < 1, min_p > 0)


K = SamplerKey
FUNCTIONAL: dict[SamplerKey, HostWork] = {
    K(True): HostWork(104, 16, 104, 16),
    K(False, "none", False, False): HostWork(248, 34, 248, 34),
    K(False, "none", False, True): HostWork(208, 31, 250, 34),
    K(False, "none", True, False): HostWork(297, 35, 432, 49),
    K(False, "none", True, True): HostWork(297, 35, 432, 49),
    K(False, "candidates", False, False): HostWork(220, 35, 262, 38),
    K(False, "candidates", False, True): HostWork(220, 35, 262, 38),
    K(False, "candidates", True, False): HostWork(300, 39, 435, 53),
    K(False, "candidates", True, True): HostWork(300, 39, 435, 53),
    K(False, "search", False, False): HostWork(450, 55, 520, 57),
    K(False, "search", False, True): HostWork(460, 55, 530, 57),
    K(False, "search", True, False): HostWork(448, 50, 603, 64),
    K(False, "search", True, True): HostWork(448, 50, 603, 64),
}
"""``vocabpar.sample`` on the shards, per key (the busiest rank: one holding padding)."""
FUNCTIONAL_VERIFY: dict[tuple[SamplerKey, bool], HostWork] = {
    (K(True), False): HostWork(140, 20, 140, 20),
    (K(False, "none", False, False), False): HostWork(277, 38, 277, 38),
    (K(False, "none", False, False), True): HostWork(663, 44, 663, 44),
    (K(False, "none", False, True), False): HostWork(245, 35, 287, 38),
    (K(False, "none", False, True), True): HostWork(630, 41, 673, 44),
    (K(False, "none", True, False), False): HostWork(334, 39, 656, 63),
    (K(False, "none", True, False), True): HostWork(719, 45, 1042, 69),
    (K(False, "none", True, True), False): HostWork(334, 39, 656, 63),
    (K(False, "none", True, True), True): HostWork(719, 45, 1042, 69),
    (K(False, "candidates", False, False), False): HostWork(257, 39, 299, 42),
    (K(False, "candidates", False, False), True): HostWork(642, 45, 685, 48),
    (K(False, "candidates", False, True), False): HostWork(257, 39, 299, 42),
    (K(False, "candidates", False, True), True): HostWork(642, 45, 685, 48),
    (K(False, "candidates", True, False), False): HostWork(337, 43, 668, 67),
    (K(False, "candidates", True, False), True): HostWork(722, 49, 1054, 73),
    (K(False, "candidates", True, True), False): HostWork(337, 43, 668, 67),
    (K(False, "candidates", True, True), True): HostWork(722, 49, 1054, 73),
    (K(False, "search", False, False), False): HostWork(487, 59, 558, 61),
    (K(False, "search", False, False), True): HostWork(872, 65, 944, 67),
    (K(False, "search", False, True), False): HostWork(497, 59, 568, 61),
    (K(False, "search", False, True), True): HostWork(882, 65, 954, 67),
    (K(False, "search", True, False), False): HostWork(485, 54, 836, 77),
    (K(False, "search", True, False), True): HostWork(870, 60, 1222, 83),
    (K(False, "search", True, True), False): HostWork(485, 54, 836, 77),
    (K(False, "search", True, True), True): HostWork(870, 60, 1222, 83),
}
"""``vocabpar.sampling.verify`` on the shards, per key and whether draft logits come along (a
greedy row ignores them)."""
SCORE: dict[bool, tuple[int, int, int]] = {False: (92, 7, 1), True: (105, 7, 1)}
"""``token_logprobs`` on one block of shards, without and with top-n lists: ``(launches, more
launches per rank, host reads)`` (merging the gathered records takes a few ops per rank)."""
COLLECT: dict[str, tuple[int, int, int]] = {
    "all_gather": (4, 2, 0), "gather": (4, 2, 0), "all_to_all": (4, 2, 0), "dp_gather_scatter": (7, 2, 4),
    "none": (4, 0, 0), "replicated": (4, 0, 0)}
"""``compute_logits`` per strategy on two or more ranks, the head's GEMM included: ``(launches,
more launches per rank, host reads)``; the ids exchanges launch nothing but their collective.
DP attention reads the exchanged row counts on the host."""
ENGINE: dict[SamplerKey, HostWork] = {
    K(True): fixed(51, 0),
    K(False, "none", False, False): fixed(211, 0), K(False, "none", False, True): fixed(215, 0),
    K(False, "none", True, False): fixed(274, 0), K(False, "none", True, True): fixed(274, 0),
    **{K(False, "candidates", p, m): fixed(215, 0) for p in (False, True) for m in (False, True)},
    K(False, "search", False, False): fixed(261, 0), K(False, "search", False, True): fixed(265, 0),
    K(False, "search", True, False): fixed(324, 0), K(False, "search", True, True): fixed(324, 0),
}
"""``vocabpar.sampling.Sampler.sample`` on the shards, per key: the same launches whatever the
logits (a fixed script of dense passes) and no host read; ``raise_if_failed``, the one read per
step, is priced by the design's caller."""
ENGINE_VERIFY_EXTRA = {(False, True): fixed(55, 0), (False, False): fixed(56, 0),
                       (True, False): fixed(181, 0)}
"""``Sampler.verify`` launches beyond its sampler call on the stacked rows, by (draft logits,
greedy): stacking, acceptance and emission (55, one more when sampled); with draft logits, also
the exact masses and the correction (181). The same whatever the logits; no host read."""
DENSE: dict[SamplerKey, HostWork] = {
    K(True): fixed(2, 0),
    **{K(False, k, p, m): fixed(6 + 6 * (k != "none") + (8 if p and k == "none" else 6 * p) + 5 * m, int(m))
       for k in ("none", "candidates", "search") for p in (False, True) for m in (False, True)},
}
"""An engine's own sampler on full rows (vLLM's PyTorch-native path, BF16 logits in), per key:
greedy is a cast and an argmax; temperature and the draw 6; top-k 6 more, top-p 8 (6 with top-k:
they share the sort); min-p 5 and one host read (its boolean-mask write)."""
DENSE_VERIFY: dict[tuple[bool, bool, bool], HostWork] = {
    (True, False, False): fixed(14, 0), (False, False, False): fixed(34, 0),
    (False, True, False): fixed(49, 0), (False, False, True): fixed(53, 0), (False, True, True): fixed(64, 0)}
"""An engine's rejection sampler on full rows (vLLM's, with its bonus-token sampler), per
(greedy, top-k, top-p); min-p, which it applies to the bonus rows only, adds 5 launches and a
host read."""
DENSE_SCORE: dict[bool, HostWork] = {False: fixed(6, 0), True: fixed(9, 0)}
"""An engine's prompt logprobs on the gathered rows (vLLM's ``compute_logprobs`` and
``gather_logprobs``, one call), without and with top-n lists."""
SAMPLERS = ("functional", "engine", "dense")


def _per_rank(entry: tuple[int, int, int], ranks: int) -> HostWork:
    launches, per_rank, reads = entry
    return fixed(launches + per_rank * ranks, reads)


def collect_work(strategy: str, ranks: int) -> HostWork:
    """Launches and reads of collecting one batch's logits with ``strategy`` (a single rank runs
    its GEMM only)."""
    return _per_rank(COLLECT["none" if ranks == 1 else strategy], ranks)


def sampler_work(sampler: str, key: SamplerKey) -> HostWork:
    """One sampler call of kind ``sampler`` (:data:`SAMPLERS`) on a batch of ``key``'s rows."""
    if sampler == "functional":
        return FUNCTIONAL[key]
    if sampler == "dense":
        return DENSE[key]
    if sampler == "engine":
        return ENGINE[key] + fixed(0, 1)  # the flags read once per step (raise_if_failed)
    raise ValueError(f"unknown sampler {sampler!r}; expected one of {SAMPLERS}")


def verify_work(sampler: str, key: SamplerKey, draft_logits: bool) -> HostWork:
    """One verification of kind ``sampler`` on a batch of ``key``'s rows."""
    if sampler == "functional":
        return FUNCTIONAL_VERIFY[key, draft_logits and not key.greedy]
    if sampler == "engine":
        draft = draft_logits and not key.greedy
        return ENGINE[key] + ENGINE_VERIFY_EXTRA[draft, key.greedy and not draft] + fixed(0, 1)
    if sampler == "dense":
        if key.greedy:
            return DENSE_VERIFY[True, False, False]
        return DENSE_VERIFY[False, key.top_k != "none", key.top_p] + fixed(5 * key.min_p, int(key.min_p))
    raise ValueError(f"no verification host work recorded for sampler {sampler!r}")


def score_work(sampler: str, top_n: int, ranks: int, blocks: int) -> HostWork:
    """Scoring in ``blocks`` calls on shards (``functional``), or once on gathered rows."""
    if sampler == "dense":
        return DENSE_SCORE[top_n > 0]
    one = _per_rank(SCORE[top_n > 0], ranks)
    return fixed(one.launches * blocks, one.reads * blocks)
