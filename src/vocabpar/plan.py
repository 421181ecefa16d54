"""The accounting: what each vocabulary design costs per rank, as plain numbers.

Every quantity is one small function of explicit shapes returning base units (bytes, FLOPs,
seconds). Traffic is the bytes *received by the busiest rank*, under the byte model that
``vocabpar.comm`` books (ring all-reduce ``2(n-1)/n*M``, ring all-gather ``(n-1)*chunk`` with
chunks padded to the largest, gather ``(n-1)*chunk`` on the destination, all-to-all exact
splits), so predictions can be compared with measured counters. The strategies' facts (what
they send, which rows each rank ends with) come from :mod:`vocabpar.wire.strategies`; the sampler's
message sizes from :mod:`vocabpar.wire`.

Topology: ``ranks`` ranks share the vocabulary (the head's TP group). Attention is either
tensor-parallel (``dp=1``: every rank holds all ``batch`` hidden rows) or data-parallel over
``dp`` groups (each holds ``ceil(batch/dp)`` rows, so a sharded head first gathers the other
groups' hidden rows). Activations travel in the weight dtype. Time follows the alpha-beta model:
every collective costs ``latency`` before its bytes move at ``bandwidth``, plus the head's FLOPs
at ``flops``, without overlap. The per-call agreement checks, which production turns off, and
the bytes of sampled ids sent back are left out; the collectives that send those ids are counted.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from vocabpar.layout import VocabLayout
from vocabpar.wire.sampler import (
    DRAW_WORDS,
    MAX_CANDIDATES,
    SCORE_ROWS,
    agreement_words,
    candidate_count,
    histogram_words,
    round_one_words,
    score_words,
    settle_words,
)
from vocabpar.wire.strategies import exchange_bytes, strategy
from vocabpar.wire.traffic import WORD, Traffic, all_gather, all_reduce, exact, maybe

KiB, MiB, GiB = 2**10, 2**20, 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
GREEDY_PAIR_BYTES = 8 + 8  # float64 value (the sampler ranks in float64) + int64 global id per row
# Accepted [low, high] of each Workload and Sampling field and of the headroom, in base units:
# wide enough for any real model, cluster and decode step, narrow enough that every planned
# quantity is a finite number. The skew must also be at least 1/ranks.
LIMITS: dict[str, tuple[float, float]] = {
    "vocab": (1, 2**31), "hidden": (1, 2**20), "ranks": (1, 2**16), "dp": (1, 2**16),
    "batch": (0, 2**24), "tokens": (0, 2**31), "weight_dtype_bytes": (1, 8), "logits_dtype_bytes": (1, 8),
    "pad_to": (1, 2**20), "bandwidth": (1e3, 1e18), "flops": (1e6, 1e21), "kv_bytes_per_token": (1e-3, 1e12),
    "latency": (0.0, 1.0), "spec_tokens": (0, 2**10), "score_tokens": (0, 2**31), "score_top_n": (0, 2**10),
    "skew": (0.0, 1.0), "headroom": (0, 1e6 * GiB),
    "temperature": (0.0, 1e6), "top_k": (0, 2**31), "top_p": (1e-9, 1.0), "min_p": (0.0, 1.0),
}
SAMPLING_LIMITS = ("temperature", "top_k", "top_p", "min_p")
LATENCY = 15e-6
"""Default seconds per collective (the alpha of the alpha-beta model) for NVLink-class NCCL: a
small all-reduce takes 3.5-6 us of kernel time in nccl-tests on 2-8 H100/H800 GPUs (NVIDIA/nccl
GitHub issues 1259 and 1984), and a call outside CUDA graphs adds about 10 us of launch and host
synchronisation."""


def check_limit(name: str, value: float) -> None:
    """Raise ``ValueError`` unless ``value`` lies in ``LIMITS[name]`` (NaN never does)."""
    low, high = LIMITS[name]
    if not low <= value <= high:
        span = ", ".join(str(x) if isinstance(x, int) else f"{x:g}" for x in (low, high))
        raise ValueError(f"{name} must be in [{span}], got {value!r}")


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (``bf16``, ``fp32``, ...)."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}") from None


# ---------------------------------------------------------------------- quantities
def shard_rows(vocab: int, ranks: int, scheme: str = "padded", pad_to: int = 64) -> int:
    """Rows stored by the largest shard, padding included: the weight rows per rank and the
    all-gather chunk width. Padded: ``padded_vocab/n`` with quantum ``lcm(pad_to, n)``;
    uneven: ``ceil(V/n)``; replicated: ``V``."""
    return VocabLayout(vocab, ranks, pad_to=pad_to, scheme=scheme).max_rows


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
    """DP attention feeding a sharded head: an all-gather of the row counts (so ranks may bring
    different numbers of rows; a 3-word record per DP rank, or the whole 32-word agreement
    record when the per-call checks are on), then of each DP group's ``ceil(B/dp)`` hidden rows:
    ``(dp-1)·(8·w + ceil(B/dp)·H·b)``; zero when attention is tensor-parallel (``dp=1``)."""
    return (dp - 1) * (8 * agreement_words(checked, 1) + -(-batch // dp) * hidden * dtype_bytes)


def logits_collection_bytes(name: str, batch: int, vocab: int, ranks: int, dtype_bytes: int,
                            *, scheme: str = "padded", pad_to: int = 64) -> int:
    """Bytes the busiest rank receives to collect ``[batch, shard]`` logits shards with strategy
    ``name``, per step: ``(n-1)·rows·c·b`` with ``c`` the largest shard and ``rows`` the
    strategy's gathered rows (``all_gather``, ``gather`` on the destination, ``dp_gather_scatter``:
    ``B``; ``all_to_all``: ``ceil(B/n)``; ``none``, ``replicated``: 0). Sampled ids sent back are
    not counted."""
    rows = strategy(name).gathered_rows(batch, ranks)
    return (ranks - 1) * logits_bytes(rows, shard_rows(vocab, ranks, scheme, pad_to), dtype_bytes)


def logits_buffer_bytes(name: str, batch: int, vocab: int, ranks: int, dtype_bytes: int,
                        *, scheme: str = "padded", pad_to: int = 64, dp: int = 1) -> int:
    """Peak logits memory on the busiest rank: the local logits it computes (``[B, c]``; a
    replicated head ``[ceil(B/dp), V]``) plus what strategy ``name`` collects -- its gathered
    rows of every shard, ``[rows, n·c]``, and full rows kept apart (``dp_gather_scatter``:
    ``[ceil(B/dp), V]``). One rank collects nothing."""
    s = strategy(name)
    c = shard_rows(vocab, ranks, scheme, pad_to)
    collected = logits_bytes(s.gathered_rows(batch, ranks), ranks * c, dtype_bytes) \
        + logits_bytes(s.kept_rows(batch, dp), vocab, dtype_bytes)
    return logits_bytes(s.local_rows(batch, dp), c, dtype_bytes) + (collected if ranks > 1 else 0)


def greedy_sampling_bytes(batch: int, ranks: int) -> int:
    """Greedy on sharded logits: all-gather of one (float64 value, int64 id) pair per row,
    ``(n-1)·B·16`` received per rank -- independent of the vocabulary."""
    return (ranks - 1) * batch * GREEDY_PAIR_BYTES


def transfer_time(nbytes: float, bandwidth: float) -> float:
    """Seconds to move ``nbytes`` at ``bandwidth`` bytes/s."""
    return nbytes / bandwidth


def compute_time(flops: float, throughput: float) -> float:
    """Seconds for ``flops`` at ``throughput`` FLOP/s."""
    return flops / throughput


def kv_tokens(nbytes: float, kv_bytes_per_token: float) -> int:
    """KV-cache tokens that ``nbytes`` of memory would hold."""
    return math.floor(nbytes / kv_bytes_per_token)


# ---------------------------------------------------------------------- sampling on shards
@dataclass(frozen=True)
class Sampling:
    """A decode step's sampling, the same for every row: ``temperature`` 0 is greedy (the other
    fields then do nothing); ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 are off. Each field lies in
    its ``LIMITS`` range."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        for name in SAMPLING_LIMITS:
            check_limit(name, getattr(self, name))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        """``"greedy"`` or the parameters in use, e.g. ``"temperature 0.8, top-p 0.9"``."""
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"] + [f"{name} {value:g}" for name, value, off in (
            ("top-k", self.top_k, 0), ("top-p", self.top_p, 1), ("min-p", self.min_p, 0)) if value != off]
        return ", ".join(parts)


