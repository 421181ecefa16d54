"""The plain-text report ``vocabpar plan`` prints: the model and machine it priced, one row per
design, the crossover, the recommendation, and (asked for) the study's figures."""

from __future__ import annotations

from collections.abc import Sequence

from vocabpar.plan.cost import DesignCost
from vocabpar.plan.crossover import GATHER, SHARDS, Crossover
from vocabpar.plan.machine import Mode
from vocabpar.plan.model import Workload
from vocabpar.plan.report import Recommendation, StudyFigure, human
from vocabpar.presets import ModelShape

STUDY_LINE = ("the study's figures: the reference workload vocabpar was first checked against "
              "(DeepSeek-V4.1-Flash's vocabulary 129280 x 5120 at TP=8, B=256, T=8192, 300 GB/s, "
              "600 TFLOP/s), recomputed by the cost model beside the study's printed values:")


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned plain-text table."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _span(typical: float, worst: float, kind: str | None = None) -> str:
    shown = [human(x, kind) if kind else str(x) for x in (typical, worst)]
    return shown[0] if typical == worst else f"{shown[0]}..{shown[1]}"


def crossover_line(c: Crossover, w: Workload) -> str:
    """One sentence: where gathering stops beating sampling on shards for ``c``'s step."""
    what = {"decode": "decode step", "verify": f"verification step ({w.spec_tokens} drafts per row)",
            "score": "prompt scoring"}[c.step]
    unit = "scored tokens" if c.step == "score" else "rows"
    if c.batch is None:
        where = f"gathering ({GATHER}) beats sampling on shards ({SHARDS}) at every batch"
    elif c.batch == 1:
        where = f"sampling on shards ({SHARDS}) is at least as fast as gathering ({GATHER}) at every batch"
    else:
        where = f"gathering ({GATHER}) beats sampling on shards ({SHARDS}) below {c.batch} {unit}"
    return (f"crossover, {what}: {where}; at {c.size} {unit}, logits path {human(c.gather_s, 'seconds')} "
            f"gathering vs {human(c.shards_s, 'seconds')} on shards")


def report_text(w: Workload, costs: list[DesignCost], rec: Recommendation, crossovers: list[Crossover],
                model: ModelShape, mode: Mode, dtypes: tuple[str, str],
                study: list[StudyFigure] | None = None) -> str:
    """The report for ``w`` priced with ``mode``'s figures (or their overrides, held in ``w``) on
    ``model``; ``dtypes``: the weight and logits dtype names."""
    attention_tp = w.ranks // w.dp
    extra = [f"{w.spec_tokens} draft tokens per row{' with draft logits' if w.draft_logits else ''}"
             if w.spec_tokens else "", f"scoring {w.score_tokens} prompt tokens" if w.score_tokens else "",
             f"busiest rank owns {w.skew:g} of the tokens" if w.skew is not None else ""]
    kv = (model.describe_kv(attention_tp) if w.kv_bytes_per_token == model.kv_bytes_per_rank(attention_tp)
          else f"KV cache {w.kv_bytes_per_token:,.0f} B/token per rank (given)" if w.kv_bytes_per_token
          else "KV cache unknown")
    lines = [f"{model.name}: vocab {w.vocab} x hidden {w.hidden} ({'tied' if w.tied else 'untied'}), weights "
             f"{dtypes[0]}, logits {dtypes[1]}; {kv}",
             f"{w.ranks} ranks, dp {w.dp}, B={w.batch} rows/step, T={w.tokens} tokens/forward; sampling: "
             f"{w.sampling.describe()}" + "".join(f"; {e}" for e in extra if e),
             f"machine: {mode.name} mode ({mode.summary}): {human(w.latency, 'seconds')} per collective, "
             f"{human(w.launch, 'seconds')} per kernel launch, {human(w.sync, 'seconds')} per host read; "
             f"{human(w.bandwidth, 'bytes')}/s, {human(w.flops, 'flops')}/s"]
    for name, attr, source in (("collective", "latency", mode.latency_source), ("launch", "launch",
                               mode.launch_source), ("host read", "sync", mode.sync_source)):
        given = getattr(w, attr) != getattr(mode, attr)
        lines.append(f"  {name}: {'given on the command line' if given else source}")
    step = "verify" if w.spec_tokens else "step"
    header = ["design", "ranks", "weights", "logits", f"emb/fwd({w.tokens})", f"{step} recv", "head/rank",
              "coll", "launches", "host reads", f"{step} time", "KV forgone"]
    rows = [[c.name, c.ranks, human(c.weight_bytes, "ibytes"), human(c.logits_buffer_bytes, "ibytes"),
             human(c.embedding_bytes, "bytes"), _span(c.step_bytes, c.step_bytes_worst, "bytes"),
             human(c.head_flops, "flops"), _span(c.collectives, c.collectives_worst),
             _span(c.launches, c.launches_worst), _span(c.host_reads, c.host_reads_worst),
             _span(c.step_time_s, c.step_time_worst_s, "seconds"),
             "-" if c.kv_tokens is None else human(c.kv_tokens, "tokens")] for c in costs]
    if w.score_tokens:
        header += ["score recv", "score peak"]
        for row, c in zip(rows, costs):
            row += [human(c.score_bytes, "bytes"), human(c.score_peak_bytes, "ibytes")]
    lines += ["", format_table(header, rows), ""]
    lines += [f"  {c.name}: {c.summary}" for c in costs]
    if w.spec_tokens:
        lines.append(f"\n  {step}: one verification step of the target (the last token and {w.spec_tokens} "
                     "drafts per row fed, verified); the draft model's own decoding left out")
    if any(c.collectives != c.collectives_worst or c.launches != c.launches_worst for c in costs):
        lines.append("\n  a..b: typical (LLM-like peaked rows) .. worst case of the functional sampler on "
                     "shards (worst: the most measured on flat, Zipf and tied rows); the recommendation "
                     "uses the typical case")
    lines.append("  launches, host reads: counted from each design's code path (vocabpar.plan.host); the "
                 "embedding's and the model body's left out")
    lines += [""] + [crossover_line(c, w) for c in crossovers]
    lines.append(f"\nrecommendation: {rec.reason}")
    best = next(c for c in costs if c.name == rec.design)
    if mode.name == "graph" and best.host_reads:
        lines.append(f"  note: {best.name} reads the host {best.host_reads} times per step, which keeps that "
                     "step out of a CUDA graph; its collectives then cost the eager figure")
    if study:
        lines += ["", STUDY_LINE, format_table(("quantity", "vocabpar", "study", "check"), [
            (f.quantity, f.text, f.study or "-",
             "ok" if f.study and f.agrees else "differs" if f.study else "") for f in study])]
        lines += [f"  {f.quantity.strip()}: {f.note}" for f in study if f.note]
    return "\n".join(lines)
