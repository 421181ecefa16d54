"""What a newcomer meets first: set-up under torchrun, the command line's options, ``vocabpar
bench``, and one-line errors that name the field, the mismatch and the fix."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vocabpar import (
    Sampler,
    SamplingParams,
    VocabLayout,
    bench,
    cli,
    comm,
    demo,
    launch,
    plots,
    sample,
    select_rows,
)
from vocabpar.cli import main
from vocabpar.demo import DemoResult, Row

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# ---------------------------------------------------------------------- set-up
def test_init_in_a_plain_process_is_one_rank_and_torchrun_set_up_needs_its_environment():
    assert launch.init() == 1 and comm.world_size() == 1
    with pytest.raises(RuntimeError, match=r"^no torchrun environment \(.*RANK.*\): start the script with "
                                           r"`torchrun --nproc-per-node N script.py`$"):
        launch.init_from_env()


def test_a_rank_count_other_than_torchruns_is_an_error(monkeypatch, capsys):
    for key, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"^4 ranks asked for, but torchrun started 2 processes: ask for 2 "
                                         r"or start torchrun with --nproc-per-node 4$"):
        launch.run(print, 4)
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the demo must not start"))
    assert main(["demo", "--ranks", "4"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        "vocabpar demo: error: --ranks 4 but torchrun started 2 processes: drop --ranks, or start torchrun "
        "with --nproc-per-node 4")


def test_smoke_script_without_torchrun_says_how_in_one_line():
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "smoke_distributed.py")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert "torchrun --nproc-per-node 2 scripts/smoke_distributed.py" in _one_line(done.stderr)


# ---------------------------------------------------------------------- command line
def test_version_and_suggestions_for_misspelt_commands_and_options(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("vocabpar ")
    assert main(["pln"]) == 2
    assert _one_line(capsys.readouterr().err).endswith("; did you mean plan?")
    assert main(["layout", "--rnaks", "2"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        "vocabpar: error: unrecognized arguments: --rnaks 2; did you mean --ranks?")


def test_output_into_a_closed_pipe_stops_quietly():
    """``vocabpar layout ... | head -1``: far more output than a pipe holds, the reader leaves."""
    command = [sys.executable, "-m", "vocabpar", "layout", "--vocab", "1000000", "--ranks", "2048"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err


def _demo_result() -> DemoResult:
    """The README's demo table: GPT-2 on 4 ranks, every design and mode."""
    rows = []
    for d in demo.designs():
        for m in demo.MODES:
            if m.spec_tokens and d.name not in demo.SPECULATIVE_DESIGNS:
                continue
            rows.append(Row(d.name, d.engine, m.name, 4, 4, 40237.7, 40237.7, 2387360.0, 2, 2, 10, True, 32.0,
                            686.8, 474, 12.27, 0.46 if m.spec_tokens else None))
    return DemoResult("gpt2", 50257, 64, True, 4, 4, 8, 4.4, rows)


