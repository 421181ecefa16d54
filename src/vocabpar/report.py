"""The plain-text report ``vocabpar plan`` prints: the model and machine it priced, one row per
design that runs on the planned ranks, the crossover, the recommendation, and (asked for) the
study's figures, fitted to a terminal's width; and the plain-text tables the command line prints.
The numbers are the cost model's (:mod:`vocabpar.plan`); this module only words and lays them out."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

from vocabpar.plan.cost import DesignCost
from vocabpar.plan.crossover import SEARCHED, Crossover
from vocabpar.plan.host import IDS_TO_HOST
from vocabpar.plan.machine import Mode
from vocabpar.plan.model import Workload, human
from vocabpar.plan.recommend import Recommendation
from vocabpar.plan.study import StudyFigure
from vocabpar.presets import ModelShape

DEFAULT_WIDTH = 100
"""Columns the report fits when the terminal's width is unknown (not a terminal, no COLUMNS)."""
STUDY_LINE = ("the study's figures: the reference workload vocabpar was first checked against "
              "(DeepSeek-V4.1-Flash's vocabulary 129280 x 5120 at TP=8, B=256, T=8192, 300 GB/s, "
              "600 TFLOP/s), recomputed by the cost model beside the study's printed values:")
_GLUE = re.compile(r"(?<=\d) (?=[^\W\d_])")
"""The space between a number and the word after it (``20.0 µs``, ``256 rows``): never a break."""


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned plain-text table."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fit_table(header: Sequence[str], rows: Sequence[Sequence[object]], drop: Sequence[str],
              width: int | None) -> tuple[str, list[str]]:
    """:func:`format_table` without the columns of ``drop``, first ones first, until its lines
    fit ``width`` (``None``: keep all); the table and the columns left out, in drop order."""
    keep, left_out = list(header), []
    while True:
        index = [list(header).index(h) for h in keep]
        table = format_table(keep, [[row[i] for i in index] for row in rows])
        candidates = [h for h in drop if h in keep]
        if width is None or max(map(len, table.splitlines())) <= width or not candidates:
            return table, left_out
        keep.remove(candidates[0])
        left_out.append(candidates[0])


def wrap(line: str, width: int, hang: int = 2) -> str:
    """``line`` wrapped to ``width`` columns, its continuation lines indented ``hang`` spaces more
    than its own indent. A number stays with the word after it, names are not split at hyphens,
    and a word longer than the width stays whole."""
    body = line.lstrip(" ")
    indent = line[: len(line) - len(body)]
    text = textwrap.fill(_GLUE.sub("\0", body), width, initial_indent=indent,
                         subsequent_indent=f"{indent}{' ' * hang}", break_long_words=False,
                         break_on_hyphens=False)
    return text.replace("\0", " ")


def _span(typical: float, worst: float, kind: str | None = None) -> str:
    """``typical``, or ``typical..worst`` when they differ, the unit written once when shared."""
    low, high = (human(x, kind) if kind else str(x) for x in (typical, worst))
    if typical == worst:
        return low
    number, _, unit = low.rpartition(" ")
    return f"{number}..{high}" if number and high.endswith(f" {unit}") else f"{low}..{high}"


def crossover_line(c: Crossover, w: Workload) -> str:
    """One sentence: which of ``c``'s two designs is faster at which batch, and their times at
    the workload's own."""
    what = {"decode": "decode step", "verify": f"verification step ({w.spec_tokens} drafts per row)",
            "score": "prompt scoring"}[c.step]
    unit = "scored tokens" if c.step == "score" else "rows"
    shards, gather = f"{c.shards} (sampling on shards)", f"{c.gather} (collecting the logits)"
    if c.batch is None:
        where = (f"{gather} is faster than {shards} at every batch searched, {SEARCHED[0]} to "
                 f"{SEARCHED[1]:,} {unit}")
    elif c.batch == 1:
        where = f"{shards} is at least as fast as {gather} at every batch"
    else:
        where = f"{gather} is faster below {c.batch:,} {unit}, {shards} from {c.batch:,} on"
    timed = {"decode": "a decode step", "verify": "a verification step", "score": "scoring's logits path"}
    return (f"crossover, {what}: {where}. At {c.size:,} {unit}, {timed[c.step]} takes "
            f"{human(c.gather_s, 'seconds')} on {c.gather}, {human(c.shards_s, 'seconds')} on {c.shards}.")


def _graph_note(shown: list[DesignCost], best: str) -> list[str]:
    """Graph mode: which host reads a CUDA graph allows (the ids copied after the step) and which
    designs read within the step, which it does not."""
    inside = [c.name for c in shown if c.host_reads > IDS_TO_HOST.reads]
    lines = ["  graph mode: every design copies its sampled ids to the host once per step (one host read, "
             "priced), after the step's kernels, so the step itself stays one CUDA graph; the engine "
             "Sampler's failure flags ride in that copy."]
    if inside:
        one = len(inside) == 1
        names, its = ", ".join(inside[:-1]) + " and " * (not one) + inside[-1], "its" if one else "their"
        lines.append(f"  note: {names} also read{'s' * one} the host within the step, which keeps {its} "
                     f"step{'s' * (not one)} out of a CUDA graph: {its} collectives and launches then cost "
                     "the eager figures"
                     + (f", the recommended {best}'s included." if best in inside and not one else "."))
    return lines


