"""The study's reference figures recomputed from the cost model's formulas (:func:`study_figures`),
each beside the figure the study printed, its errors named; :data:`STUDY`, the study's workload."""

from __future__ import annotations

from dataclasses import dataclass

from vocabpar.plan.model import (
    Workload,
    compute_time,
    embedding_exchange_bytes,
    format_quantity,
    greedy_sampling_bytes,
    head_flops,
    kv_tokens,
    logits_bytes,
    logits_collection_bytes,
    shard_rows,
    transfer_time,
    weight_bytes,
)

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
