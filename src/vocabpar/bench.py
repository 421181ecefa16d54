"""``vocabpar bench``: run the benchmark scripts one after another, stream their tables, report
progress with an estimate of the time left, and rewrite the report after each script, so an
interrupted run keeps every finished table. Paths shown or written are relative (no absolute
path leaves this module)."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

EXPECTED_S: dict[str, tuple[float, float]] = {
    "bench_embedding": (90, 10), "bench_head": (120, 10), "bench_sampling": (150, 12),
    "bench_verify": (240, 9), "bench_logprobs": (240, 8), "bench_compile": (180, 180),
    "bench_passes": (120, 20)}
"""Seconds each script takes on a shared 2-core machine: (full, --quick); the --quick ones
measured, the full ones rough. The estimate scales them by how fast the finished scripts ran."""

UNKNOWN_S = (120, 15)  # a script not in EXPECTED_S

CHECKOUT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
"""Where the benchmarks of the source checkout this module lives in would be (src/vocabpar/..)."""


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


def run(scripts: Sequence[Script], quick: bool = False, out: str | None = None,
        say: Callable[[str], None] | None = None) -> list[str]:
    """Run ``scripts`` in order (``--quick`` passed on when ``quick``), each script's output
    streamed to stdout as it prints; after each one, ``out`` (when given) is rewritten with every
    finished script's output. Returns the names of the scripts that failed."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    column = 1 if quick else 0
    expected = [EXPECTED_S.get(s.path.stem, UNKNOWN_S)[column] for s in scripts]
    mode = " --quick" if quick else ""
    header = (f"# vocabpar benchmarks\n\n`vocabpar bench{mode}`: vocabpar {version()}, torch "
              f"{torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, "
              f"{time.strftime('%Y-%m-%d %H:%M')}\n")
    sections: list[str] = []
    failed: list[str] = []
    started = time.monotonic()
    say(f"running {len(scripts)} benchmark(s){mode}; about {_clock(sum(expected))} in all")
    for i, script in enumerate(scripts):
        done_s = time.monotonic() - started
        pace = done_s / sum(expected[:i]) if i else 1.0  # how this machine compares with the table
        say(f"[{i + 1}/{len(scripts)}] {script.shown}: about {_clock(expected[i] * pace)}, "
            f"{_clock(sum(expected[i:]) * pace)} left in all")
        print(f"\n== {script.shown}{mode} ==", flush=True)
        begun = time.monotonic()
        text, code = _stream([sys.executable, str(script.path)] + (["--quick"] if quick else []))
        took = time.monotonic() - begun
        status = "" if code == 0 else f"\n**failed** (exit status {code})\n"
        sections.append(f"\n### `python {script.shown}{mode}` ({took:.0f} s)\n\n{text}{status}")
        if code:
            failed.append(script.name)
        if out:
            _write(out, header + "".join(sections))
        say(f"[{i + 1}/{len(scripts)}] {script.shown} {'done' if code == 0 else 'FAILED'} in {took:.0f} s"
            + ("; its table is in --out" if out else ""))
    return failed


def _stream(command: list[str]) -> tuple[str, int]:
    """Run ``command``, echoing its stdout line by line; its full stdout and exit status."""
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    return "".join(lines), proc.returncode


def _write(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` in one step (a kill never leaves half a report)."""
    tmp = f"{path}.partial"
    pathlib.Path(tmp).write_text(text)
    os.replace(tmp, path)