def sampler_traffic(rows: int, ranks: int, widest: int, vocab: int, s: Sampling) -> Traffic:
    """One ``sample()`` call on ``rows`` rows of sharded logits (``widest``: the most real tokens
    one rank holds), per the collectives its module docstring lists (the agreement check apart).

    Greedy: one all-gather of a (value, id) pair per row. Otherwise round one gathers each
    shard's top-c candidates (``wire.candidate_count``); the typical case is LLM-like peaked rows
    without ties: top-k with k <= c and top-p are then settled by the candidates, top-p without
    such a top-k needs one all-reduce of its total (8 B per row), top-k with k > c a threshold
    search (two histogram all-reduces and a settling all-gather), and the token is drawn locally
    unless no filter narrows the row (then one all-gather of each rank's best); only a top-k
    search whose bounds share many key bits takes fewer histogram rounds. The worst case (flat
    or tied rows) adds, wherever the code may take them: the total, a top-p threshold search, a
    tie round after each search, and the draw's all-gather, each carrying all ``rows``. Bytes
    depend on rows, n and c, never on V."""
    if s.greedy:
        return all_gather(rows * round_one_words(0) * WORD, ranks)
    k = s.top_k if s.top_k < vocab else 0  # top-k over the whole vocabulary filters nothing
    top_p = s.top_p < 1
    c = candidate_count(ranks, widest, top_k=s.top_k if s.top_k <= MAX_CANDIDATES else 0, top_p=top_p,
                        min_p=s.min_p > 0)
    unsent = c < widest  # some rank holds tokens it did not send
    hist = all_reduce(rows * histogram_words() * WORD, ranks)

    def search(draw: bool) -> Traffic:
        return hist + hist + all_gather(rows * settle_words(draw) * WORD, ranks) + maybe(hist)

    t = all_gather(rows * round_one_words(c) * WORD, ranks)
    if k > c:
        t += search(draw=not top_p)
    if top_p and unsent:
        total = all_reduce(rows * WORD, ranks)
        t += maybe(total + search(draw=True)) if 0 < k <= c else total + maybe(search(draw=True))
    if unsent:
        draw = all_gather(rows * DRAW_WORDS * WORD, ranks)
        t += draw if not (k or top_p or s.min_p > 0) else maybe(draw)
    return t


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
    tokens owned by the busiest rank (``None``: balanced, 1/ranks). Every numeric field lies in
    its ``LIMITS`` range, which keeps every planned quantity finite."""

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
    kv_bytes_per_token: float = 890
    pad_to: int = 64
    latency: float = LATENCY
    sampling: Sampling = field(default_factory=Sampling)
    spec_tokens: int = 0
    draft_logits: bool = False
    score_tokens: int = 0
    score_top_n: int = 0
    skew: float | None = None

    def __post_init__(self) -> None:
        for name in LIMITS:
            if name not in ("headroom", *SAMPLING_LIMITS) and getattr(self, name) is not None:
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
    logits collection ``strategy`` (:data:`vocabpar.wire.strategies.STRATEGIES`). ``single_device``:
    no TP at all (llama.cpp; input embedding on the host)."""

    name: str
    engine: str
    scheme: str
    embedding: str
    strategy: str
    summary: str
    single_device: bool = False


