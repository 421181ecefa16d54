import subprocess
import sys

from vocabpar.cli import main


def test_layout_shows_vllm_example(capsys):
    assert main(["layout", "--vocab", "1026", "--org-vocab", "1010", "--ranks", "2",
                 "--scheme", "padded"]) == 0
    out = capsys.readouterr().out
    assert "padded size 1088" in out
    assert "[1010, 1026)" in out and "544" in out


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
