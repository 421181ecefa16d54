"""Command line: argument parsing and printing only; the work lives in the library."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import NoReturn

from vocabpar import plan
from vocabpar.layout import SCHEMES, VocabLayout
from vocabpar.presets import DEFAULT_PRESET, PRESETS, preset


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned plain-text table."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_layout(args: argparse.Namespace) -> int:
    vocab = args.vocab or preset(args.preset).vocab_size
    schemes = [args.scheme] if args.scheme else list(SCHEMES)
    for scheme in schemes:
        layout = VocabLayout(vocab, args.ranks, org_vocab_size=args.org_vocab, pad_to=args.pad_to,
                             scheme=scheme)
        print(f"\n{scheme}: vocab {layout.vocab_size} (base {layout.org_vocab_size}, added "
              f"{layout.num_added}) over {layout.world_size} ranks; padded size "
              f"{layout.padded_vocab_size}")
        rows = [(s.rank, f"[{s.org_start}, {s.org_end})", s.num_org_padding,
                 f"[{s.added_start}, {s.added_end})", s.num_added_padding, s.rows)
                for s in layout.shards]
        print(format_table(("rank", "base ids", "base pad", "added ids", "added pad", "rows"), rows))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    shape = preset(args.preset)
    w = plan.Workload(
        vocab=shape.vocab_size if args.vocab is None else args.vocab,
        hidden=shape.hidden_size if args.hidden is None else args.hidden,
        tied=shape.tied if args.tied is None else args.tied,
        ranks=args.ranks, dp=args.dp, batch=args.batch, tokens=args.tokens,
        weight_dtype_bytes=plan.dtype_bytes(args.weight_dtype),
        logits_dtype_bytes=plan.dtype_bytes(args.logits_dtype),
        bandwidth=args.bandwidth * 1e9, flops=args.flops * 1e12,
        kv_bytes_per_token=args.kv_bytes_per_token, pad_to=args.pad_to)
    costs = plan.plan(w)
    rec = plan.recommend(costs, None if args.headroom is None else args.headroom * plan.GiB)
    study = plan.study_figures() if plan.is_study_shape(w) else []
    if args.plot:
        plan.plot(w, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps({"workload": asdict(w), "designs": [asdict(c) for c in costs],
                          "recommendation": asdict(rec),
                          "study": [asdict(f) | {"text": f.text, "agrees": f.agrees} for f in study]},
                         indent=2))
        return 0
    h = plan.human
    print(f"{w.vocab} vocab x {w.hidden} hidden ({'tied' if w.tied else 'untied'}), {w.ranks} ranks, "
          f"dp {w.dp}, B={w.batch} rows/step, T={w.tokens} tokens/forward, weights "
          f"{args.weight_dtype}, logits {args.logits_dtype}, {h(w.bandwidth, 'bytes')}/s, "
          f"{h(w.flops, 'flops')}/s\n")
    rows = [(c.name, c.ranks, h(c.weight_bytes, "ibytes"), h(c.logits_buffer_bytes, "ibytes"),
             h(c.embedding_bytes, "bytes"), h(c.step_bytes, "bytes"), h(c.head_flops, "flops"),
             h(c.step_time_s, "seconds"), h(c.kv_tokens, "tokens")) for c in costs]
    print(format_table(("design", "ranks", "weights", "logits", f"emb/fwd({w.tokens})", "step recv",
                        "head/rank", "step time", "KV forgone"), rows))
    print("\n" + "\n".join(f"  {c.name}: {c.summary}" for c in costs))
    print(f"\nrecommendation: {rec.reason}")
    if study:
        print("\nthe study's numbers (SPEC section 1: TP=8, B=256, T=8192, 300 GB/s, 600 TFLOP/s):")
        print(format_table(("quantity", "vocabpar", "study", "check"),
                           [(f.quantity, f.text, f.study or "-",
                             "ok" if f.study and f.agrees else "differs" if f.study else "")
                            for f in study]))
        print("\n".join(f"  {f.quantity.strip()}: {f.note}" for f in study if f.note))
    return 0


def _bytes(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"


def cmd_demo(args: argparse.Namespace) -> int:
    """Exit status 1 when any design's tokens differ from the reference; byte differences from
    the planner are reported, not fatal."""
    from vocabpar import comm
    from vocabpar.demo import run_demo

    result = run_demo(args.model, args.ranks, args.batch, args.tokens, progress=not args.quiet)
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
    rows = [(r.design, r.mode, f"{r.equal}/{r.rows}", _bytes(r.measured), _bytes(r.predicted),
             "-" if r.bytes_agree is None else "yes" if r.bytes_agree
             else f"{r.measured - r.predicted:+,.0f}",
             _bytes(r.id_bytes), f"{r.ms_per_step:.1f}", f"{r.peak_rss_mib:.0f}", f"{r.weights_mib:.2f}")
            for r in result.rows]
    print(format_table(("design", "mode", "tokens equal", "recv B/step", "planner B/step", "= planner",
                        "ids B/step", "ms/step", "peak RSS MiB", "vocab MiB/rank"), rows))
    print("\ntokens equal: rows matching transformers' generate (greedy) or reference_sample with the same "
          "seeds\n(sampled). recv: bytes the busiest rank received per decode step (vocabpar.comm counters),"
          "\nthe exchange of sampled ids shown apart (the planner leaves it out). planner: its formulas for "
          "the\nsame shapes and ownership counts ('-': sharded sampling beyond greedy has no formula).")
    checked = [r for r in result.rows if r.predicted is not None]
    equal = sum(r.bytes_agree for r in checked)
    print(f"\ntokens: {'every design agrees' if result.tokens_agree else 'SOME DESIGNS DIFFER'}; bytes: "
          f"{equal} of {len(checked)} rows with a planner formula equal it "
          f"({len(result.rows) - len(checked)} without a formula)")
    return status


def cmd_bench(args: argparse.Namespace) -> int:
    import pathlib
    import subprocess

    scripts = sorted(pathlib.Path(args.dir).glob("bench_*.py"))
    if args.only:
        scripts = [p for p in scripts if p.stem in (args.only, f"bench_{args.only}")]
    if not scripts:
        raise ValueError(f"no benchmark scripts bench_*.py{' named ' + args.only if args.only else ''} "
                         f"in {args.dir!r}")
    for target in (args.out, args.plot):  # fail before minutes of benchmarks, not after
        if target and not pathlib.Path(target).resolve().parent.is_dir():
            raise ValueError(f"cannot write {target!r}: its folder does not exist")
    failed, report = [], []
    for script in scripts:
        print(f"\n== {script} ==", flush=True)
        done = subprocess.run([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        print(done.stdout, end="", flush=True)
        report.append(f"### `{sys.executable} {script}`\n\n{done.stdout}")
        if done.returncode:
            failed.append(script.name)
    if args.out:
        pathlib.Path(args.out).write_text("\n".join(report))
    if args.plot:
        from vocabpar.demo import plot, run_demo

        plot(run_demo(progress=False), args.plot)
        print(f"\nwrote {args.plot}")
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vocabpar", description="Vocabulary-parallel embedding, LM head, logits and sampling.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("layout", help="show how a vocabulary is split over ranks")
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--vocab", type=_positive, help="vocabulary size (overrides --preset)")
    p.add_argument("--org-vocab", type=_positive, help="base vocabulary size (rest is added vocab)")
    p.add_argument("--ranks", type=_positive, default=8)
    p.add_argument("--pad-to", type=_positive, default=64)
    p.add_argument("--scheme", choices=SCHEMES, help="one scheme (default: all)")
    p.set_defaults(func=cmd_layout)
    p = sub.add_parser("plan", help="price every vocabulary design for a model and workload")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"model shape ({', '.join(PRESETS)})")
    p.add_argument("--vocab", type=int, help="vocabulary size (overrides the preset)")
    p.add_argument("--hidden", type=int, help="hidden size (overrides the preset)")
    tied = p.add_mutually_exclusive_group()
    tied.add_argument("--tied", dest="tied", action="store_true", default=None, help="one shared matrix")
    tied.add_argument("--untied", dest="tied", action="store_false", help="embedding and head separate")
    p.add_argument("--ranks", type=int, default=8, help="ranks sharing the vocabulary (TP degree)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel attention groups (1 = attention TP)")
    p.add_argument("--batch", type=int, default=256, help="rows needing logits per step")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per forward (embedding)")
    p.add_argument("--weight-dtype", default="bf16", help=f"one of {', '.join(plan.DTYPE_BYTES)}")
    p.add_argument("--logits-dtype", default="bf16", help=f"one of {', '.join(plan.DTYPE_BYTES)}")
    p.add_argument("--bandwidth", type=float, default=300.0, help="interconnect GB/s")
    p.add_argument("--flops", type=float, default=600.0, help="effective TFLOP/s")
    p.add_argument("--kv-bytes-per-token", type=float, default=890.0, help="KV cache bytes per token")
    p.add_argument("--pad-to", type=int, default=64, help="vocab padding multiple (padded scheme)")
    p.add_argument("--headroom", type=float, help="GiB per rank available for extra memory")
    p.add_argument("--json", action="store_true", help="print plain data in base units")
    p.add_argument("--plot", metavar="FILE.png", help="write bytes-vs-batch and memory-vs-ranks plots")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("demo", help="generate with a Hugging Face model through every design on local ranks")
    p.add_argument("--model", default="gpt2", choices=("gpt2", "llama", "qwen2"),
                   help="embedded seeded model (no downloads)")
    p.add_argument("--ranks", type=_positive, default=4)
    p.add_argument("--batch", type=_positive, default=4, help="prompts per batch")
    p.add_argument("--tokens", type=_positive, default=8, help="new tokens per prompt (>= 2)")
    p.add_argument("--json", action="store_true", help="print the table as data")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("bench", help="run the benchmark scripts (bench_*.py) and print their tables")
    p.add_argument("--dir", default="benchmarks", help="folder holding bench_*.py (default: ./benchmarks)")
    p.add_argument("--only", help="run one script, e.g. 'embedding' or 'bench_embedding'")
    p.add_argument("--out", metavar="FILE.md", help="also write every script's output (markdown) here")
    p.add_argument("--plot", metavar="FILE.png", help="run the demo and plot bytes and time per design")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"vocabpar {args.command}: error: {e}", file=sys.stderr)
        return 2