DESIGNS: tuple[Design, ...] = (
    Design("vllm-all-gather", "vLLM", "padded", "all_reduce", "all_gather",
           "pad to lcm(64, n) and shard; all-gather logits to every rank"),
    Design("vllm-gather", "vLLM", "padded", "all_reduce", "gather",
           "pad and shard; gather logits to rank 0, which samples and broadcasts ids"),
    Design("sglang-dp-gather-scatter", "SGLang", "padded", "all_reduce", "dp_gather_scatter",
           "DP attention: gather hidden, head once, all-gather logits, keep own rows"),
    Design("sglang-all-to-all", "SGLang", "padded", "all_reduce", "all_to_all",
           "DP attention: row-block all-to-all, full-vocab rows of the own block only"),
    Design("trtllm-uneven", "TensorRT-LLM", "uneven", "all_reduce", "all_gather",
           "ceil(V/n) rows, no padding; size-aware all-gather"),
    Design("llama.cpp", "llama.cpp", "replicated", "local", "replicated",
           "no TP: one device, input embedding on the host, head on the device", single_device=True),
    Design("deepinfer-replicated", "DeepInfer", "replicated", "local", "replicated",
           "both matrices on every rank: local lookup, logits and sampling"),
    Design("vocabpar-sharded", "vocabpar", "padded", "owner_gather", "none",
           "owner-gather embedding (priced at the skew); sample on sharded logits (the step's "
           "sampling priced: typical peaked rows, worst case in --json)"),
)


