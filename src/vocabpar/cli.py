"""Command line: argument parsing and printing only; the work lives in the library."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vocabpar.layout import SCHEMES, VocabLayout
from vocabpar.presets import DEFAULT_PRESET, PRESETS, preset


def _positive(text: str) -> int:
    value = int(text)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vocabpar", description="Vocabulary-parallel embedding, LM head, logits and sampling.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("layout", help="show how a vocabulary is split over ranks")
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--vocab", type=_positive, help="vocabulary size (overrides --preset)")
    p.add_argument("--org-vocab", type=_positive, help="base vocabulary size (rest is added vocab)")
    p.add_argument("--ranks", type=_positive, default=8)
    p.add_argument("--pad-to", type=_positive, default=64)
    p.add_argument("--scheme", choices=SCHEMES, help="one scheme (default: all)")
    p.set_defaults(func=cmd_layout)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"vocabpar {args.command}: error: {e}", file=sys.stderr)
        return 2
