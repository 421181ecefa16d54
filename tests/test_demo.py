import json
import subprocess
import sys

import pytest

from vocabpar.plan import DESIGNS

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def demo():
    """One small demo run (2 ranks, 3 prompts, 3 new tokens) through the CLI, as its --json data."""
    done = subprocess.run([sys.executable, "-m", "vocabpar", "demo", "--ranks", "2", "--batch", "3",
                           "--tokens", "3", "--json", "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def test_every_design_generates_the_reference_tokens(demo):
    _, data = demo
    assert (data["model"], data["vocab"], data["tied"], data["ranks"]) == ("gpt2", 50257, True, 2)
    names = [d.name for d in DESIGNS if not d.single_device]
    assert [(r["design"], r["mode"]) for r in data["rows"]] == [(n, m) for n in names
                                                               for m in ("greedy", "sampled")]
    assert [r["equal"] for r in data["rows"]] == [3] * len(data["rows"])
    assert data["tokens_agree"] and demo[0] == 0
    for r in data["rows"]:
        assert r["ms_per_step"] > 0 and r["peak_rss_mib"] > 0 and r["weights_mib"] > 0
    replicated = [r for r in data["rows"] if r["design"] == "deepinfer-replicated"]
    assert all(r["measured"] == 0 and r["id_bytes"] == 0 for r in replicated)


def test_measured_bytes_equal_the_planner(demo):
    _, data = demo
    unchecked = [(r["design"], r["mode"]) for r in data["rows"] if r["predicted"] is None]
    assert unchecked == [("vocabpar-sharded", "sampled")]  # data-dependent rounds: no formula
    mismatched = [(r["design"], r["mode"], r["measured"], r["predicted"]) for r in data["rows"]
                  if r["bytes_agree"] is False]
    assert mismatched == [] and data["bytes_agree"]


def test_bench_runs_each_script_and_reports_failures(tmp_path, capfd):
    from vocabpar.cli import main

    (tmp_path / "bench_a.py").write_text("print('table a')\n")
    (tmp_path / "bench_b.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "helper.py").write_text("raise SystemExit('not a benchmark')\n")
    assert main(["bench", "--dir", str(tmp_path), "--only", "a"]) == 0
    assert "table a" in capfd.readouterr().out
    assert main(["bench", "--dir", str(tmp_path)]) == 1
    assert "failed: bench_b.py" in capfd.readouterr().err
    assert main(["bench", "--dir", str(tmp_path), "--only", "c"]) == 2


def test_bench_writes_report_and_plots_the_demo_data(tmp_path, demo):
    from vocabpar.cli import main
    from vocabpar.demo import DemoResult, Row, plot

    (tmp_path / "bench_a.py").write_text("print('| a | 1 |')\n")
    out = tmp_path / "report.md"
    assert main(["bench", "--dir", str(tmp_path), "--out", str(out)]) == 0
    assert "| a | 1 |" in out.read_text() and "bench_a.py" in out.read_text()
    _, data = demo  # the measured rows of the demo run above, plotted
    fields = {f for f in Row.__dataclass_fields__}
    rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in data["rows"]]
    result = DemoResult(**{k: data[k] for k in DemoResult.__dataclass_fields__ if k != "rows"}, rows=rows)
    for name in ("demo", "demo.png"):  # the path written comes back: ".png" added when missing
        assert plot(result, str(tmp_path / name)) == str(tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_a.py", "demo.png", "report.md"]