def logits_traffic(name: str, rows: int, w: Workload, ranks: int, scheme: str) -> Traffic:
    """The logits path of ``rows`` rows with strategy ``name`` on ``ranks`` ranks: its
    collectives and gathered shards, the collective sharing sampled ids where it has one (its
    bytes left out), and sampling on shards (``w.sampling``) where the logits stay sharded."""
    s = strategy(name)
    c = shard_rows(w.vocab, ranks, scheme, w.pad_to)
    t = Traffic()
    if ranks > 1:
        t = exact(s.collectives + (s.ids is not None), logits_collection_bytes(
            name, rows, w.vocab, ranks, w.logits_dtype_bytes, scheme=scheme, pad_to=w.pad_to))
    if s.on_shards:
        t += sampler_traffic(rows, ranks, min(c, w.vocab), w.vocab, w.sampling)
    return t


def verify_traffic(name: str, w: Workload, ranks: int, scheme: str) -> Traffic:
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
    if not (strategy(name).on_shards and w.draft_logits and not w.sampling.greedy):
        return logits_traffic(name, B * (K + 1), w, ranks, scheme)
    return (logits_traffic(name, B * (2 * K + 1), w, ranks, scheme) + all_reduce(B * K * 4 * WORD, ranks)
            + maybe(all_gather(B * DRAW_WORDS * WORD, ranks)))


