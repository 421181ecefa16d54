"""Each design priced on a workload: memory, bytes, collectives, launches, host reads, time.

The step a workload runs is a decode step, or with ``spec_tokens`` a verification step (the
target model fed the last token and the drafts, its ``B·(K+1)`` rows verified; the draft model's
own decoding left out). Its time is ``collectives·latency + bytes/bandwidth + launches·launch +
host_reads·sync + head``, the head the longer of its FLOPs/flops and of reading its matrix at the
memory bandwidth, typical and worst; the recommendation, the winner map and
the crossover read the typical case. Traffic comes from :mod:`vocabpar.plan.model` (the wire's
scripts), launches and host reads from :mod:`vocabpar.plan.host` (measured code paths), plus the
one copy of a step's sampled ids to the host that every design makes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vocabpar.plan import host
from vocabpar.plan.host import HostWork
from vocabpar.plan.model import (
    DESIGNS,
    Design,
    Workload,
    busiest_owner,
    embedding_exchange_bytes,
    head_flops,
    head_time,
    hidden_gather_bytes,
    kv_tokens,
    logits_buffer_bytes,
    logits_traffic,
    score_bytes,
    shard_rows,
    step_traffic,
    transfer_time,
    verify_step_traffic,
    verify_traffic,
    weight_bytes,
)
from vocabpar.wire.scripts import price, score_blocks, score_script
from vocabpar.wire.strategies import strategy
from vocabpar.wire.traffic import Traffic, exact

STEPS = ("decode", "verify", "score")
"""What a step does with its logits: sample, verify drafts, or score prompt tokens."""


@dataclass(frozen=True)
class DesignCost:
    """Per-rank cost of one design (busiest rank; bytes, FLOPs, seconds, tokens).

    ``embedding_bytes``/``embedding_time_s``: one forward of ``tokens`` tokens. ``step``: what the
    workload's step is (``decode``, or ``verify`` with drafts). ``step_bytes``/``collectives``/
    ``launches``/``host_reads``: one such step -- embedding of its ids, hidden gather, logits
    collection or sampling on shards, verification -- in the typical case, the ``*_worst``
    fields at most; ``step_time_s = collectives·latency + step_bytes/bandwidth +
    launches·launch + host_reads·sync + head_time_s`` (``step_time_worst_s`` likewise).
    ``collection_bytes``: a decode step's logits path. ``verify_*``: the logits path of
    verifying ``spec_tokens`` drafts per row (typical case); ``score_bytes``,
    ``score_peak_bytes``: scoring ``score_tokens`` prompt tokens. ``extra_memory_bytes``: weights
    + logits above the leanest design; ``kv_tokens`` what that memory would hold as KV cache
    (``None`` when the workload's KV bytes per token are unknown). ``applies``: whether the design
    runs on the workload's rank count (a one-device design such as llama.cpp only on one rank);
    priced either way."""

    name: str
    engine: str
    summary: str
    ranks: int
    sampler: str
    step: str
    weight_bytes: int
    logits_buffer_bytes: int
    memory_bytes: int
    embedding_bytes: int
    embedding_time_s: float
    hidden_gather_bytes: int
    collection_bytes: int
    step_bytes: int
    step_bytes_worst: int
    head_flops: int
    head_time_s: float
    step_time_s: float
    step_time_worst_s: float
    collectives: int
    collectives_worst: int
    launches: int
    launches_worst: int
    host_reads: int
    host_reads_worst: int
    verify_bytes: int
    verify_collectives: int
    score_bytes: int
    score_peak_bytes: int
    extra_memory_bytes: int = 0
    kv_tokens: int | None = 0
    applies: bool = True


def sampler_key(w: Workload, ranks: int, widest: int) -> str:
    """The entry name of ``w``'s sampling in the host-work tables, with round one's candidates on
    ``ranks`` ranks whose widest shard holds ``widest`` real tokens."""
    return w.sampling.key(w.vocab, w.sampling.candidates(ranks, widest))


def host_work(design: Design, w: Workload, step: str) -> HostWork:
    """Launches and host reads of ``design``'s logits path in one ``step`` (:data:`STEPS`) of
    ``w``: computing and collecting the logits, then sampling, verifying or scoring them (the
    engine Sampler's call compiled whole where ``w.compiled``); a decode or verification step
    also copies its ids to the host (:data:`host.IDS_TO_HOST`)."""
    n = 1 if design.single_device else w.ranks
    widest = min(shard_rows(w.vocab, n, design.scheme, w.pad_to), w.vocab)
    key = sampler_key(w, n, widest)
    collect = host.collect_work(design.strategy, n)
    if step == "decode":
        return collect + host.sampler_work(design.sampler, key, w.compiled) + host.IDS_TO_HOST
    if step == "verify":
        return collect + host.verify_work(design.sampler, key, w.draft_logits, w.compiled) + host.IDS_TO_HOST
    blocks = len(score_blocks(w.score_tokens)) if strategy(design.strategy).on_shards else 1
    per_block = HostWork(*(blocks * x for x in (collect.launches, collect.reads, collect.launches_worst,
                                                 collect.reads_worst)))
    return per_block + host.score_work(design.sampler, w.score_top_n, n, blocks)


def score_traffic(design: Design, w: Workload) -> Traffic:
    """Scoring ``w.score_tokens`` prompt tokens: collecting designs gather the ``[T, V]`` logits
    at once; on shards ``token_logprobs`` runs per block of ``SCORE_ROWS`` rows."""
    n = 1 if design.single_device else w.ranks
    if n == 1 or not w.score_tokens:
        return Traffic()
    if not strategy(design.strategy).on_shards:
        received, _ = score_bytes(design.strategy, w, n, design.scheme)
        return exact(strategy(design.strategy).collectives, received)
    blocks = score_blocks(w.score_tokens)
    return sum((price(score_script(rows, w.score_top_n), n) for rows in blocks), Traffic())


def path_traffic(design: Design, w: Workload, step: str) -> Traffic:
    """The logits path's traffic in one ``step``: collection and sampling, verification, or
    scoring (the embedding and DP hidden gather apart)."""
    n = 1 if design.single_device else w.ranks
    if n == 1:
        return Traffic()
    if step == "decode":
        return logits_traffic(design.strategy, w.batch, w, n, design.scheme, design.sampler)
    if step == "verify":
        return verify_traffic(design.strategy, w, n, design.scheme, design.sampler)
    return score_traffic(design, w)


def seconds(w: Workload, t: Traffic, work: HostWork, worst: bool = False) -> float:
    """The fixed costs and transfer time of ``t`` and ``work`` at ``w``'s prices."""
    if worst:
        return (t.collectives_worst * w.latency + transfer_time(t.bytes_worst, w.bandwidth)
                + work.launches_worst * w.launch + work.reads_worst * w.sync)
    return t.collectives * w.latency + transfer_time(t.bytes, w.bandwidth) + work.launches * w.launch \
        + work.reads * w.sync


def path_time(design: Design, w: Workload, step: str) -> float:
    """Typical seconds of ``design``'s logits path in one ``step`` of ``w`` (the head's FLOPs,
    the same for a gathering and a sharded design, left out)."""
    return seconds(w, path_traffic(design, w, step), host_work(design, w, step))


def design_cost(design: Design, w: Workload) -> DesignCost:
    """Price ``design`` on workload ``w`` (``extra_memory_bytes``/``kv_tokens`` left at 0; see
    :func:`plan`)."""
    n = 1 if design.single_device else w.ranks
    dp = 1 if design.single_device else w.dp
    s = strategy(design.strategy)
    cols = shard_rows(w.vocab, n, design.scheme, w.pad_to)
    matrices = 1 if design.single_device else w.matrices
    weights = weight_bytes(cols, w.hidden, w.weight_dtype_bytes, matrices)
    logits = logits_buffer_bytes(design.strategy, w.batch, w.vocab, n, w.logits_dtype_bytes,
                                 scheme=design.scheme, pad_to=w.pad_to, dp=dp)
    embedding = embedding_exchange_bytes(design.embedding, w.tokens, w.hidden, n, w.weight_dtype_bytes,
                                         owned=busiest_owner(w.tokens, n, w.skew))
    hidden = 0 if design.scheme == "replicated" else hidden_gather_bytes(w.batch, dp, w.hidden,
                                                                         w.weight_dtype_bytes)
    step = "verify" if w.spec_tokens else "decode"
    traffic = verify_step_traffic(design, w) if w.spec_tokens else step_traffic(design, w)
    work = host_work(design, w, step)
    collection = logits_traffic(design.strategy, w.batch, w, n, design.scheme, design.sampler).bytes
    verify = verify_traffic(design.strategy, w, n, design.scheme, design.sampler)
    scored, score_peak = score_bytes(design.strategy, w, n, design.scheme)
    flops = head_flops(s.local_rows(w.batch * (w.spec_tokens + 1), dp), cols, w.hidden)
    head = head_time(flops, weight_bytes(cols, w.hidden, w.weight_dtype_bytes, 1), w)
    return DesignCost(
        name=design.name, engine=design.engine, summary=design.describe(dp), ranks=n, sampler=design.sampler,
        step=step, weight_bytes=weights, logits_buffer_bytes=logits, memory_bytes=weights + logits,
        embedding_bytes=embedding, embedding_time_s=transfer_time(embedding, w.bandwidth),
        hidden_gather_bytes=hidden, collection_bytes=collection,
        step_bytes=traffic.bytes, step_bytes_worst=traffic.bytes_worst, head_flops=flops,
        head_time_s=head, step_time_s=seconds(w, traffic, work) + head,
        step_time_worst_s=seconds(w, traffic, work, True) + head, collectives=traffic.collectives,
        collectives_worst=traffic.collectives_worst,
        launches=work.launches, launches_worst=work.launches_worst, host_reads=work.reads,
        host_reads_worst=work.reads_worst, verify_bytes=verify.bytes, verify_collectives=verify.collectives,
        score_bytes=scored, score_peak_bytes=score_peak, applies=not design.single_device or w.ranks == 1)


def step_time(design: Design, w: Workload, step: str) -> float:
    """Typical seconds of ``design``'s ``step`` of ``w`` as the report's table prices it: ``w``'s
    decode or verification step whole (:func:`design_cost`'s ``step_time_s``), or for ``"score"``
    the logits path of scoring (:func:`path_time`)."""
    if step == "score":
        return path_time(design, w, step)
    own = "verify" if w.spec_tokens else "decode"
    if step != own:
        raise ValueError(f"the workload's step is {own!r} (spec_tokens={w.spec_tokens}), not {step!r}")
    return design_cost(design, w).step_time_s


def plan(w: Workload, designs: tuple[Design, ...] = DESIGNS) -> list[DesignCost]:
    """Every design priced on ``w``, with its memory above the leanest one in KV tokens."""
    costs = [design_cost(d, w) for d in designs]
    leanest = min(c.memory_bytes for c in costs)
    return [replace(c, extra_memory_bytes=c.memory_bytes - leanest,
                    kv_tokens=None if w.kv_bytes_per_token is None
                    else kv_tokens(c.memory_bytes - leanest, w.kv_bytes_per_token)) for c in costs]

