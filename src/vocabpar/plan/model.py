"""The cost model: what each vocabulary design costs per rank, as plain numbers.

Units (read aloud by :func:`human`), limits and dtype sizes; the quantities (weights, logits,
FLOPs, times); the workload, its sampling and the designs; the traffic of a decode step, of
speculative verification and of scoring, composed from the collectives each takes part in.
Each design priced on a workload is :mod:`vocabpar.plan.cost`'s, the launches and host reads it
adds :mod:`vocabpar.plan.host`'s; recommending a design lives in :mod:`vocabpar.plan.recommend`,
the study's figures in :mod:`vocabpar.plan.study`; the report's text in :mod:`vocabpar.report`,
pictures in :mod:`vocabpar.plots`.

Every quantity is one small function of explicit shapes returning base units (bytes, FLOPs,
seconds). Traffic is the bytes *received by the busiest rank*, under the byte model that
``vocabpar.comm`` books (ring all-reduce ``2(n-1)/n*M``, ring all-gather ``(n-1)*chunk`` with
chunks padded to the largest, gather ``(n-1)*chunk`` on the destination, all-to-all exact
splits), so predictions can be compared with measured counters. This module states no byte
formula of its own: the ring formulas are :mod:`vocabpar.wire.traffic`'s; the strategies' facts
and sizes (what they send, which rows each rank ends with, what it receives and holds) come from
:mod:`vocabpar.wire.strategies`; the sampler's message sizes from :mod:`vocabpar.wire`.

Topology: ``ranks`` ranks share the vocabulary (the head's TP group). Attention is either
tensor-parallel (``dp=1``: every rank holds all ``batch`` hidden rows) or data-parallel over
``dp`` groups (each holds ``ceil(batch/dp)`` rows, so a sharded head first gathers the other
groups' hidden rows). Activations travel in the weight dtype. Time follows the alpha-beta model
with fixed costs: every collective costs ``latency`` before its bytes move at ``bandwidth``,
every kernel launch ``launch`` and every host read ``sync`` (:mod:`vocabpar.plan.machine`), plus
the head's FLOPs at ``flops``, without overlap. The per-call agreement checks, which production turns off, and
the bytes of sampled ids sent back are left out; the collectives that send those ids are counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from vocabpar.layout import VocabLayout
from vocabpar.plan.machine import DEFAULT_MODE, MODES
from vocabpar.wire.filters import Sampling, check_range
from vocabpar.wire.scripts import (
    ENGINE_SEARCH_BITS,
    SCORE_ROWS,
    SamplePath,
    choose_search_bits,
    engine_plan,
    engine_sample_script,
    price,
    sample_script,
    sampler_paths,
    sampler_price,
    score_blocks,
    score_script,
    verify_paths,
    verify_price,
)
from vocabpar.wire.strategies import (
    collection_bytes,
    collection_peak_bytes,
    exchange_bytes,
    strategy,
)
from vocabpar.wire.strategies import hidden_gather_bytes as gathered_hidden_bytes
from vocabpar.wire.traffic import Traffic, exact

KiB, MiB, GiB = 2**10, 2**20, 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
# Accepted [low, high] of each Workload field and of the headroom, in base units (a Sampling's
# fields: its filters' limits, vocabpar.wire.filters):
# wide enough for any real model, cluster and decode step, narrow enough that every planned
# quantity is a finite number. The skew must also be at least 1/ranks.
LIMITS: dict[str, tuple[float, float]] = {
    "vocab": (1, 2**31), "hidden": (1, 2**20), "ranks": (1, 2**16), "dp": (1, 2**16),
    "batch": (0, 2**24), "tokens": (0, 2**31), "weight_dtype_bytes": (1, 8), "logits_dtype_bytes": (1, 8),
    "pad_to": (1, 2**20), "bandwidth": (1e3, 1e18), "flops": (1e6, 1e21), "kv_bytes_per_token": (1e-3, 1e12),
    "memory_bandwidth": (1e6, 1e18),
    "latency": (0.0, 1.0), "launch": (0.0, 1.0), "sync": (0.0, 1.0),
    "spec_tokens": (0, 2**10), "score_tokens": (0, 2**31), "score_top_n": (0, 2**10),
    "skew": (0.0, 1.0), "headroom": (0, 1e6 * GiB),
}
LATENCY, LAUNCH, SYNC = (getattr(MODES[DEFAULT_MODE], name) for name in ("latency", "launch", "sync"))
"""Default seconds per collective (alpha), per kernel launch (lambda) and per host read: the
``eager`` execution mode's figures (:data:`vocabpar.plan.machine.MODES`, with their sources)."""


