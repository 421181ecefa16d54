"""``vocabpar bench``: run the benchmark scripts one after another, stream their tables, report
progress with an estimate of the time left, and rewrite the report after each script, so an
interrupted run keeps every finished table; at the end, each benchmark's bottom line and the
total time. Every line printed fits :data:`WIDTH` columns (a script's longer lines are wrapped);
the ``--out`` report keeps the scripts' full tables. Paths shown or written are relative (no
absolute path leaves this module)."""

from __future__ import annotations

import importlib.metadata
import math
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vocabpar.report import wrap as wrap_line

EXPECTED_S: dict[str, tuple[float, float]] = {
    "bench_compile": (250, 20), "bench_embedding": (90, 4), "bench_head": (120, 5),
    "bench_graph": (5, 5), "bench_inductor": (60, 5), "bench_logprobs": (240, 8), "bench_passes": (120, 8),
    "bench_sampling": (150, 8), "bench_verify": (240, 8)}
"""Seconds each script takes on a 2-core machine: (full, --quick). The --quick ones and the full
bench_compile measured with the pass store warm and the machine nearly idle (a loaded one takes
two to three times as long), the other full ones rough. The estimate scales them by how fast the
finished scripts ran."""

UNKNOWN_S = (120, 15)  # a script not in EXPECTED_S

WIDTH = 100
"""Columns every line ``vocabpar bench`` prints fits."""
REPORT_ENV = "VOCABPAR_BENCH_REPORT"
"""Names, for each script, a file where it may write its output as markdown with its tables
whole; the ``--out`` report takes that instead of the printed text, when the script wrote it."""
BOTTOM = "bottom line: "
"""How the line that states a benchmark's deciding ratio begins; the final summary lists them."""

CHECKOUT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
"""Where the benchmarks of the source checkout this module lives in would be (src/vocabpar/..)."""


def ratio(a: float, b: float) -> str:
    """``a / b`` as a factor: ``33x`` from 10 up, ``1.7x`` below. ``ValueError`` naming both
    numbers unless both are finite, ``a >= 0`` and ``b > 0``."""
    if not (math.isfinite(a) and math.isfinite(b) and a >= 0 and b > 0):
        raise ValueError(f"a ratio needs finite a >= 0 and b > 0, got a={a!r}, b={b!r}")
    r = a / b
    return f"{r:.0f}x" if r >= 10 else f"{r:.1f}x"


def factor(ours: float, theirs: float, better: str = "faster", worse: str = "slower") -> str:
    """How ``ours`` compares with ``theirs`` (seconds, bytes: less is better) as a phrase that
    never reads below 1x: ``33x faster``, ``1.3x slower``; ``better``/``worse`` name the sense
    (e.g. ``fewer bytes``/``more bytes``). ``ValueError`` as :func:`ratio`."""
    return f"{ratio(theirs, ours)} {better}" if ours <= theirs else f"{ratio(ours, theirs)} {worse}"


def wrap(text: str, width: int = WIDTH, hang: int = 2) -> str:
    """Each line of ``text`` wrapped to ``width`` columns as :func:`vocabpar.report.wrap` does."""
    return "\n".join(wrap_line(line, width, hang) if line.strip() else "" for line in text.splitlines())