def score_bytes(name: str, w: Workload, ranks: int, scheme: str) -> tuple[int, int]:
    """``(received, peak logits bytes)`` on the busiest rank for scoring ``w.score_tokens`` prompt
    tokens. On shards: ``token_logprobs`` per block of ``SCORE_ROWS`` rows, an all-gather of
    ``score_words(top_n)`` int64 and an all-reduce of one int64 per row, one ``[SCORE_ROWS, c]``
    block of logits held at a time. Collecting designs gather the ``[T, V]`` logits at once, as
    engines do for prompt logprobs."""
    T, b, s = w.score_tokens, w.logits_dtype_bytes, strategy(name)
    if not s.on_shards:
        return (logits_collection_bytes(name, T, w.vocab, ranks, b, scheme=scheme, pad_to=w.pad_to),
                logits_buffer_bytes(name, T, w.vocab, ranks, b, scheme=scheme, pad_to=w.pad_to))
    blocks = [SCORE_ROWS] * (T // SCORE_ROWS) + [T % SCORE_ROWS] * bool(T % SCORE_ROWS)
    received = sum((all_gather(rows * score_words(w.score_top_n) * WORD, ranks)
                    + all_reduce(rows * WORD, ranks)).bytes for rows in blocks)
    return received, logits_bytes(min(T, SCORE_ROWS), shard_rows(w.vocab, ranks, scheme, w.pad_to), b)


@dataclass(frozen=True)
class DesignCost:
    """Per-rank cost of one design (busiest rank; bytes, FLOPs, seconds, tokens).

    ``embedding_bytes``/``embedding_time_s``: one forward of ``tokens`` tokens.
    ``step_bytes``/``collectives``: one decode step -- embedding of the ``batch`` new tokens,
    hidden gather, logits collection (``collection_bytes``) or sampling on shards -- in the
    typical case (:class:`Traffic`), ``step_bytes_worst``/``collectives_worst`` at most; each
    collective costs ``latency`` before its bytes: ``step_time_s = collectives·latency +
    step_bytes/bandwidth + head_time_s`` (``step_time_worst_s`` likewise). ``verify_*``: the
    logits path of verifying ``spec_tokens`` drafts per row (typical case); ``score_bytes``,
    ``score_peak_bytes``: scoring ``score_tokens`` prompt tokens. ``extra_memory_bytes``:
    weights + logits above the leanest design; ``kv_tokens`` what that memory would hold as KV
    cache."""

    name: str
    engine: str
    summary: str
    ranks: int
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
    verify_bytes: int
    verify_collectives: int
    score_bytes: int
    score_peak_bytes: int
    extra_memory_bytes: int = 0
    kv_tokens: int = 0


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
            + logits_traffic(design.strategy, w.batch, w, n, design.scheme))


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
            + verify_traffic(design.strategy, w, n, design.scheme))


def design_cost(design: Design, w: Workload) -> DesignCost:
    """Price ``design`` on workload ``w`` (``extra_memory_bytes``/``kv_tokens`` left at 0; see
    ``plan``)."""
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
    step = step_traffic(design, w)
    collection = logits_traffic(design.strategy, w.batch, w, n, design.scheme).bytes
    verify = verify_traffic(design.strategy, w, n, design.scheme)
    scored, score_peak = score_bytes(design.strategy, w, n, design.scheme)
    flops = head_flops(s.local_rows(w.batch, dp), cols, w.hidden)
    head_time = compute_time(flops, w.flops)

    def time(collectives: int, nbytes: int) -> float:
        return collectives * w.latency + transfer_time(nbytes, w.bandwidth) + head_time

    return DesignCost(design.name, design.engine, design.summary, n, weights, logits, weights + logits,
                      embedding, transfer_time(embedding, w.bandwidth), hidden, collection, step.bytes,
                      step.bytes_worst, flops, head_time, time(step.collectives, step.bytes),
                      time(step.collectives_worst, step.bytes_worst), step.collectives,
                      step.collectives_worst, verify.bytes, verify.collectives, scored, score_peak)


def plan(w: Workload, designs: tuple[Design, ...] = DESIGNS) -> list[DesignCost]:
    """Every design priced on ``w``, with its memory above the leanest one in KV tokens."""
    costs = [design_cost(d, w) for d in designs]
    leanest = min(c.memory_bytes for c in costs)
    return [replace(c, extra_memory_bytes=c.memory_bytes - leanest,
                    kv_tokens=kv_tokens(c.memory_bytes - leanest, w.kv_bytes_per_token)) for c in costs]


# ---------------------------------------------------------------------- recommendation
@dataclass(frozen=True)
class Recommendation:
    design: str
    reason: str
    ranking: tuple[str, ...]  # eligible designs, fastest decode step first (memory breaks ties)