def check_limit(name: str, value: float) -> None:
    """Raise ``ValueError`` unless ``value`` lies in ``LIMITS[name]`` (NaN never does)."""
    check_range(name, value, LIMITS[name])


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (``bf16``, ``fp32``, ...)."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}") from None


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``1 host read``, ``3 launches``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('ch') else 's'}"


_SCALES = {
    "bytes": (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1)),
    "ibytes": (("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("B", 1)),
    "seconds": (("s", 1), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)),
    "flops": (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("FLOP", 1)),
    "tokens": (("M tokens", 1e6), ("k tokens", 1e3), ("tokens", 1)),
}
UNITS = {unit: scale for scales in _SCALES.values() for unit, scale in scales} | {"per forward": 1}


def format_quantity(value: float, unit: str, digits: int) -> str:
    """``value`` (base units) in ``unit`` with ``digits`` decimals: GB/MB/KB are powers of 10,
    GiB/MiB/KiB powers of 2."""
    return f"{value / UNITS[unit]:.{digits}f} {unit}"


def human(value: float, kind: str) -> str:
    """``value`` in the largest unit of ``kind`` (bytes, ibytes, seconds, flops, tokens) that
    keeps it at least 1; two decimals below 10, else one; none for whole units (B, FLOP)."""
    scales = _SCALES[kind]
    unit, scale = next(((u, s) for u, s in scales if abs(value) >= s), scales[-1])
    digits = 0 if scale == 1 and kind != "seconds" else 2 if abs(value) < 10 * scale else 1
    return format_quantity(value, unit, digits)


# ---------------------------------------------------------------------- quantities
def shard_rows(vocab: int, ranks: int, scheme: str = "padded", pad_to: int = 64) -> int:
    """Rows stored by the largest shard, padding included: the weight rows per rank and the
    all-gather chunk width. Padded: ``padded_vocab/n`` with quantum ``lcm(pad_to, n)``;
    uneven: ``ceil(V/n)``; replicated: ``V``."""
    return VocabLayout(vocab, ranks, pad_to=pad_to, scheme=scheme).shard_width


def weight_bytes(rows: int, hidden: int, dtype_bytes: int, matrices: int = 2) -> int:
    """Bytes of ``matrices`` ``[rows, hidden]`` tables (embedding and head; one when tied)."""
    return matrices * rows * hidden * dtype_bytes


def logits_bytes(rows: int, cols: int, dtype_bytes: int) -> int:
    """Bytes of one ``[rows, cols]`` logits buffer."""
    return rows * cols * dtype_bytes


def head_flops(rows: int, cols: int, hidden: int) -> int:
    """``2·rows·cols·hidden``: the head GEMM producing ``[rows, cols]`` logits."""
    return 2 * rows * cols * hidden


