"""Command line: argument parsing and printing only; the work lives in the library."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import NoReturn

from vocabpar import bench, demo, plan, plots
from vocabpar.layout import SCHEMES, VocabLayout
from vocabpar.plan.machine import DEFAULT_MODE
from vocabpar.plan.model import DTYPE_BYTES, LIMITS
from vocabpar.plan.study import study_figures
from vocabpar.presets import DEFAULT_PRESET, PRESETS, load_config, preset
from vocabpar.report import DEFAULT_WIDTH, fit_table, format_table, report_text
from vocabpar.wire.filters import FILTERS, TEMPERATURE, Filter


def _number(p: argparse.ArgumentParser, flag: str, kind: type[int] | type[float], limits: tuple[float, float],
            help: str, scale: float = 1, **kw: object) -> None:
    """Add option ``flag`` whose value (an int or a finite float) times ``scale`` must lie in
    ``limits``; the accepted range, in the option's own units, ends its help text."""
    low, high = (int(x) if kind is int else x / scale for x in limits)
    span = f"[{low}, {high}]" if kind is int else f"[{low:g}, {high:g}]"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not limits[0] <= value * scale <= limits[1]:  # NaN fails too
            raise argparse.ArgumentTypeError(
                f"must be {'an integer' if kind is int else 'a number'} in {span}, got {text!r}")
        return value

    p.add_argument(flag, type=parse, help=f"{help} {span}".lstrip(), **kw)


def _writable(text: str) -> str:
    """An argparse type: a file path that can be (over)written -- not a folder, in an existing
    writable folder."""
    path = pathlib.Path(text)
    folder = path.resolve().parent
    why = ("is a folder" if path.is_dir() or text.endswith(("/", os.sep)) else
           f"folder {str(folder)!r} does not exist" if not folder.is_dir() else
           "is not writable" if not os.access(path if path.exists() else folder, os.W_OK) else "")
    if why:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {why}")
    return text


def _png(text: str) -> str:
    """An argparse type: a writable ``.png`` path, ``.png`` appended to a name without extension."""
    try:
        return _writable(plots.png_path(_writable(text)))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_layout(args: argparse.Namespace) -> int:
    vocab = args.vocab or preset(args.preset).vocab_size
    schemes = [args.scheme] if args.scheme else list(SCHEMES)
    for scheme in schemes:
        layout = VocabLayout(vocab, args.ranks, org_vocab_size=args.org_vocab, pad_to=args.pad_to,
                             scheme=scheme)
        print(f"\n{scheme}: vocab {layout.vocab_size} (org {layout.org_vocab_size}, added "
              f"{layout.num_added}) over {layout.world_size} ranks; padded size "
              f"{layout.padded_vocab_size}")
        rows = [(s.rank, f"[{s.org_start}, {s.org_end})", s.num_org_padding,
                 f"[{s.added_start}, {s.added_end})", s.num_added_padding, s.rows)
                for s in layout.shards]
        print(format_table(("rank", "org ids", "org pad", "added ids", "added pad", "rows"), rows))
    return 0


def _temperature(args: argparse.Namespace) -> float:
    """``--temperature``, by default 1 when a filter describes a sampled step, else 0 (greedy)."""
    if args.temperature is not None:
        return args.temperature
    return 1.0 if any(getattr(args, f.name) != f.off for f in FILTERS) else 0.0


def _flag(f: Filter) -> str:
    """The command line's option for filter ``f``: ``--top-k``."""
    return "--" + f.name.replace("_", "-")


def _list_presets() -> int:
    rows = [(m.name, m.vocab_size, m.hidden_size, "tied" if m.tied else "untied", m.dtype,
             f"{m.kv_bytes_per_token:,.0f}", m.source) for m in PRESETS.values()]
    print(format_table(("preset", "vocab", "hidden", "head", "dtype", "KV B/token", "source"), rows))
    return 0


def _plan_ranks(args: argparse.Namespace) -> int:
    """``--ranks`` or its alias ``--tp`` (default 8); both given with different values is an error."""
    if args.tp is not None and args.ranks is not None and args.tp != args.ranks:
        raise ValueError(f"--tp {args.tp} and --ranks {args.ranks} disagree: --tp is another name for "
                         "--ranks (the tensor-parallel degree); give one of them")
    return next((x for x in (args.tp, args.ranks) if x is not None), 8)