def recommend(costs: list[DesignCost], headroom_bytes: float | None = None) -> Recommendation:
    """The fastest design per decode step among those using the full rank count whose memory
    above the leanest fits ``headroom_bytes`` (no limit when ``None``), with the reason.
    ``ValueError`` when none fits (the leanest design overall may use fewer ranks)."""
    if headroom_bytes is not None:
        check_limit("headroom", headroom_bytes)
    ranks = max(c.ranks for c in costs)
    ranked = sorted((c for c in costs if c.ranks == ranks), key=lambda c: (c.step_time_s, c.memory_bytes))
    fits = [c for c in ranked if headroom_bytes is None or c.extra_memory_bytes <= headroom_bytes]
    leanest = min(ranked, key=lambda c: c.memory_bytes)
    if not fits:
        raise ValueError(f"no {ranks}-rank design fits a headroom of {human(headroom_bytes, 'ibytes')}: the "
                         f"leanest, {leanest.name}, needs {human(leanest.extra_memory_bytes, 'ibytes')} more "
                         f"per rank than {min(costs, key=lambda c: c.memory_bytes).name}")
    best = fits[0]
    runner = next((c for c in fits[1:] if c.step_time_s > best.step_time_s), None)
    reason = (f"{best.name} has the shortest estimated decode step"
              f"{' within the headroom' if best is not ranked[0] else ''}: "
              f"{human(best.step_time_s, 'seconds')} ({human(best.step_bytes, 'bytes')} received, "
              f"head {human(best.head_time_s, 'seconds')})")
    reason += f" vs {human(runner.step_time_s, 'seconds')} for {runner.name}." if runner else "."
    if best is not ranked[0]:
        faster = ranked[0]
        reason += (f" {faster.name} would take {human(faster.step_time_s, 'seconds')} but needs "
                   f"{human(faster.extra_memory_bytes, 'ibytes')} more per rank than {leanest.name}, "
                   f"above the {human(headroom_bytes, 'ibytes')} headroom.")
    elif best.extra_memory_bytes:
        reason += (f" It holds {human(best.extra_memory_bytes, 'ibytes')} more per rank than "
                   f"{leanest.name}, room for {human(best.kv_tokens, 'tokens')} of KV cache.")
    else:
        reason += f" It is also the leanest design ({human(best.memory_bytes, 'ibytes')} per rank)."
    return Recommendation(best.name, reason, tuple(c.name for c in ranked))


# ---------------------------------------------------------------------- units and the study
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


# The reference workload of the study: DeepSeek-V4.1-Flash, TP=8, BF16.
STUDY = Workload(vocab=129280, hidden=5120, tied=False, ranks=8, batch=256, tokens=8192)


@dataclass(frozen=True)
class StudyFigure:
    """One number of the study recomputed: ``value`` in base units, shown in ``unit`` with
    ``digits`` decimals, next to the study's printed figure (``None``: the study has none)."""

    quantity: str
    value: float
    unit: str
    digits: int
    study: str | None
    note: str = ""

    @property
    def text(self) -> str:
        return format_quantity(self.value, self.unit, self.digits)

    @property
    def agrees(self) -> bool:
        return self.study is None or self.text == self.study


