"""The planner's answers for people: which design to use and why (:func:`recommend`, and
:func:`winners` over a grid of latencies and bandwidths), quantities in readable units
(:func:`human`, :func:`format_quantity`), and the study's reference figures recomputed from the
cost model (:func:`study_figures`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from vocabpar.plan.cost import DesignCost, plan
from vocabpar.plan.model import (
    DESIGNS,
    Design,
    GiB,
    KiB,
    MiB,
    Workload,
    check_limit,
    compute_time,
    embedding_exchange_bytes,
    greedy_sampling_bytes,
    head_flops,
    kv_tokens,
    logits_bytes,
    logits_collection_bytes,
    shard_rows,
    transfer_time,
    weight_bytes,
)


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
    step = "verification" if best.step == "verify" else "decode"
    reason = (f"{best.name} has the shortest estimated {step} step"
              f"{' within the headroom' if best is not ranked[0] else ''}: "
              f"{human(best.step_time_s, 'seconds')} ({human(best.step_bytes, 'bytes')} received in "
              f"{best.collectives} collectives, {best.launches} launches, {best.host_reads} host reads, "
              f"head {human(best.head_time_s, 'seconds')})")
    reason += f" vs {human(runner.step_time_s, 'seconds')} for {runner.name}." if runner else "."
    if best is not ranked[0]:
        faster = ranked[0]
        reason += (f" {faster.name} would take {human(faster.step_time_s, 'seconds')} but needs "
                   f"{human(faster.extra_memory_bytes, 'ibytes')} more per rank than {leanest.name}, "
                   f"above the {human(headroom_bytes, 'ibytes')} headroom.")
    elif best.extra_memory_bytes:
        room = "" if best.kv_tokens is None else f", room for {human(best.kv_tokens, 'tokens')} of KV cache"
        reason += (f" It holds {human(best.extra_memory_bytes, 'ibytes')} more per rank than "
                   f"{leanest.name}{room}.")
    else:
        reason += f" It is also the leanest design ({human(best.memory_bytes, 'ibytes')} per rank)."
    return Recommendation(best.name, reason, tuple(c.name for c in ranked))


def winners(w: Workload, latencies: list[float], bandwidths: list[float],
            designs: tuple[Design, ...] = DESIGNS) -> list[list[str]]:
    """The recommended design (:func:`recommend`, no headroom limit) for ``w`` at every
    (latency, bandwidth) of a grid: one list per latency, one name per bandwidth."""
    return [[recommend(plan(replace(w, latency=a, bandwidth=b), designs)).design for b in bandwidths]
            for a in latencies]


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
STUDY = Workload(vocab=129280, hidden=5120, tied=False, ranks=8, batch=256, tokens=8192,
                 kv_bytes_per_token=890)


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
    """The study's reference figures recomputed from the cost model's formulas, with its errors
    named."""
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

