"""Kernel launches and host reads per decode step, per design: the data the planner prices at
``launch`` and ``sync`` seconds each.

Collectives are counted from the wire scripts. Launches and host reads of vocabpar's own code paths
are measured by running them and stored as data, ``host_work.json`` beside this module (:data:`DATA`),
which ``scripts/count_launches.py`` writes: every ATen operation that does work is a launch, and so
is each compiled pass of :mod:`vocabpar.kernels.fused`; a host read is a read of a device value or
an op whose output size depends on the data (:mod:`vocabpar.host_reads`). The file's header names
the torch version, the command and the date of the count. ``tests/test_host_work.py`` re-counts a
sample of the entries and fails when the file no longer matches the code. Counts are per call,
independent of the batch size.

Each design names the sampler it runs (:attr:`vocabpar.plan.Design.sampler`):

* ``"functional"``: :func:`vocabpar.sample` (and :func:`vocabpar.sampling.verify`) on the shards,
  adaptive: its launches and reads depend on the path a call takes. Typical: LLM-like peaked
  rows; worst: the most measured on peaked, flat, Zipf and heavily tied rows (the busiest rank).
* ``"engine"``: :class:`vocabpar.sampling.Sampler` on the shards: one fixed script, no host read.
  Its launches are (almost) the same whatever the logits; its failure flags ride in the step's
  copy of sampled ids (:data:`IDS_TO_HOST`), so it reads nothing of its own. In a mode that runs
  it compiled whole (graph mode), its launches are the kernels of the compiled program.
* ``"dense"``: an engine's own sampler on the full rows a collecting or replicated design holds:
  vLLM's PyTorch-native sampler (``vllm/v1/sample``, ``Sampler.sample`` with
  ``TopKTopPSampler.forward_native``, min-p's ``MinPLogitsProcessor.apply``), counted the same
  way by running its functions at vllm-project/vllm@01fa3fe (top-k/top-p), 3e34265 (sampler),
  bf17660 (min-p), 7f6fc1c (rejection sampler, its Triton kernels interpreted) and a0aaf7f
  (logprobs), outside this repository: vLLM does not install here, so these are the one set of
  tables typed by hand (:data:`DENSE_FILTERS`, :data:`DENSE_VERIFY`, :data:`DENSE_SCORE`) and no script
  or test re-counts them. Its Triton and FlashInfer paths launch fewer kernels; its min-p writes
  through a boolean mask (one host read).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from vocabpar.wire.filters import FILTERS, states

DATA = Path(__file__).with_name("host_work.json")
"""The measured tables: ``{"header": {...}, table: {entry: [numbers]}}``, written by
``scripts/count_launches.py``."""
REGENERATE = "python scripts/count_launches.py"
"""The command that (re)writes :data:`DATA` from a checkout of the repository."""


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


def verify_name(key: str, draft_logits: bool) -> str:
    """A verification's entry name: its sampling key's (:meth:`vocabpar.wire.filters.Sampling.key`),
    and ``+draft_logits`` when the drafts' logits come along (a greedy row ignores them)."""
    return key + "+draft_logits" * (draft_logits and key != "greedy")


def score_name(top_n: int) -> str:
    """A scoring call's entry name: ``logprobs``, or ``logprobs+top_n`` with top-n lists."""
    return "logprobs" + "+top_n" * (top_n > 0)


MEASURED: dict[str, str] = {
    "functional": "vocabpar.sample on the shards, per key: [launches, reads, launches_worst, reads_worst]",
    "functional_verify": "vocabpar.sampling.verify on the shards, per key (+draft_logits: with the "
                         "drafts' logits): [launches, reads, launches_worst, reads_worst]",
    "engine": "vocabpar.sampling.Sampler.sample on the shards, per key: [launches, reads, launches_worst, "
              "reads_worst]",
    "engine_verify": "vocabpar.sampling.Sampler.verify on the shards, per key (+draft_logits as above): "
                     "[launches, reads, launches_worst, reads_worst]",
    "engine_graph": "vocabpar.sampling.Sampler.sample compiled whole (torch.compile fullgraph, Inductor), "
                    "per key: [kernels]",
    "engine_graph_verify": "vocabpar.sampling.Sampler.verify compiled whole, per key (+draft_logits as "
                           "above): [kernels]",
    "engine_graph_score": "the engine Sampler compiled whole: greedy sample with top-5 logprobs "
                          "(sample+logprobs), token_logprobs with top 5 (token_logprobs+top_n): [kernels]",
    "score": "token_logprobs on one block of shards: [launches, more launches per rank, reads]",
    "collect": "compute_logits per strategy on two or more ranks, the head's GEMM included: [launches, "
               "more launches per rank, reads]",
}
"""The measured tables of :data:`DATA` and what each entry holds. Sampler tables: the busiest rank
on peaked rows (typical) and the most on any family (worst); the compiled program is the same for
any logits (its kernels counted from the program Inductor generates on two ranks: generated kernels
plus the ATen operations left in it, collectives apart). ``score`` and ``collect`` grow by a
few launches per rank (merging the gathered records); the ids exchanges launch nothing but their
collective; DP attention reads the exchanged row counts on the host."""