def study_figures() -> list[StudyFigure]:
    """The study's reference figures recomputed from the formulas above, with its errors named."""
    s = STUDY
    V, H, n, b = s.vocab, s.hidden, s.ranks, s.weight_dtype_bytes
    full = weight_bytes(V, H, b, 1)
    shard = weight_bytes(shard_rows(V, n, pad_to=s.pad_to), H, b, 1)
    emb = embedding_exchange_bytes("all_reduce", s.tokens, H, n, b)
    gathered = logits_collection_bytes("all_gather", s.batch, V, n, 2, pad_to=s.pad_to)
    extra = 2 * (full - shard)
    F = StudyFigure
    return [
        F("one BF16 matrix, V·H·2", full, "GiB", 2, "1.23 GiB"),
        F("both matrices", 2 * full, "GiB", 2, "2.47 GiB"),
        F("TP=8 shard of one matrix", shard, "MiB", 1, "157.8 MiB"),
        F("TP=8 shards of both", 2 * shard, "MiB", 1, "315.6 MiB"),
        F("saved per matrix per rank by sharding", full - shard, "GiB", 2, "1.07 GiB",
          "rounding: 1.2329 - 0.1541 = 1.0788 GiB"),
        F("logits B=256 BF16", logits_bytes(256, V, 2), "MiB", 1, "63.1 MiB"),
        F("  TP=8 shard", logits_bytes(256, shard_rows(V, n), 2), "MiB", 1, "7.9 MiB"),
        F("logits B=256 FP32", logits_bytes(256, V, 4), "MiB", 1, "126.2 MiB"),
        F("  TP=8 shard", logits_bytes(256, shard_rows(V, n), 4), "MiB", 1, "15.8 MiB"),
        F("logits B=1024 FP32", logits_bytes(1024, V, 4), "MiB", 1, "504.8 MiB",
          "rounding: 1024·V·4 B is exactly 505 MiB (the study's text says 505); 504.8 = 8 × 63.1"),
        F("  TP=8 shard", logits_bytes(1024, shard_rows(V, n), 4), "MiB", 1, "63.1 MiB"),
        F("embedding payload M = T·H·2, T=8192", s.tokens * H * b, "MB", 1, "83.9 MB"),
        F("ring all-reduce per rank, 2(n-1)/n·M", emb, "MB", 1, "146.8 MB"),
        F("  at 300 GB/s", transfer_time(emb, s.bandwidth), "ms", 2, "0.49 ms"),
        F("embedding exchanges", 1, "per forward", 0, "1 per layer",
          "study error: the embedding runs once per forward; per-layer all-reduces are attention/MLP"),
        F("head FLOPs 2·B·V·H, B=256", head_flops(256, V, H), "GFLOP", 1, "338.9 GFLOP"),
        F("head FLOPs, B=512", head_flops(512, V, H), "GFLOP", 1, "677.8 GFLOP"),
        F("  B=256 at 600 TFLOP/s", compute_time(head_flops(256, V, H), s.flops), "ms", 2, "0.56 ms"),
        F("  B=512 at 600 TFLOP/s", compute_time(head_flops(512, V, H), s.flops), "ms", 2, "1.13 ms"),
        F("full BF16 logits B=256", logits_bytes(256, V, 2), "MB", 1, "66.2 MB"),
        F("logits all-gather received per rank", gathered, "MB", 1, "57.9 MB"),
        F("  at 300 GB/s", transfer_time(gathered, s.bandwidth), "µs", 0, "193 µs"),
        F("greedy pairs, study's B·2·n·4", s.batch * 2 * n * 4, "KB", 0, "16 KB",
          "the whole gathered fp32 (value, id) buffer, own pairs included"),
        F("greedy received per rank, (n-1)·B·(8+8)", greedy_sampling_bytes(s.batch, n), "KB", 1, None,
          "vocabpar's exact count: int64 ids, comm's all-gather model"),
        F("replication, extra per rank", extra, "GiB", 2, "2.16 GiB"),
        F("replication, extra over 8 ranks", (n - 1) * 2 * full, "GiB", 1, "17.3 GiB"),
        F("KV tokens in that extra per rank, 890 B/token", kv_tokens(extra, s.kv_bytes_per_token),
          "M tokens", 1, "24k tokens", "study error: 2.16 GiB / 890 B ≈ 2.6 M tokens, not 24k"),
    ]


def is_study_shape(w: Workload) -> bool:
    """Whether ``w`` is the study's model (so its figures apply)."""
    return (w.vocab, w.hidden, w.tied) == (STUDY.vocab, STUDY.hidden, STUDY.tied)