def cmd_plan(args: argparse.Namespace) -> int:
    """``--config`` (a Hugging Face config.json or its folder) or ``--preset`` gives the model;
    ``--mode`` the prices of a collective, a launch and a host read, each overridable. The
    report fits the terminal's width (``COLUMNS``; 100 when not a terminal)."""
    if args.list_presets:
        return _list_presets()
    ranks = _plan_ranks(args)
    model = load_config(args.config, tied=args.tied) if args.config else preset(args.preset)
    mode = plan.mode(args.mode)
    dtypes = (args.weight_dtype or model.dtype, args.logits_dtype or model.dtype)
    if ranks % args.dp:
        raise ValueError(f"dp={args.dp} must divide ranks={ranks}")
    kv = model.kv_bytes_per_rank(ranks // args.dp) if args.kv_bytes_per_token is None \
        else args.kv_bytes_per_token

    def given(value: float | None, default: float) -> float:
        return default if value is None else value * 1e-6
    w = plan.Workload(
        vocab=model.vocab_size if args.vocab is None else args.vocab,
        hidden=model.hidden_size if args.hidden is None else args.hidden,
        tied=model.tied if args.tied is None else args.tied,
        ranks=ranks, dp=args.dp, batch=args.batch, tokens=args.tokens,
        weight_dtype_bytes=plan.dtype_bytes(dtypes[0]), logits_dtype_bytes=plan.dtype_bytes(dtypes[1]),
        bandwidth=args.bandwidth * 1e9, flops=args.flops * 1e12, memory_bandwidth=args.memory_bandwidth * 1e9,
        kv_bytes_per_token=kv, pad_to=args.pad_to,
        latency=given(args.latency_us, mode.latency), launch=given(args.launch_us, mode.launch),
        sync=given(args.sync_us, mode.sync), compiled=mode.compiled,
        sampling=plan.Sampling(_temperature(args), **{f.name: getattr(args, f.name) for f in FILTERS}),
        spec_tokens=args.spec_tokens, draft_logits=args.draft_logits, score_tokens=args.score_tokens,
        score_top_n=args.score_top_n, skew=args.skew)
    costs = plan.plan(w)
    rec = plan.recommend(costs, None if args.headroom is None else args.headroom * plan.GiB)
    crossovers = plan.crossovers(w)
    study = study_figures() if args.study else []
    if args.plot:
        print(f"wrote {plots.plot_plan(w, args.plot)}", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": asdict(model) | {"kv_bytes_per_token": model.kv_bytes_per_token},
                          "mode": asdict(mode), "workload": asdict(w), "designs": [asdict(c) for c in costs],
                          "crossovers": [asdict(c) for c in crossovers], "recommendation": asdict(rec),
                          "study": [asdict(f) | {"text": f.text, "agrees": f.agrees} for f in study]},
                         indent=2))
        return 0
    width = shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    print(report_text(w, costs, rec, crossovers, model, mode, dtypes, study, width=width, wide=args.wide))
    return 0