def bottom_line(text: str) -> str | None:
    """The bottom line in a script's output (after :data:`BOTTOM`, its wrapped continuation lines
    joined), or None when it printed none."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(BOTTOM):
            parts = [line[len(BOTTOM):].strip()]
            for more in lines[i + 1:]:
                if not more.startswith("  ") or not more.strip():
                    break
                parts.append(more.strip())
            return " ".join(parts)
    return None


def version() -> str:
    """The installed vocabpar's version ("unknown" when run from a bare source tree)."""
    try:
        return importlib.metadata.version("vocabpar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Script:
    path: pathlib.Path
    shown: str  # how the report and the progress lines name it (relative)

    @property
    def name(self) -> str:
        return self.path.name


def find_scripts(folder: str | None, only: str | None = None) -> list[Script]:
    """The ``bench_*.py`` scripts of ``folder``; without one, of ``./benchmarks`` or else of the
    source checkout vocabpar is installed from. ``ValueError`` says where it looked and names
    ``--dir`` when there are none (a wheel does not ship them)."""
    if folder is not None:
        places = [pathlib.Path(folder)]
    else:
        places = [pathlib.Path("benchmarks"), CHECKOUT]
    for place in places:
        scripts = sorted(place.glob("bench_*.py"))
        if only:
            scripts = [p for p in scripts if p.stem in (only, f"bench_{only}")]
        if scripts:
            return [Script(p, _shown(p)) for p in scripts]
    named = f" named {only!r}" if only else ""
    if folder is not None:
        raise ValueError(f"no benchmark scripts bench_*.py{named} in {folder!r}")
    raise ValueError(f"no benchmark scripts bench_*.py{named} in ./benchmarks or in the source checkout "
                     f"vocabpar was installed from: pass --dir PATH, the benchmarks folder of a vocabpar "
                     f"checkout")


def _shown(path: pathlib.Path) -> str:
    """``path`` relative to the working folder when it lies below it, else ``<folder>/<file>``."""
    try:
        return str(path.resolve().relative_to(pathlib.Path.cwd().resolve()))
    except ValueError:
        return f"{path.resolve().parent.name}/{path.name}"


def _clock(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


@dataclass(frozen=True)
class Finished:
    """A script that ran: its wall seconds, exit status and bottom line (None: it printed none)."""
    script: Script
    seconds: float
    code: int
    bottom: str | None


def run(scripts: Sequence[Script], quick: bool = False, out: str | None = None,
        say: Callable[[str], None] | None = None) -> list[str]:
    """Run ``scripts`` in order (``--quick`` passed on when ``quick``), each script's output
    streamed to stdout as it prints (lines over :data:`WIDTH` columns wrapped), then a summary of
    their bottom lines and the total time; after each one, ``out`` (when given) is rewritten with
    every finished script's output (its markdown report where it wrote one, see
    :data:`REPORT_ENV`) and, at the end, the summary. Returns the names of the scripts that failed."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    column = 1 if quick else 0
    expected = [EXPECTED_S.get(s.path.stem, UNKNOWN_S)[column] for s in scripts]
    mode = " --quick" if quick else ""
    header = (f"# vocabpar benchmarks\n\n`vocabpar bench{mode}`: vocabpar {version()}, torch "
              f"{torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, "
              f"{time.strftime('%Y-%m-%d %H:%M')}\n")
    sections: list[str] = []
    finished: list[Finished] = []
    started = time.monotonic()
    say(f"running {len(scripts)} benchmark(s){mode}; about {_clock(sum(expected))} in all")
    for i, script in enumerate(scripts):
        done_s = time.monotonic() - started
        pace = done_s / sum(expected[:i]) if i else 1.0  # how this machine compares with the table
        say(f"[{i + 1}/{len(scripts)}] {script.shown}: about {_clock(expected[i] * pace)}, "
            f"{_clock(sum(expected[i:]) * pace)} left in all")
        print(f"\n== {script.shown}{mode} ==", flush=True)
        begun = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="vocabpar-bench-") as folder:
            report = pathlib.Path(folder) / "report.md"
            text, code = _stream([sys.executable, str(script.path)] + (["--quick"] if quick else []),
                                 os.environ | {REPORT_ENV: str(report)})
            written = report.read_text() if report.exists() else ""
        took = time.monotonic() - begun
        finished.append(Finished(script, took, code, bottom_line(written) or bottom_line(text)))
        status = "" if code == 0 else f"\n**failed** (exit status {code})\n"
        sections.append(f"\n### `python {script.shown}{mode}` ({took:.0f} s)\n\n{written or text}{status}")
        if out:
            _write(out, header + "".join(sections))
        say(f"[{i + 1}/{len(scripts)}] {script.shown} {'done' if code == 0 else 'FAILED'} in {took:.0f} s"
            + ("; its table is in --out" if out else ""))
    total = time.monotonic() - started
    print("\n" + summary(finished, total, mode), flush=True)
    if out:
        _write(out, header + "".join(sections) + summary_markdown(finished, total, mode))
    return [f.script.name for f in finished if f.code]


def _outcome(f: Finished) -> str:
    if f.code:
        return f"FAILED (exit status {f.code})"
    return f.bottom or "(no bottom line printed)"


def _name(f: Finished) -> str:
    return f.script.path.stem.removeprefix("bench_")


def summary(finished: Sequence[Finished], total: float, mode: str = "") -> str:
    """The closing lines: per benchmark its name, wall seconds and bottom line (or why it has
    none), wrapped to :data:`WIDTH` columns under its own column; then the total time."""
    name_width = max([len(_name(f)) for f in finished] + [9])
    lines = [f"== summary: {len(finished)} benchmark(s){mode} in {_clock(total)} =="]
    for f in finished:
        prefix = f"{_name(f):<{name_width}} {f.seconds:>4.0f} s  "
        lines.append(wrap(prefix + _outcome(f), hang=len(prefix)))
    return "\n".join(lines)


def summary_markdown(finished: Sequence[Finished], total: float, mode: str = "") -> str:
    """:func:`summary` as a markdown section for the ``--out`` report."""
    rows = "".join(f"| {_name(f)} | {f.seconds:.0f} | {_outcome(f)} |\n" for f in finished)
    return (f"\n## Summary: {len(finished)} benchmark(s){mode} in {_clock(total)}\n\n"
            f"| benchmark | s | bottom line |\n|---|---|---|\n{rows}")


def _stream(command: list[str], env: dict[str, str]) -> tuple[str, int]:
    """Run ``command`` in ``env``, echoing its stdout line by line (wrapped to :data:`WIDTH`
    columns); its full stdout, unwrapped, and exit status."""
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(wrap(line.rstrip("\n")), flush=True)
            lines.append(line)
    return "".join(lines), proc.returncode


def _write(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` in one step (a kill never leaves half a report)."""
    tmp = f"{path}.partial"
    pathlib.Path(tmp).write_text(text)
    os.replace(tmp, path)
