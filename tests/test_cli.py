import os
import re
import subprocess
import sys

import pytest

from vocabpar import demo, launch
from vocabpar.cli import main


def test_layout_shows_vllm_example(capsys):
    assert main(["layout", "--vocab", "1026", "--org-vocab", "1010", "--ranks", "2",
                 "--scheme", "padded"]) == 0
    out = capsys.readouterr().out
    assert "padded size 1088" in out and "(org 1010, added 16)" in out
    assert "[1010, 1026)" in out and "544" in out and "org ids" in out


def test_layout_default_is_deepseek_at_8_ranks(capsys):
    assert main(["layout"]) == 0
    out = capsys.readouterr().out
    assert "vocab 129280" in out and "over 8 ranks" in out
    assert out.count("\n   7 ") == 3  # one row for rank 7 in each of the three schemes


def test_bad_layout_arguments_exit_2(capsys):
    assert main(["layout", "--vocab", "10", "--org-vocab", "11"]) == 2
    assert "org_vocab_size must be in" in capsys.readouterr().err


def test_console_help_runs():
    done = subprocess.run([sys.executable, "-m", "vocabpar", "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    for command in ("layout", "plan", "demo", "bench"):
        assert command in done.stdout


def _one_line_error(capsys, command: str, *parts: str) -> None:
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith(f"vocabpar {command}: error: ")
    assert all(p in captured.err for p in parts), captured.err


@pytest.mark.parametrize("flag,value", [("--ranks", "65537"), ("--ranks", "0"), ("--vocab", "2147483649"),
                                        ("--vocab", "1e9"), ("--org-vocab", "-1"), ("--pad-to", "1048577"),
                                        ("--pad-to", "nan")])
def test_layout_numbers_out_of_range_exit_2(flag, value, capsys):
    assert main(["layout", f"{flag}={value}"]) == 2
    _one_line_error(capsys, "layout", f"argument {flag}: ", repr(value))


def test_layout_ranks_upper_bound_is_accepted(capsys):
    assert main(["layout", "--vocab", "1000", "--ranks", "65536", "--pad-to", "1", "--scheme", "uneven"]) == 0
    assert "over 65536 ranks" in capsys.readouterr().out


@pytest.mark.parametrize("flag,value", [("--ranks", "65"), ("--ranks", "0"), ("--batch", "257"),
                                        ("--batch", "0"), ("--tokens", "121"), ("--tokens", "1"),
                                        ("--tokens", "inf")])
def test_demo_numbers_out_of_range_fail_before_spawning(flag, value, capsys, monkeypatch):
    def spawn(*args, **kwargs):
        raise AssertionError("the demo spawned ranks")
    monkeypatch.setattr(launch, "run", spawn)
    monkeypatch.setattr(demo, "run_demo", spawn)
    assert main(["demo", f"{flag}={value}"]) == 2
    _one_line_error(capsys, "demo", f"argument {flag}: ", repr(value))


def test_run_demo_checks_its_limits_before_any_work(monkeypatch):
    def spawn(*args, **kwargs):
        raise AssertionError("the demo spawned ranks")
    monkeypatch.setattr(launch, "run", spawn)
    monkeypatch.setattr(demo, "build_model", spawn)
    for kw in ({"ranks": demo.LIMITS["ranks"][1] + 1}, {"batch": 0}, {"tokens": 1000}, {"ranks": 2.0}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} must be an int in"):
            demo.run_demo(**kw)


@pytest.mark.parametrize("flag,target,why", [("--out", "missing/report.md", "folder"),
                                             ("--out", "folder", "is a folder"),
                                             ("--out", "folder/", "is a folder"),
                                             ("--plot", "missing/demo.png", "folder"),
                                             ("--plot", "folder", "is a folder"),
                                             ("--plot", "demo.pdf", "not a .png file name")])
def test_bench_unwritable_outputs_fail_before_any_benchmark(flag, target, why, tmp_path, monkeypatch, capsys):
    (tmp_path / "folder").mkdir()
    (tmp_path / "bench_a.py").write_text("open('ran', 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--dir", ".", flag, target]) == 2
    _one_line_error(capsys, "bench", f"argument {flag}: ", repr(target), why)
    assert not (tmp_path / "ran").exists()


def test_bench_out_in_a_read_only_folder(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    (tmp_path / "ro").mkdir(mode=0o500)
    assert main(["bench", "--dir", str(tmp_path), "--out", str(tmp_path / "ro" / "r.md")]) == 2
    _one_line_error(capsys, "bench", "argument --out: ", "is not writable")


def test_help_documents_the_ranges(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # no line breaks inside a range
    for command, ranges in (("demo", ("[1, 64]", "[1, 256]", "[2, 120]")), ("layout", ("[1, 65536]",)),
                            ("plan", ("[1, 65536]", "[1e-06, 1e+09]", "[0.001, 1e+12]"))):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert all(r in out for r in ranges), (command, out)


def test_score_prints_logprobs_and_perplexity_matching_the_single_process_model(capsys):
    from vocabpar.cli import main

    assert main(["score", "--ranks", "2", "--ids", "5,17,300,42,9", "--top-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "within 0.0001" in out
    assert out.count("\n") >= 6  # header, rule, one row per scored token (4), summary


def test_score_rejects_bad_ids(capsys):
    from vocabpar.cli import main

    assert main(["score", "--ranks", "1", "--ids", "5,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["score", "--ranks", "1", "--ids", "5,99999999"]) == 2
    assert "integers in [0, 50257)" in capsys.readouterr().err


def test_warm_compiles_the_named_passes_in_a_fresh_process(capsys, monkeypatch, tmp_path):
    """One pass (the cheapest to compile) in a process of one thread, into the store named by
    the environment (that other processes load from it is pinned by test_fused: its ranks run
    the passes two others compiled)."""
    monkeypatch.setenv("VOCABPAR_PASS_STORE", str(tmp_path))
    assert main(["warm", "--passes", "order_keys", "--jobs", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert f"compiling 1 pass for processes of 1 thread(s), 1 at a time, into {tmp_path}" in out
    assert "order_keys" in out and "s in all" in out
    assert [p.name.split("-")[0] for p in tmp_path.glob("*/*.aot")] == ["_order_keys"]


@pytest.mark.parametrize("args, why", [
    (["--passes", "order_keys,nope"], "unknown pass(es) nope; the passes are: accept_uniforms"),
    (["--jobs", "0"], "--jobs: must be an integer in [1, 256], got '0'"),
    (["--threads", "x"], "--threads: must be an integer in [1, 1024], got 'x'"),
])
def test_warm_rejects_bad_arguments_before_compiling(args, why, capsys):
    assert main(["warm", *args]) == 2
    assert why in capsys.readouterr().err


def _data_dependent(x):
    return x * 2 if x.sum().item() > 0 else x  # a branch on a value: no single graph to compile


def test_warm_names_a_pass_that_cannot_compile_and_exits_1(monkeypatch, capsys, tmp_path):
    """A pass Inductor cannot compile: ``warm`` reports it (in this process here, not a pool) and
    exits 1; the pass warned once and runs eager with the eager result."""
    import torch

    from vocabpar.kernels import fused, warm

    monkeypatch.setenv("VOCABPAR_PASS_STORE", str(tmp_path))
    broken = fused.Fused(_data_dependent)
    monkeypatch.setattr(warm, "example_calls", lambda *args: {"data_dependent": (broken, (torch.ones(3),))})
    monkeypatch.setattr(warm, "warm_in_processes", lambda names, jobs, threads: warm.warm(names))
    with pytest.warns(RuntimeWarning, match="compiling _data_dependent failed, running it eager"):
        assert main(["warm", "--jobs", "1", "--threads", "1"]) == 1
    out, err = capsys.readouterr()
    assert "compiling 1 pass for processes of 1 thread(s)" in out
    assert re.search(r"data_dependent +FAILED", out)
    assert "data_dependent could not compile" in err and "run eager, with the same results" in err
    assert broken.broken and torch.equal(broken(torch.ones(3)), torch.full((3,), 2.0))
    assert not list(tmp_path.rglob("*.aot"))