def report_text(w: Workload, costs: list[DesignCost], rec: Recommendation, crossovers: list[Crossover],
                model: ModelShape, mode: Mode, dtypes: tuple[str, str],
                study: list[StudyFigure] | None = None, *, width: int = DEFAULT_WIDTH,
                wide: bool = False) -> str:
    """The report for ``w`` priced with ``mode``'s figures (or their overrides, held in ``w``) on
    ``model``; ``dtypes``: the weight and logits dtype names. Its lines fit ``width`` columns,
    the design table too by leaving out its least deciding columns (``wide``: every column; a
    last line names those left out). Designs that do not run on ``w``'s ranks are left out."""
    attention_tp = w.ranks // w.dp
    extra = [f"{w.spec_tokens} draft tokens per row{' with draft logits' if w.draft_logits else ''}"
             if w.spec_tokens else "", f"scoring {w.score_tokens} prompt tokens" if w.score_tokens else "",
             f"busiest rank owns {w.skew:g} of the tokens" if w.skew is not None else ""]
    kv = (model.describe_kv(attention_tp) if w.kv_bytes_per_token == model.kv_bytes_per_rank(attention_tp)
          else f"KV cache {w.kv_bytes_per_token:,.0f} B/token per rank (given)" if w.kv_bytes_per_token
          else "KV cache unknown")
    prose = [f"{model.name}: vocab {w.vocab} x hidden {w.hidden} ({'tied' if w.tied else 'untied'}), weights "
             f"{dtypes[0]}, logits {dtypes[1]}; {kv}",
             f"{w.ranks} ranks, dp {w.dp}, B={w.batch} rows/step, T={w.tokens} tokens/forward; sampling: "
             f"{w.sampling.describe()}" + "".join(f"; {e}" for e in extra if e),
             f"machine: {mode.name} mode ({mode.summary}): {human(w.latency, 'seconds')} per collective, "
             f"{human(w.launch, 'seconds')} per kernel launch, {human(w.sync, 'seconds')} per host read; "
             f"{human(w.bandwidth, 'bytes')}/s, {human(w.flops, 'flops')}/s"
             + ("; the engine Sampler's step compiled whole (its kernels counted from the compiled program)"
                if w.compiled else "")]
    for name, attr, source in (("collective", "latency", mode.latency_source), ("launch", "launch",
                               mode.launch_source), ("host read", "sync", mode.sync_source)):
        given = getattr(w, attr) != getattr(mode, attr)
        prose.append(f"  {name}: {'given on the command line' if given else source}")
    lines = [wrap(line, width) for line in prose]
    shown = [c for c in costs if c.applies]
    step = "verify" if w.spec_tokens else "step"
    embedding = f"emb/fwd({w.tokens})"
    header = ["design", "ranks", "weights", "logits", embedding, f"{step} recv", "head/rank", "coll",
              "launches", "host reads", f"{step} time", "KV forgone"]
    rows = [[c.name, c.ranks, human(c.weight_bytes, "ibytes"), human(c.logits_buffer_bytes, "ibytes"),
             human(c.embedding_bytes, "bytes"), _span(c.step_bytes, c.step_bytes_worst, "bytes"),
             human(c.head_flops, "flops"), _span(c.collectives, c.collectives_worst),
             _span(c.launches, c.launches_worst), _span(c.host_reads, c.host_reads_worst),
             _span(c.step_time_s, c.step_time_worst_s, "seconds"),
             "-" if c.kv_tokens is None else human(c.kv_tokens, "tokens")] for c in shown]
    if w.score_tokens:
        header += ["score recv", "score peak"]
        for row, c in zip(rows, shown):
            row += [human(c.score_bytes, "bytes"), human(c.score_peak_bytes, "ibytes")]
    drop = ["ranks", "head/rank", embedding, "score peak", "logits", "weights", "score recv", "KV forgone",
            "launches", "coll", "host reads", f"{step} recv"]
    table, left_out = fit_table(header, rows, drop, None if wide else width)
    notes = [f"  {c.name}: {c.summary}" for c in shown]
    if w.spec_tokens:
        notes += ["", f"  {step}: one verification step of the target (the last token and {w.spec_tokens} "
                  "drafts per row fed, verified); the draft model's own decoding left out"]
    if any(c.collectives != c.collectives_worst or c.launches != c.launches_worst for c in shown):
        notes += ["", "  a..b: typical (LLM-like peaked rows) .. worst case of the functional sampler on "
                  "shards (worst: the most measured on flat, Zipf and tied rows); the recommendation uses "
                  "the typical case"]
    notes.append("  launches, host reads: counted from each design's code path (vocabpar.plan.host), the "
                 "embedding's and the model body's left out; each design's host reads include the one copy "
                 "of its sampled ids to the host per step")
    notes += [""] + [crossover_line(c, w) for c in crossovers]
    notes += ["", f"recommendation: {rec.reason}"]
    if mode.name == "graph":
        notes += _graph_note(shown, rec.design)
    lines += ["", table, ""] + [wrap(line, width) for line in notes]
    if study:
        lines += ["", wrap(STUDY_LINE, width), format_table(("quantity", "vocabpar", "study", "check"), [
            (f.quantity, f.text, f.study or "-",
             "ok" if f.study and f.agrees else "differs" if f.study else "") for f in study])]
        lines += [wrap(f"  {f.quantity.strip()}: {f.note}", width) for f in study if f.note]
    if left_out:
        lines += ["", wrap(f"(--wide adds {', '.join(h for h in header if h in left_out)})", width)]
    return "\n".join(lines)