def test_the_demo_table_fits_120_columns_unless_wide(monkeypatch, capsys):
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: _demo_result())
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120, out
    assert "(--wide adds peak RSS MiB, vocab MiB/rank, ids B/step" in out and "ms/step" in out
    assert main(["demo", "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "peak RSS MiB" in wide.splitlines()[3] and "--wide adds" not in wide
    assert main(["demo", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rows"]) == len(_demo_result().rows)


def test_fit_table_drops_columns_in_order_until_it_fits():
    rows = [["a" * 10, "b" * 10, "c" * 10]]
    table, left_out = cli.fit_table(["x", "y", "z"], rows, drop=["z", "y", "x"], width=22)
    assert left_out == ["z"] and table.splitlines()[0].split() == ["x", "y"]
    assert cli.fit_table(["x", "y", "z"], rows, drop=["z"], width=None)[1] == []


# ---------------------------------------------------------------------- bench
def test_bench_passes_quick_reports_progress_and_writes_out_after_each_benchmark(tmp_path, capfd):
    scripts, out = tmp_path / "scripts", tmp_path / "report.md"
    scripts.mkdir()
    (scripts / "bench_a.py").write_text("import sys\nprint('| a | table |', sys.argv[1:])\n")
    (scripts / "bench_b.py").write_text(
        f"print('a finished first:', '| a | table |' in open({str(out)!r}).read())\n")
    assert main(["bench", "--dir", str(scripts), "--quick", "--out", str(out)]) == 0
    captured, report = capfd.readouterr(), out.read_text()
    assert "| a | table | ['--quick']" in captured.out and "a finished first: True" in captured.out
    assert "[1/2] scripts/bench_a.py: about" in captured.err and "left in all" in captured.err
    assert "### `python scripts/bench_a.py --quick`" in report and "a finished first: True" in report
    assert str(tmp_path) not in captured.out + captured.err + report  # no absolute path anywhere


def test_a_killed_bench_run_keeps_the_finished_tables(tmp_path):
    (tmp_path / "bench_a.py").write_text("print('| a | done |')\n")
    (tmp_path / "bench_b.py").write_text(f"import os\nos.kill(os.getppid(), {int(signal.SIGKILL)})\n")
    command = [sys.executable, "-m", "vocabpar", "bench", "--dir", str(tmp_path), "--out", "r.md"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert "| a | done |" in (tmp_path / "r.md").read_text()


def test_bench_plot_runs_the_demo_alone(tmp_path, monkeypatch, capsys):
    (tmp_path / "bench_a.py").write_text("open('ran', 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "run_demo", lambda **k: "demo data")
    monkeypatch.setattr(plots, "plot_demo", lambda result, path: f"{path} of {result}")
    assert main(["bench", "--dir", ".", "--plot", "demo.png"]) == 0
    assert capsys.readouterr().out == "wrote demo.png of demo data\n" and not (tmp_path / "ran").exists()


def test_benchmarks_are_found_from_the_installed_checkout_or_the_error_names_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./benchmarks here
    found = bench.find_scripts(None)
    assert "benchmarks/bench_sampling.py" in [s.shown for s in found]
    monkeypatch.setattr(bench, "CHECKOUT", tmp_path / "nowhere")
    with pytest.raises(ValueError, match="pass --dir PATH, the benchmarks folder of a vocabpar checkout$"):
        bench.find_scripts(None)


# ---------------------------------------------------------------------- messages
def test_select_rows_on_unpacked_hidden_says_to_pack():
    unpacked = r"hidden must be packed \[T, H\] .* got shape \(2, 3, 8\): for \[B, L, H\] of equal-length"
    with pytest.raises(ValueError, match=unpacked + r" sequences pass hidden.reshape\(-1, H\)"):
        select_rows(torch.zeros(2, 3, 8), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match=r"seq_lens sum to 6 but hidden has 5 rows: hidden must be packed"):
        select_rows(torch.zeros(5, 8), torch.tensor([3, 3]))


def _message_scenarios() -> dict[str, str]:
    """Each scenario's error text on this rank (2 ranks, vocabulary 1000)."""
    me, layout = comm.rank(), VocabLayout(1000, 2)
    local = torch.zeros(3, layout.shard(me).rows)
    positions = torch.arange(3)
    scenarios = {
        "seed": lambda: sample(local, layout, SamplingParams(seed=me), positions=positions),
        "top_p and seed": lambda: sample(local, layout,
                                         SamplingParams(top_p=[0.9, 0.5 + 0.1 * me, 1.0], seed=me),
                                         positions=positions),
        "full rows": lambda: sample(torch.zeros(3, 1000), layout, SamplingParams(), positions=positions),
        "bf16": lambda: sample(local.bfloat16(), layout, SamplingParams(), positions=positions),
        "other vocabulary": lambda: sample(torch.zeros(3, 700), layout, SamplingParams(),
                                           positions=positions),
    }
    engine = Sampler(layout, max_rows=3)
    scenarios["engine float64"] = lambda: engine.sample(local.double() if me == 1 else local, engine.prepare(
        SamplingParams(), positions=positions)).to_host().raise_if_failed()
    scenarios["engine top_p"] = lambda: engine.sample(local, engine.prepare(
        SamplingParams(top_p=[0.9, 0.5 + 0.1 * me, 1.0]), positions=positions)).to_host().raise_if_failed()
    seen = {}
    for name, call in scenarios.items():
        try:
            call()
            seen[name] = "no error"
        except ValueError as e:
            seen[name] = str(e)
    return seen


@pytest.fixture(scope="module")
def messages() -> list[dict[str, str]]:
    return launch.run(_message_scenarios, 2)


def test_a_parameter_disagreement_names_the_fields(messages):
    for seen in messages:
        assert seen["seed"].endswith("the content of sampling parameters differs between ranks {0} and {1}: "
                                     "seed differ"), seen["seed"]
        assert seen["top_p and seed"].endswith(": top_p, seed differ"), seen["top_p and seed"]


def test_the_engine_names_the_rank_what_it_expected_and_the_first_differing_row(messages):
    for seen in messages:
        assert seen["engine float64"] == (
            "Sampler.sample: rank 1: local_logits must be float32, bfloat16 or float16 [3, 512] on the "
            "batch's device, got torch.float64(3, 512): convert them with .float()")
        assert seen["engine top_p"] == (
            "Sampler.sample: ranks disagree on sampling parameters (rank 1 differs from rank 0 first at "
            "row 1; they must be the same on every rank)")


def test_logits_of_the_wrong_shape_name_the_mismatch_and_the_fix(messages):
    seen = messages[0]
    assert seen["full rows"] == (
        "local logits must be float32 [B, 512] on rank 0, got torch.float32(3, 1000): these are full rows of "
        "the vocabulary (1000 ids) but the layout gives this rank 512 columns; pass this rank's shard "
        "(compute_logits(strategy='none')) or sample full rows with reference_sample")
    assert seen["bf16"].endswith(
        "got torch.bfloat16(3, 512): convert them with .float() (from torch.bfloat16)")
    assert seen["other vocabulary"].endswith(
        ": the layout gives this rank 512 columns of a 1000-id vocabulary; build it with the model's "
        "vocabulary size and this group's world size")
    assert all("\n" not in text for text in seen.values())