@lru_cache(maxsize=4)
def load(path: Path) -> dict[str, Any]:
    """The tables stored at ``path`` (read once per path)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no measured host work at {path}: write it with `{REGENERATE}`") from None
    missing = [t for t in ("header", *MEASURED) if not isinstance(data.get(t), dict)]
    if missing:
        raise ValueError(f"{path} lacks the table(s) {', '.join(missing)}: rewrite it with `{REGENERATE}`")
    return data


def entry(table: str, name: str) -> list[int]:
    """The numbers :data:`DATA` holds for ``name`` in ``table`` (:data:`MEASURED`)."""
    numbers = load(DATA)[table].get(name)
    if numbers is None:
        raise LookupError(f"{DATA.name} has no {table!r} entry {name!r}: re-count with `{REGENERATE}`")
    return numbers


DENSE_FILTERS = {f.name: fixed(*f.dense_price) for f in FILTERS}
"""Typed by hand, counted outside this repository (see above): what an engine's own sampler on
full rows (vLLM's PyTorch-native path, BF16 logits in) spends on each filter on top of
temperature and the draw (6 launches), as :data:`vocabpar.wire.filters.FILTERS` states it. A
greedy step is a cast and an argmax (2)."""
DENSE_VERIFY: dict[tuple[bool, bool, bool], HostWork] = {
    (True, False, False): fixed(14, 0), (False, False, False): fixed(34, 0),
    (False, True, False): fixed(49, 0), (False, False, True): fixed(53, 0), (False, True, True): fixed(64, 0)}
"""Typed by hand, counted outside this repository: an engine's rejection sampler on full rows
(vLLM's, with its bonus-token sampler), per (greedy, top-k, top-p); every other filter, which
applies to the bonus rows only, adds what :data:`DENSE_FILTERS` says."""
DENSE_SCORE: dict[bool, HostWork] = {False: fixed(6, 0), True: fixed(9, 0)}
"""Typed by hand, counted outside this repository: an engine's prompt logprobs on the gathered rows
(vLLM's ``compute_logprobs`` and ``gather_logprobs``, one call), without and with top-n lists."""
SAMPLERS = ("functional", "engine", "dense")
IDS_TO_HOST = fixed(0, 1)
"""Every design copies a step's sampled (or accepted) ids to the host once, to continue: one host
read, whatever the sampler. The engine Sampler's status word rides in that same copy."""


def _per_rank(table: str, name: str, ranks: int) -> HostWork:
    launches, per_rank, reads = entry(table, name)
    return fixed(launches + per_rank * ranks, reads)


def collect_work(strategy: str, ranks: int) -> HostWork:
    """Launches and reads of collecting one batch's logits with ``strategy`` (a single rank runs
    its GEMM only)."""
    return _per_rank("collect", "none" if ranks == 1 else strategy, ranks)


def dense_work(key: str) -> HostWork:
    """An engine's own sampler on full rows for a step of entry ``key``."""
    if key == "greedy":
        return fixed(2, 0)
    on = states(key)
    work = fixed(6 + 2 * ("top_p" in on and "top_k" not in on), 0)
    return sum((DENSE_FILTERS[name] for name in on), work)


def sampler_work(sampler: str, key: str, compiled: bool = False) -> HostWork:
    """One sampler call of kind ``sampler`` (:data:`SAMPLERS`) on a batch of ``key``'s rows (the
    copy of its ids to the host apart: :data:`IDS_TO_HOST`); ``compiled``: the engine Sampler's
    call runs compiled whole, its launches the compiled program's kernels."""
    if sampler == "dense":
        return dense_work(key)
    if sampler == "engine" and compiled:
        return fixed(entry("engine_graph", key)[0], 0)
    if sampler in ("functional", "engine"):
        return HostWork(*entry(sampler, key))
    raise ValueError(f"unknown sampler {sampler!r}; expected one of {SAMPLERS}")


def verify_work(sampler: str, key: str, draft_logits: bool, compiled: bool = False) -> HostWork:
    """One verification of kind ``sampler`` on a batch of ``key``'s rows (``compiled`` as in
    :func:`sampler_work`)."""
    if sampler == "engine" and compiled:
        return fixed(entry("engine_graph_verify", verify_name(key, draft_logits))[0], 0)
    if sampler in ("functional", "engine"):
        return HostWork(*entry(f"{sampler}_verify", verify_name(key, draft_logits)))
    if sampler == "dense":
        if key == "greedy":
            return DENSE_VERIFY[True, False, False]
        on = states(key)
        return sum((DENSE_FILTERS[name] for name in on if name not in ("top_k", "top_p")),
                   DENSE_VERIFY[False, "top_k" in on, "top_p" in on])
    raise ValueError(f"no verification host work recorded for sampler {sampler!r}")


def score_work(sampler: str, top_n: int, ranks: int, blocks: int) -> HostWork:
    """Scoring in ``blocks`` calls on shards (``functional``), or once on gathered rows."""
    if sampler == "dense":
        return DENSE_SCORE[top_n > 0]
    one = _per_rank("score", score_name(top_n), ranks)
    return fixed(one.launches * blocks, one.reads * blocks)