# ---------------------------------------------------------------------- plot
def png_path(path: str) -> str:
    """The file a plot named ``path`` is written to: ``path`` itself when it ends in ``.png``,
    ``path + '.png'`` when it has no extension; any other extension, or a name that is no file
    name (empty, ending in a separator or a dot), is a ``ValueError``."""
    suffix = Path(path).suffix
    if suffix.lower() not in ("", ".png") or not Path(path).name or path.endswith(("/", os.sep, ".")):
        raise ValueError(f"{path!r} is not a .png file name")
    return path if suffix else path + ".png"


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (``ValueError`` when missing)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("plotting needs matplotlib: pip install 'vocabpar[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str) -> str:
    """Write ``fig`` as a PNG to ``png_path(path)``, close it, and return that path."""
    target = png_path(path)
    fig.savefig(target, dpi=100, format="png")
    pyplot().close(fig)
    return target


def winners(w: Workload, latencies: list[float], bandwidths: list[float],
            designs: tuple[Design, ...] = DESIGNS) -> list[list[str]]:
    """The recommended design (:func:`recommend`, no headroom limit) for ``w`` at every
    (latency, bandwidth) of a grid: one list per latency, one name per bandwidth."""
    return [[recommend(plan(replace(w, latency=a, bandwidth=b), designs)).design for b in bandwidths]
            for a in latencies]


def plot(w: Workload, path: str, designs: tuple[Design, ...] = DESIGNS) -> str:
    """Write a PNG: decode-step bytes received per rank vs batch size and memory per rank vs
    ranks, one line per design, and the map of which design wins (:func:`winners`) over latency
    per collective and bandwidth, with ``w``'s own point marked (needs the ``plot`` extra,
    matplotlib). Returns the path written (see ``png_path``)."""
    png_path(path)  # a bad name fails before any work
    plt = pyplot()
    from matplotlib.colors import ListedColormap

    batches = [2**k for k in range(13)]
    ranks = [2**k for k in range(7)]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(19, 5))
    for i, d in enumerate(designs):
        style = {"marker": ".", "label": d.name, "linestyle": ("-", "--", ":", "-.")[i % 4]}
        left.plot(batches, [design_cost(d, replace(w, batch=b)).step_bytes for b in batches], **style)
        middle.plot(ranks, [design_cost(d, replace(w, ranks=r, dp=math.gcd(w.dp, r), skew=None if w.skew
                                                   is None else max(w.skew, 1 / r))).memory_bytes / GiB
                            for r in ranks], **style)
    left.set(xscale="log", xlabel="batch (rows needing logits)",
             ylabel="bytes received per rank per decode step",
             title=f"V={w.vocab}, H={w.hidden}, {w.ranks} ranks, dp {w.dp}")
    left.set_yscale("symlog", linthresh=1e3)
    left.set_ylim(bottom=0)
    middle.set(xlabel="ranks", ylabel="weights + logits per rank (GiB)", title=f"B={w.batch}")
    middle.set_xscale("log", base=2)
    left.legend(fontsize=7)
    for ax in (left, middle):
        ax.grid(True, which="both", alpha=0.3)
    latencies = [10 ** (-7 + k / 6) for k in range(25)]  # 0.1 us .. 1 ms per collective
    bandwidths = [10 ** (9 + k / 6) for k in range(25)]  # 1 GB/s .. 10 TB/s
    names = [d.name for d in designs]
    won = [[names.index(x) for x in row] for row in winners(w, latencies, bandwidths, designs)]
    colors = ListedColormap(plt.get_cmap("tab10").colors[: len(names)])
    right.pcolormesh(bandwidths, latencies, won, cmap=colors, vmin=-0.5, vmax=len(names) - 0.5,
                     shading="nearest")
    present = sorted({i for row in won for i in row})
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(i)) for i in present]
    right.scatter([w.bandwidth], [max(w.latency, latencies[0])], marker="*", s=200, color="black", zorder=3)
    right.legend(handles, [names[i] for i in present], fontsize=7, title_fontsize=7,
                 title="fastest decode step (★ this workload)")
    right.set(xscale="log", yscale="log", xlabel="bandwidth (bytes/s)", ylabel="latency per collective (s)",
              title=f"winner by alpha and beta: B={w.batch}, {w.sampling.describe()}")
    fig.tight_layout()
    return save_png(fig, path)