def busiest_owner(tokens: int, ranks: int, skew: float | None = None) -> int:
    """Tokens owned by the rank owning most of ``tokens``: an even share ``ceil(T/n)``, or
    ``ceil(skew·T)`` when the busiest rank owns the share ``skew`` (never below the even share)."""
    even = -(-tokens // ranks)
    return even if skew is None else min(tokens, max(even, math.ceil(round(skew * tokens, 6))))


def embedding_exchange_bytes(mode: str, tokens: int, hidden: int, ranks: int, dtype_bytes: int,
                             *, owned: int | None = None) -> int:
    """Bytes a rank receives to assemble ``[tokens, hidden]`` embeddings, once per forward
    (:func:`vocabpar.wire.strategies.exchange_bytes`): ``all_reduce`` ``2(n-1)/n·T·H·b``;
    ``owner_gather`` ``(n-1)·owned·H·b`` with ``owned`` the largest owner's count (default
    ``ceil(T/n)``); ``local`` nothing."""
    return round(exchange_bytes(mode, tokens, hidden * dtype_bytes, ranks, owned))


def hidden_gather_bytes(batch: int, dp: int, hidden: int, dtype_bytes: int, checked: bool = False) -> int:
    """DP attention feeding a sharded head: the row counts (``checked``: the whole agreement
    record), then each DP group's ``ceil(B/dp)`` hidden rows, all-gathered:
    ``(dp-1)·(8·w + ceil(B/dp)·H·b)`` (:func:`vocabpar.wire.strategies.hidden_gather_bytes`);
    zero when attention is tensor-parallel (``dp=1``)."""
    return gathered_hidden_bytes(batch, dp, hidden * dtype_bytes, checked)


def logits_collection_bytes(name: str, batch: int, vocab: int, ranks: int, dtype_bytes: int,
                            *, scheme: str = "padded", pad_to: int = 64) -> int:
    """Bytes the busiest rank receives to collect ``[batch, shard]`` logits shards with strategy
    ``name``, per step: ``(n-1)·rows·c·b`` with ``c`` the largest shard of ``scheme``
    (:func:`vocabpar.wire.strategies.collection_bytes`). Sampled ids sent back are not counted."""
    return collection_bytes(name, batch, shard_rows(vocab, ranks, scheme, pad_to), ranks, dtype_bytes)


def logits_buffer_bytes(name: str, batch: int, vocab: int, ranks: int, dtype_bytes: int,
                        *, scheme: str = "padded", pad_to: int = 64, dp: int = 1) -> int:
    """Peak logits memory on the busiest rank: the local logits it computes plus what strategy
    ``name`` collects, with ``c`` the largest shard of ``scheme``
    (:func:`vocabpar.wire.strategies.collection_peak_bytes`). One rank collects nothing."""
    return collection_peak_bytes(name, batch, shard_rows(vocab, ranks, scheme, pad_to), vocab, ranks,
                                 dtype_bytes, dp)


def greedy_sampling_bytes(batch: int, ranks: int) -> int:
    """Greedy on sharded logits: all-gather of one (value, id) pair per row, ``(n-1)·B·16``
    received per rank: the greedy sampler's script."""
    return price(sample_script(SamplePath(batch)), ranks).bytes


def transfer_time(nbytes: float, bandwidth: float) -> float:
    """Seconds to move ``nbytes`` at ``bandwidth`` bytes/s."""
    return nbytes / bandwidth


def compute_time(flops: float, throughput: float) -> float:
    """Seconds for ``flops`` at ``throughput`` FLOP/s."""
    return flops / throughput


def head_time(flops: float, weight_bytes: float, w: Workload) -> float:
    """Seconds of a rank's LM head: the longer of its FLOPs at ``w.flops`` and of reading its
    ``weight_bytes`` at ``w.memory_bandwidth`` (decode is memory-bound: a small batch still
    reads the whole matrix). No rows, no head."""
    if not flops:
        return 0.0
    return max(compute_time(flops, w.flops), transfer_time(weight_bytes, w.memory_bandwidth))


def kv_tokens(nbytes: float, kv_bytes_per_token: float) -> int:
    """KV-cache tokens that ``nbytes`` of memory would hold."""
    return math.floor(nbytes / kv_bytes_per_token)


# ---------------------------------------------------------------------- sampling on shards
def sampler_traffic(rows: int, ranks: int, widest: int, vocab: int, s: Sampling) -> Traffic:
    """One ``sample()`` call on ``rows`` rows of sharded logits (``widest``: the most real tokens
    one rank holds), the agreement check apart: the typical..worst price of its script
    (:func:`vocabpar.wire.scripts.sampler_paths`). Bytes depend on rows, n and the candidate
    count, never on V."""
    return sampler_price(sampler_paths(rows, ranks, widest, vocab, s), ranks)


# ---------------------------------------------------------------------- workload and designs
@dataclass(frozen=True)
class Workload:
    """A model shape and a serving workload, in base units (bytes, bytes/s, FLOP/s, seconds).

    ``batch``: rows needing logits per decode step over the group; ``tokens``: tokens per
    forward (prefill) for the embedding; ``dp``: data-parallel attention groups (1 = attention
    TP); it must divide ``ranks``. ``sampling``: how each decode step samples. ``spec_tokens``:
    draft tokens verified per row and step (0: no speculative decoding); ``draft_logits``: the
    drafts come with the draft model's logits. ``score_tokens``: prompt tokens scored (log
    probabilities with the top ``score_top_n``) per request. ``skew``: the share of a forward's
    tokens owned by the busiest rank (``None``: balanced, 1/ranks). ``kv_bytes_per_token``: the
    KV cache one token takes on each rank, from the model (``None``: unknown, no KV column).
    ``memory_bandwidth``: bytes/s a rank reads its weights at (an H100's HBM3: 3.35 TB/s), which
    bounds the head at decode from below: its matrix is read whole whatever the batch.
    ``compiled``: the engine Sampler's calls run compiled whole (graph mode), their launches the
    compiled program's kernels. ``latency``/``launch``/``sync``: seconds per collective, kernel
    launch and host read. Every numeric field lies in its ``LIMITS`` range, which keeps every
    planned quantity finite."""

    vocab: int
    hidden: int
    tied: bool = False
    ranks: int = 8
    dp: int = 1
    batch: int = 256
    tokens: int = 8192
    weight_dtype_bytes: int = 2
    logits_dtype_bytes: int = 2
    bandwidth: float = 300e9
    flops: float = 600e12
    memory_bandwidth: float = 3.35e12
    kv_bytes_per_token: float | None = None
    pad_to: int = 64
    latency: float = LATENCY
    launch: float = LAUNCH
    sync: float = SYNC
    compiled: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    spec_tokens: int = 0
    draft_logits: bool = False
    score_tokens: int = 0
    score_top_n: int = 0
    skew: float | None = None

    def __post_init__(self) -> None:
        for name in LIMITS:
            if name != "headroom" and getattr(self, name) is not None:
                check_limit(name, getattr(self, name))
        if self.ranks % self.dp:
            raise ValueError(f"dp={self.dp} must divide ranks={self.ranks}")
        if self.skew is not None and self.skew * self.ranks < 1 - 1e-9:
            raise ValueError(f"skew must be in [1/ranks, 1] = [{1 / self.ranks:g}, 1] (the busiest rank "
                             f"owns at least an even share), got {self.skew!r}")

    @property
    def matrices(self) -> int:
        return 1 if self.tied else 2


@dataclass(frozen=True)
class Design:
    """One engine's way through the vocabulary dimension: layout scheme, embedding exchange,
    logits collection ``strategy`` (:data:`vocabpar.wire.strategies.STRATEGIES`) and the
    ``sampler`` it runs (:data:`vocabpar.plan.host.SAMPLERS`: the functional sampler on shards,
    vocabpar's engine Sampler on shards, or an engine's own sampler on full rows).
    ``single_device``: no TP at all (llama.cpp; input embedding on the host). ``summary_tp``: the
    summary when attention is tensor-parallel (``dp`` 1), where it differs."""

    name: str
    engine: str
    scheme: str
    embedding: str
    strategy: str
    summary: str
    single_device: bool = False
    sampler: str = "dense"
    summary_tp: str | None = None

    def describe(self, dp: int) -> str:
        """The summary that fits a workload with ``dp`` attention groups."""
        return self.summary_tp if dp == 1 and self.summary_tp else self.summary


DESIGNS: tuple[Design, ...] = (
    Design("vllm-all-gather", "vLLM", "padded", "all_reduce", "all_gather",
           "pad to lcm(64, n) and shard; all-gather logits to every rank"),
    Design("vllm-gather", "vLLM", "padded", "all_reduce", "gather",
           "pad and shard; gather logits to rank 0, which samples and broadcasts ids"),
    Design("sglang-dp-gather-scatter", "SGLang", "padded", "all_reduce", "dp_gather_scatter",
           "DP attention: gather hidden, head once, all-gather logits, keep own rows",
           summary_tp="all-gather logits, each rank samples its own rows, all-gather ids (DP attention's "
                      "path at dp 1)"),
    Design("sglang-all-to-all", "SGLang", "padded", "all_reduce", "all_to_all",
           "DP attention: row-block all-to-all, full-vocab rows of the own block only",
           summary_tp="row-block all-to-all: each rank samples full-vocab rows of its own block, all-gather "
                      "ids"),
    Design("trtllm-uneven", "TensorRT-LLM", "uneven", "all_reduce", "all_gather",
           "ceil(V/n) rows, no padding; size-aware all-gather"),
    Design("llama.cpp", "llama.cpp", "replicated", "local", "replicated",
           "no TP: one device, input embedding on the host, head on the device", single_device=True),
    Design("deepinfer-replicated", "DeepInfer", "replicated", "local", "replicated",
           "both matrices on every rank: local lookup, logits and sampling"),
    Design("vocabpar-sharded", "vocabpar", "padded", "owner_gather", "none",
           "owner-gather embedding (priced at the skew); the functional sampler on sharded logits (typical "
           "peaked rows, worst case in --json)", sampler="functional"),
    Design("vocabpar-engine", "vocabpar", "padded", "owner_gather", "none",
           "owner-gather embedding; the engine Sampler on sharded logits: one fixed script per step, "
           "no host read of its own (its failure flags ride in the step's copy of sampled ids)",
           sampler="engine"),
)


def logits_traffic(name: str, rows: int, w: Workload, ranks: int, scheme: str,
                   sampler: str = "functional") -> Traffic:
    """The logits path of ``rows`` rows with strategy ``name`` on ``ranks`` ranks: its
    collectives and gathered shards, the collective sharing sampled ids where it has one (its
    bytes left out), and sampling on shards (``w.sampling``) where the logits stay sharded, by
    the functional sampler (typical..worst) or the engine's (exact: a fixed script)."""
    s = strategy(name)
    c = shard_rows(w.vocab, ranks, scheme, w.pad_to)
    t = Traffic()
    if ranks > 1:
        t = exact(s.collectives + (s.ids is not None), logits_collection_bytes(
            name, rows, w.vocab, ranks, w.logits_dtype_bytes, scheme=scheme, pad_to=w.pad_to))
    if s.on_shards and sampler == "engine":
        t += engine_traffic(rows, ranks, min(c, w.vocab), w.vocab, w.sampling, link=(w.latency, w.bandwidth))
    elif s.on_shards:
        t += sampler_traffic(rows, ranks, min(c, w.vocab), w.vocab, w.sampling)
    return t


def engine_traffic(rows: int, ranks: int, widest: int, vocab: int, s: Sampling, *, drafts: int = 0,
                   draft_logits: bool = False, link: tuple[float, float] | None = None) -> Traffic:
    """The engine ``Sampler``'s fixed script on ``rows`` batch rows (verifying ``drafts`` per
    row: the stacked rows, with draft logits the masses and the correction), the same whatever
    the logits. Its messages carry exactly the call's rows, as a sampler sized to them sends, and
    its searches take the rounds such a sampler chooses on ``link`` (latency s, bandwidth B/s;
    ``None``: the default 11, 11 and 10 bits)."""
    weigh = draft_logits and not s.greedy and drafts > 0
    stacked = rows * (drafts + 1 + drafts * weigh)
    if not stacked:  # no call: an engine skips the sampler for an empty batch
        return Traffic()
    bits = ENGINE_SEARCH_BITS if link is None else choose_search_bits(stacked, ranks, *link)
    plan = engine_plan(stacked, ranks, widest, vocab, greedy=[s.greedy], values=s.values(), search_bits=bits)
    return price(engine_sample_script(replace(plan, drafts=weigh)), ranks)


def verify_traffic(name: str, w: Workload, ranks: int, scheme: str, sampler: str = "functional") -> Traffic:
    """Speculative verification of ``w.spec_tokens`` draft tokens per batch row, logits path
    only. Collecting designs gather the ``B·(K+1)`` target rows with their strategy (plus the
    collective sharing ids where they have one) and verify locally; replicated designs need
    nothing. On shards it is one sampler call on the ``B·(K+1)`` target rows with the step's
    sampling; with draft logits and a sampled step the ``B·K`` draft rows join that call, then
    one all-reduce of 4 int64 per draft position (the exact masses), and, when some row rejected
    a draft, one all-gather of each rank's best correction (2 int64 per rejecting row: none in
    the typical case, every row in the worst)."""
    K, B = w.spec_tokens, w.batch
    if not K:
        return Traffic()
    if not strategy(name).on_shards:
        return logits_traffic(name, B * (K + 1), w, ranks, scheme)
    widest = min(shard_rows(w.vocab, ranks, scheme, w.pad_to), w.vocab)
    if sampler == "engine":
        return engine_traffic(B, ranks, widest, w.vocab, w.sampling, drafts=K, draft_logits=w.draft_logits,
                              link=(w.latency, w.bandwidth))
    paths = verify_paths(B, K, w.draft_logits, ranks, widest, w.vocab, w.sampling)
    return verify_price(paths, ranks)


def score_bytes(name: str, w: Workload, ranks: int, scheme: str) -> tuple[int, int]:
    """``(received, peak logits bytes)`` on the busiest rank for scoring ``w.score_tokens`` prompt
    tokens. On shards: ``token_logprobs`` per block of ``SCORE_ROWS`` rows (its script,
    :func:`vocabpar.wire.scripts.score_script`), one ``[SCORE_ROWS, c]``
    block of logits held at a time. Collecting designs gather the ``[T, V]`` logits at once, as
    engines do for prompt logprobs."""
    T, b, s = w.score_tokens, w.logits_dtype_bytes, strategy(name)
    if not s.on_shards:
        return (logits_collection_bytes(name, T, w.vocab, ranks, b, scheme=scheme, pad_to=w.pad_to),
                logits_buffer_bytes(name, T, w.vocab, ranks, b, scheme=scheme, pad_to=w.pad_to))
    received = sum(price(score_script(rows, w.score_top_n), ranks).bytes for rows in score_blocks(T))
    return received, logits_bytes(min(T, SCORE_ROWS), shard_rows(w.vocab, ranks, scheme, w.pad_to), b)


def step_traffic(design: Design, w: Workload, *, owned: int | None = None, checked: bool = False) -> Traffic:
    """One decode step of ``design`` on ``w``: the embedding exchange of the ``batch`` new
    tokens (``owned``: the largest owner's count, default from ``w.skew``), with DP attention the
    row counts and hidden rows gathered (``checked``: the counts carry the agreement record),
    and the logits path (:func:`logits_traffic`). Nothing crosses ranks on one rank."""
    n = 1 if design.single_device else w.ranks
    dp = 1 if design.single_device else w.dp
    if n == 1:
        return Traffic()
    hidden = Traffic()
    if dp > 1 and design.scheme != "replicated":
        hidden = exact(2, hidden_gather_bytes(w.batch, dp, w.hidden, w.weight_dtype_bytes, checked))
    return (embedding_traffic(design, w, w.batch, n, owned) + hidden
            + logits_traffic(design.strategy, w.batch, w, n, design.scheme, design.sampler))


def embedding_traffic(design: Design, w: Workload, tokens: int, ranks: int, owned: int | None) -> Traffic:
    """The embedding exchange of ``tokens`` ids (``owned``: the largest owner's count, default
    from ``w.skew``)."""
    owned = busiest_owner(tokens, ranks, w.skew) if owned is None else owned
    return exact(int(design.embedding != "local"), embedding_exchange_bytes(
        design.embedding, tokens, w.hidden, ranks, w.weight_dtype_bytes, owned=owned))


def verify_step_traffic(design: Design, w: Workload, *, owned: int | None = None) -> Traffic:
    """One speculative decoding step of the target (the draft model's own decoding apart): the
    embedding exchange of the ``B·(K+1)`` ids it is fed (the last token and the drafts), then
    the verification (:func:`verify_traffic`)."""
    n = 1 if design.single_device else w.ranks
    if n == 1:
        return Traffic()
    return (embedding_traffic(design, w, w.batch * (w.spec_tokens + 1), n, owned)
            + verify_traffic(design.strategy, w, n, design.scheme, design.sampler))