def _bytes(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"


def _range(typical: float, worst: float, show=_bytes) -> str:
    return show(typical) if typical == worst else f"{show(typical)}..{show(worst)}"


WIDTH = 120
"""Columns a default table fits in; ``--wide`` shows every column."""


def _torchrun_ranks(asked: int | None, default: int) -> int:
    """``--ranks``: under torchrun its world (asking for another count is an error), else
    ``asked`` or ``default``."""
    from vocabpar import launch

    if not launch.under_torchrun():
        return default if asked is None else asked
    world = int(os.environ["WORLD_SIZE"])
    if asked is not None and asked != world:
        raise ValueError(f"--ranks {asked} but torchrun started {world} processes: drop --ranks, or start "
                         f"torchrun with --nproc-per-node {asked}")
    return world


def cmd_demo(args: argparse.Namespace) -> int:
    """Exit status 1 when any design's tokens differ from the reference; traffic outside the
    planner's prediction is reported, not fatal."""
    from vocabpar import comm

    ranks = _torchrun_ranks(args.ranks, 4)
    result = demo.run_demo(args.model, ranks, args.batch, args.tokens, progress=not args.quiet)
    status = 0 if result.tokens_agree else 1
    if comm.rank() != 0:  # under torchrun, rank 0 reports
        return status
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return status
    print(f"\n{result.model}: vocab {result.vocab} x hidden {result.hidden} "
          f"({'tied' if result.tied else 'untied'}), {result.ranks} ranks, batch {result.batch}, "
          f"{result.tokens} new tokens; single-process reference "
          f"{result.reference_ms_per_step:.1f} ms/step\n")
    table_rows = [(r.design, r.mode, f"{r.equal}/{r.rows}", _bytes(r.measured),
             _range(r.predicted, r.predicted_worst), f"{r.collectives:g}",
             _range(r.collectives_predicted, r.collectives_worst, "{:g}".format),
             "yes" if r.planner_agrees else "NO", f"{r.host_reads:.0f}", _bytes(r.id_bytes),
             f"{r.ms_per_step:.1f}",
             f"{r.peak_rss_mib:.0f}", f"{r.weights_mib:.2f}",
             "-" if r.acceptance is None else f"{r.acceptance:.2f}") for r in result.rows]
    table, left_out = fit_table(
        ("design", "mode", "equal", "recv B/step", "planner B/step", "coll/step", "planner coll", "= planner",
         "reads/step", "ids B/step", "ms/step", "peak RSS MiB", "vocab MiB/rank", "accepted"), table_rows,
        drop=("peak RSS MiB", "vocab MiB/rank", "ids B/step", "planner coll", "ms/step", "coll/step"),
        width=None if args.wide else WIDTH)
    print(table)
    if left_out:
        print(textwrap.fill(f"(--wide adds {', '.join(left_out)}; --json: everything as data)", WIDTH))
    print("\n" + "\n".join((
        "equal: rows matching reference_sample with the same seeds (greedy: also transformers' generate;",
        "spec-*: the speculative loop in one process, gathering).",
        "recv, coll: bytes the busiest rank received and collectives it took part in per decode step",
        "(vocabpar.comm counters; the exchange of sampled ids counts as a collective, its bytes shown",
        "apart: ids B/step, with --wide).",
        "planner: its prediction for the same shapes and ownership counts, typical..worst where sampling on",
        "shards depends on the data; = planner: every step within it (equal where deterministic).",
        f"spec-*: speculative decoding, {demo.SPEC_TOKENS} drafts per step from a draft model "
        "(demo.build_draft), verified on shards",
        "or after gathering; a step is a verification step, the draft model's own traffic left out;",
        "accepted: drafts kept / proposed.",
        "reads/step: host reads of device values per step, whole step (model included; each one a device",
        "synchronisation on a GPU): vocabpar-engine's sampler makes one (its failure flags).")))
    agree = sum(r.planner_agrees for r in result.rows)
    print(f"\ntokens: {'every design agrees' if result.tokens_agree else 'SOME DESIGNS DIFFER'}; planner: "
          f"{agree} of {len(result.rows)} rows within its prediction (bytes and collectives)")
    return status


def cmd_score(args: argparse.Namespace) -> int:
    """Exit status 1 when the sharded scores differ from the single-process model's."""
    from vocabpar import comm

    ids = None if args.ids is None else _id_list(args.ids)
    result = demo.run_score(args.model, _torchrun_ranks(args.ranks, 4), ids, args.length, args.top_n)
    status = 0 if result.agrees else 1
    if comm.rank() != 0:
        return status
    print(f"{result.model}, {result.ranks} ranks: log-probabilities of the prompt's tokens "
          f"1..{len(result.ids) - 1} (sharded embedding and head; logits never gathered)\n")
    rows = [(i + 1, token, f"{lp:.5f}", f"{ref:.5f}", rank,
             " ".join(f"{t}:{v:.2f}" for t, v in zip(top, top_lp)))
            for i, (token, lp, ref, rank, top, top_lp) in enumerate(zip(
                result.ids[1:], result.logprobs, result.reference, result.token_ranks, result.top_ids,
                result.top_logprobs))]
    print(format_table(("pos", "token", "logprob", "single-process", "rank", f"top-{args.top_n}"), rows))
    print(f"\nperplexity {result.perplexity:.2f}; largest difference from the single-process model "
          f"{result.max_error:.2e} ({'within' if result.agrees else 'ABOVE'} {result.tolerance:g})")
    return status


def cmd_warm(args: argparse.Namespace) -> int:
    """Compile the passes named (or all) into the store of compiled passes: exit 1 if one could
    not compile; ``ValueError`` (exit 2) for an unknown name, before anything compiles."""
    import torch

    from vocabpar.kernels import store, warm

    names = warm.checked(args.passes.split(",") if args.passes else None)
    threads = args.threads or torch.get_num_threads()
    jobs = args.jobs or os.cpu_count() or 1
    print(f"compiling {len(names)} pass{'es' if len(names) > 1 else ''} for processes of {threads} "
          f"thread(s), {jobs} at a time, into {store.directory()}", flush=True)
    start = time.perf_counter()
    seconds = warm.warm_in_processes(names, jobs, threads)
    print(format_table(("pass", "seconds"), [(name, "FAILED" if s is None else f"{s:.1f}")
                                            for name, s in seconds.items()]))
    failed = [name for name, s in seconds.items() if s is None]
    if failed:
        print(f"\nvocabpar warm: {', '.join(failed)} could not compile (see the warnings above): they "
              f"run eager, with the same results, only slower", file=sys.stderr)
        return 1
    print(f"\n{time.perf_counter() - start:.0f} s in all. A process of {threads} thread(s) on this machine "
          f"now loads these passes from the store instead of compiling them; another thread count "
          f"compiles anew.")
    return 0


def _id_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--ids must be comma-separated integers, got {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    """``--out`` and ``--plot`` were checked writable when parsed, before minutes of benchmarks.
    ``--plot`` runs the demo alone and plots it."""
    if args.plot:
        print("running the demo (about a minute) ...", file=sys.stderr, flush=True)
        print(f"wrote {plots.plot_demo(demo.run_demo(progress=False), args.plot)}")
        return 0
    failed = bench.run(bench.find_scripts(args.dir, args.only), quick=args.quick, out=args.out)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr, exit code 2, with a suggestion for a misspelt
    option or command."""

    known: tuple[str, ...] = ()  # every option and command of the whole command line (build_parser)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{_suggestion(message, self.known)}\n")


def _suggestion(message: str, known: Sequence[str]) -> str:
    """"; did you mean --ranks?" for the first unknown word of an argparse error that is close
    to a known option or command."""
    import difflib
    import re

    if message.startswith("unrecognized arguments: "):
        words = [w.split("=")[0] for w in message.split(": ", 1)[1].split() if w.startswith("-")]
    else:
        words = re.findall(r"invalid choice: '([^']*)'", message)
    for word in words:
        close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
        if close:
            return f"; did you mean {close[0]}?"
    return ""


def build_parser() -> argparse.ArgumentParser:
    """Every numeric option has a documented range (``plan.model.LIMITS``, ``demo.LIMITS``) checked at
    parse time: a bad value exits 2 with one line naming the option and the value."""
    L, D = LIMITS, demo.LIMITS
    parser = _Parser(
        prog="vocabpar", description="Vocabulary-parallel embedding, LM head, logits and sampling.")
    parser.add_argument("--version", action="version", version=f"vocabpar {bench.version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("layout", help="show how a vocabulary is split over ranks")
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    _number(p, "--vocab", int, L["vocab"], "vocabulary size (overrides --preset)")
    _number(p, "--org-vocab", int, L["vocab"], "org (original, non-added) vocabulary size; the rest is "
            "added vocab")
    _number(p, "--ranks", int, L["ranks"], "ranks sharing the vocabulary", default=8)
    _number(p, "--pad-to", int, L["pad_to"], "padding multiple (padded scheme)", default=64)
    p.add_argument("--scheme", choices=SCHEMES, help="one scheme (default: all)")
    p.set_defaults(func=cmd_layout)
    p = sub.add_parser("plan", help="price every vocabulary design for a model and workload")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", default=DEFAULT_PRESET, help="a known model (see --list-presets; default "
                       f"{DEFAULT_PRESET})")
    model.add_argument("--config", metavar="PATH", help="a Hugging Face config.json, or a folder holding one")
    p.add_argument("--list-presets", action="store_true", help="list the presets with their sources and exit")
    _number(p, "--vocab", int, L["vocab"], "vocabulary size (overrides the model's)")
    _number(p, "--hidden", int, L["hidden"], "hidden size (overrides the model's)")
    tied = p.add_mutually_exclusive_group()
    tied.add_argument("--tied", dest="tied", action="store_true", default=None, help="one shared matrix")
    tied.add_argument("--untied", dest="tied", action="store_false", help="embedding and head separate")
    _number(p, "--ranks", int, L["ranks"], "ranks sharing the vocabulary, the tensor-parallel degree "
            "(default 8). The one-device llama.cpp design applies at 1 only: at other counts it is left "
            "out of the table and the recommendation, and --json marks it \"applies\": false")
    _number(p, "--tp", int, L["ranks"], "another name for --ranks")
    _number(p, "--dp", int, L["dp"], "data-parallel attention groups, dividing --ranks (1 = attention TP)",
            default=1)
    _number(p, "--batch", int, L["batch"], "rows needing logits per step", default=256)
    _number(p, "--tokens", int, L["tokens"], "tokens per forward (embedding)", default=8192)
    for what in ("weight", "logits"):
        p.add_argument(f"--{what}-dtype", type=str.lower, choices=DTYPE_BYTES,
                       help=f"{what} element type (default: the model's)")
    _number(p, "--bandwidth", float, L["bandwidth"], "interconnect GB/s", scale=1e9, default=300.0)
    p.add_argument("--mode", default=DEFAULT_MODE, choices=plan.MODES,
                   help="how collectives run, which sets the next three figures: " + "; ".join(
                       f"{m.name}: {m.summary}" for m in plan.MODES.values())
                   + f" (default {DEFAULT_MODE})")
    _number(p, "--latency-us", float, L["latency"], "microseconds per collective (default: the mode's)",
            scale=1e-6)
    _number(p, "--launch-us", float, L["launch"], "microseconds per kernel launch (default: the mode's)",
            scale=1e-6)
    _number(p, "--sync-us", float, L["sync"], "microseconds per host read of a device value (default: the "
            "mode's)", scale=1e-6)
    _number(p, "--flops", float, L["flops"], "effective TFLOP/s", scale=1e12, default=600.0)
    _number(p, "--memory-bandwidth", float, L["memory_bandwidth"], "GB/s a rank reads its weights at (the "
            "head's floor at decode)", scale=1e9, default=3350.0)
    _number(p, "--kv-bytes-per-token", float, L["kv_bytes_per_token"], "KV cache bytes per token and rank "
            "(default: from the model)")
    _number(p, "--pad-to", int, L["pad_to"], "vocab padding multiple (padded scheme)", default=64)
    _number(p, "--headroom", float, L["headroom"], "GiB per rank available for extra memory",
            scale=plan.GiB)
    _number(p, "--temperature", float, TEMPERATURE, "sampling temperature of a decode step (0 = greedy; "
            "default 1 with a filter on, else 0)")
    for f in FILTERS:
        _number(p, _flag(f), f.kind, f.limits, f"{f.label} of a sampled step ({f.off:g} = off)",
                default=f.off)
    _number(p, "--spec-tokens", int, L["spec_tokens"], "draft tokens verified per row and step "
            "(speculative decoding; 0 = off)", default=0)
    p.add_argument("--draft-logits", action="store_true",
                   help="the drafts come with the draft model's logits (sampled verification)")
    _number(p, "--score-tokens", int, L["score_tokens"], "prompt tokens scored (prompt logprobs; 0 = off)",
            default=0)
    _number(p, "--score-top-n", int, L["score_top_n"], "top alternatives returned per scored token",
            default=0)
    _number(p, "--skew", float, L["skew"], "share of a forward's tokens owned by the busiest rank, at least "
            "1/ranks (default: balanced)")
    p.add_argument("--json", action="store_true", help="print plain data in base units")
    p.add_argument("--wide", action="store_true", help="every column of the design table (default: the "
                   "columns that fit the terminal's width, COLUMNS, or 100 when not a terminal)")
    p.add_argument("--study", action="store_true",
                   help="also print the study's reference figures recomputed by the cost model")
    p.add_argument("--plot", metavar="FILE.png", type=_png,
                   help="write step time and bytes vs batch (crossover marked), memory vs ranks, and the map "
                        "of which design wins over latency and bandwidth (.png appended if missing)")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("demo", help="generate with a Hugging Face model through every design on local ranks")
    p.add_argument("--model", default="gpt2", choices=demo.MODELS,
                   help="embedded seeded model (no downloads)")
    _number(p, "--ranks", int, D["ranks"], "local ranks, one process each (default 4; under torchrun "
            "its processes)")
    _number(p, "--batch", int, D["batch"], "prompts per batch", default=4)
    _number(p, "--tokens", int, D["tokens"], "new tokens per prompt", default=8)
    p.add_argument("--json", action="store_true", help="print the table as data")
    p.add_argument("--wide", action="store_true", help=f"every column (default: fit {WIDTH} columns)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("score", help="per-token log-probabilities and perplexity of a prompt on local ranks")
    p.add_argument("--model", default="gpt2", choices=demo.MODELS,
                   help="embedded seeded model (no downloads)")
    _number(p, "--ranks", int, D["ranks"], "local ranks, one process each (default 4; under torchrun "
            "its processes)")
    _number(p, "--length", int, D["length"], "random prompt length (seeded)", default=16)
    p.add_argument("--ids", help="the prompt as comma-separated token ids (instead of a random one)")
    _number(p, "--top-n", int, D["top_n"], "top alternatives shown per token", default=3)
    p.set_defaults(func=cmd_score)
    p = sub.add_parser("bench", help="run the benchmark scripts (bench_*.py) and print their tables",
                       description="Run the benchmark scripts one after another (about 15 minutes on 2 "
                                   "cores; --quick: about 1 minute, 2-3 on a busy machine, its sampler "
                                   "passes never compiled), with progress and an estimate on stderr; each "
                                   "prints its tables within 100 columns and a bottom line, and a summary "
                                   "of the bottom lines and the total time ends the run.")
    p.add_argument("--dir", help="folder holding bench_*.py (default: ./benchmarks, else the source checkout "
                                 "vocabpar is installed from)")
    p.add_argument("--only", help="run one script, e.g. 'embedding' or 'bench_embedding'")
    p.add_argument("--quick", action="store_true",
                   help="every benchmark at small sizes (2 ranks, V=8192): a smoke test, ratios indicative")
    p.add_argument("--out", metavar="FILE.md", type=_writable,
                   help="also write the tables (markdown, with the columns left out to fit 100 columns) "
                        "here, rewritten as each benchmark finishes")
    p.add_argument("--plot", metavar="FILE.png", type=_png,
                   help="instead of the benchmarks, run the demo and plot bytes and time per design "
                        "(.png appended if missing)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("warm", help="compile the sampler's local passes ahead of serving",
                       description="Compile every local pass of the samplers, in every calling convention, "
                                   "into the store of compiled passes (VOCABPAR_PASS_STORE, by default in "
                                   "Inductor's cache directory), so that a later process's first call "
                                   "loads them in milliseconds instead of compiling (about a minute). The "
                                   "store serves processes with the same number of threads only.")
    _number(p, "--threads", int, (1, 1024), "threads of the processes that will use the store (default: "
            "torch's default here)")
    _number(p, "--jobs", int, (1, 256), "processes compiling side by side (default: one per core)")
    p.add_argument("--passes", help="comma-separated pass names (default: all; a wrong name lists them)")
    p.set_defaults(func=cmd_warm)
    _Parser.known = tuple(sub.choices) + tuple(
        option for q in (parser, *sub.choices.values()) for option in q._option_string_actions)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: the command's, or 2 for bad arguments (one line on stderr)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: 2 for bad arguments, 0 for --help
        return e.code if isinstance(e.code, int) else 2
    try:
        status = args.func(args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:  # `vocabpar plan | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 0
    except (ValueError, OSError) as e:
        print(f"vocabpar {args.command}: error: {e}", file=sys.stderr)
        return 2
