"""``vocabpar bench``'s output: every line within 100 columns, a bottom line per benchmark computed
from the numbers given, a closing summary with the total time, and the ``--out`` report with the
tables whole; and ``--quick``'s passes never compiling. Cheap: fake scripts, helpers in-process."""

import re
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vocabpar import bench
from vocabpar.cli import main
from vocabpar.kernels import fused, store
from vocabpar.sampling.semantics import order_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402

LONG = "word " * 80  # 400 columns


def test_ratio_and_factor_read_from_the_numbers_and_name_bad_ones():
    assert bench.ratio(33.4, 1) == "33x" and bench.ratio(1.71, 1) == "1.7x"
    assert bench.factor(1, 33) == "33x faster" and bench.factor(2, 1) == "2.0x slower"
    assert bench.factor(10, 80800, "fewer bytes", "more bytes") == "8080x fewer bytes"
    for a, b in ((1, 0), (-1, 1), (float("nan"), 1), (1, float("inf"))):
        with pytest.raises(ValueError, match=rf"finite a >= 0 and b > 0, got a={a!r}, b={b!r}"):
            bench.ratio(a, b)


def test_wrap_keeps_lines_within_the_width_and_indents_continuations():
    text = bench.wrap("  " + LONG + "\n\nshort")
    lines = text.splitlines()
    assert max(map(len, lines)) <= bench.WIDTH and lines[-2:] == ["", "short"]
    assert lines[0].startswith("  word") and all(line.startswith("    word") for line in lines[1:-2])
    assert bench.wrap("x" * 150) == "x" * 150  # a word longer than the width stays whole


def test_fit_drops_columns_in_the_order_given_until_the_table_fits():
    header = ["config", "a", "b", "c"]
    rows = [["top-p 0.9 (flat)", "1" * 40, "2" * 40, "3" * 10]]
    lines, left_out = common.fit(header, rows, drop=["b", "c", "a"])
    assert left_out == ["b"] and max(map(len, lines)) <= common.WIDTH
    assert lines[0].split() == ["config", "a", "c"] and lines[1].startswith("top-p 0.9 (flat)  ")
    assert common.fit(header, rows, drop=["b"], width=20)[1] == ["b"]  # nothing more may go: it stays wide
    assert common.fit(["x", "y"], [["1", "2"]])[0] == ["x  y", "1  2"]
    with pytest.raises(ValueError, match=r"row 0 has 1 cells, the header 2: \['1'\]"):
        common.fit(["x", "y"], [["1"]])
    with pytest.raises(ValueError, match=r"columns to drop \['z'\] are not in the header \['x', 'y'\]"):
        common.fit(["x", "y"], [["1", "2"]], drop=["z"])


def test_table_prints_it_fitted_and_reports_every_column_as_markdown(tmp_path, monkeypatch, capsys):
    report = tmp_path / "report.md"
    monkeypatch.setenv(common.REPORT_ENV, str(report))
    common.show("heading " + LONG)
    common.table(["config", "wide", "narrow"], [["greedy", "9" * 95, "1.0x"]], drop=["wide"])
    common.bottom_line("from " + LONG)
    printed = capsys.readouterr().out.splitlines()
    assert max(map(len, printed)) <= common.WIDTH
    assert "config  narrow" in printed
    assert "(left out to fit 100 columns: wide; the --out report has them)" in printed
    text = report.read_text()
    assert f"| config | wide | narrow |\n| --- | --- | --- |\n| greedy | {'9' * 95} | 1.0x |\n" in text
    assert f"heading {LONG.strip()}\n\n" in text  # prose unwrapped
    assert bench.bottom_line("\n".join(printed)) == bench.bottom_line(text) == "from " + LONG.strip()


def test_verdict_states_the_first_configuration_and_the_range_from_the_numbers_given():
    times = {"greedy": (0.0365, 1.2045), "flat": (6.6155, 15.4032), "t0.8": (0.1584, 14.9126)}
    sent = {"greedy": (12288, 99287040), "flat": (14585856, 99287040), "t0.8": (1585152, 99287040)}
    assert common.verdict("sampling on shards", "gather-then-sample", "B=256", times, sent) == (
        "sampling on shards 33x faster than gather-then-sample at B=256 (greedy), 8080x fewer bytes; "
        "over all 3 configurations 2.3x faster (flat) to 94x faster (t0.8)")
    with pytest.raises(ValueError, match=r"must name the same configurations, got \['greedy'\] and \[\]"):
        common.verdict("a", "b", "c", {"greedy": (1, 2)}, {})


def test_bottom_line_is_found_wrapped_or_whole_and_none_when_missing():
    assert bench.bottom_line("table\nbottom line: 33x faster,\n  8080x fewer bytes\nnext") == \
        "33x faster, 8080x fewer bytes"
    assert bench.bottom_line("table\n") is None


def test_bench_lines_fit_100_columns_and_end_with_every_bottom_line_and_the_total(tmp_path, capfd):
    scripts, out = tmp_path / "scripts", tmp_path / "report.md"
    scripts.mkdir()
    (scripts / "bench_a.py").write_text(f"print({LONG!r})\nprint('bottom line: a is ' + {LONG!r})\n")
    (scripts / "bench_b.py").write_text("raise SystemExit(3)\n")
    (scripts / "bench_c.py").write_text("print('a table, no verdict')\n")
    assert main(["bench", "--dir", str(scripts), "--out", str(out)]) == 1
    captured = capfd.readouterr()
    lines = (captured.out + captured.err).splitlines()
    assert max(map(len, lines)) <= bench.WIDTH
    tail = captured.out[captured.out.index("== summary: 3 benchmark(s) in 0:"):].splitlines()
    assert re.fullmatch(r"a {11,12}\d s  a is word( word)+", tail[1])
    assert tail[2].startswith(" " * 18 + "word")  # under its own column
    assert re.fullmatch(r"b {11,12}\d s  FAILED \(exit status 3\)", tail[-2])
    assert re.fullmatch(r"c {11,12}\d s  \(no bottom line printed\)", tail[-1])
    report = out.read_text()
    assert LONG in report and re.search(r"\| a \| \d \| a is word", report)
    assert re.search(r"\| b \| \d \| FAILED \(exit status 3\) \|", report)


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_quick_runs_a_library_pass_missing_from_the_store_eager_and_compiles_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv(store.DIRECTORY, str(tmp_path))  # an empty store
    monkeypatch.setattr(common, "QUICK", True)
    monkeypatch.setattr(fused, "_noticed", [False])  # this process's compile notice, restored after
    compiled = []  # a benchmark's own pass compiles: here a stand-in for the compiler, which takes seconds
    monkeypatch.setattr(store, "compile_and_save", lambda fn, args, options, file: compiled.append(fn) or
                        SimpleNamespace(fn=fn, guard_check=lambda *a: True))
    library, own, saving = fused.Fused(order_key), fused.Fused(_double), store.compile_and_save
    x = torch.tensor([[1.5, -2.0, float("inf")]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fused.compiling(True), common.stored_passes() as eager:
            assert torch.equal(library(x), order_key(x)) and torch.equal(own(x), x * 2)
            assert library.compiled == 0 and library.broken and own.compiled == 1 and not own.broken
    assert eager == ["order_key"] and compiled == [_double] and not caught
    assert store.compile_and_save is saving and fused._noticed == [True]  # the notice silenced
    assert common.passes_note(eager).startswith("1 pass eager, the store lacking them for ")
    assert common.passes_note([]) == "passes compiled (loaded from the store)"
