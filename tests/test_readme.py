"""Every ``python`` block of README.md runs as written, and so does examples/engine.py.

Each block runs alone in a fresh process (forked, one per block, from a process that imported
torch, transformers and vocabpar once). A block whose first line starts with
:data:`MARK` also runs on the 2 ranks of one torchrun launch, the marked blocks one after
another, each in a fresh namespace; the same launch then runs examples/engine.py. Running this
file as a script does the same by hand: ``python tests/test_readme.py one`` or
``torchrun --nproc-per-node 2 tests/test_readme.py ranks``.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "# torchrun --nproc-per-node 2"
ENGINE = ROOT / "examples" / "engine.py"


def readme_blocks() -> list[tuple[int, str]]:
    """``(line of the first code line, code)`` of every ```` ```python ```` block of README.md."""
    blocks, start, body = [], None, []
    for number, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
        if start is None and line.strip() == "```python":
            start, body = number + 1, []
        elif start is not None and line.strip() == "```":
            blocks.append((start, "\n".join(body) + "\n"))
            start = None
        elif start is not None:
            body.append(line)
    return blocks


def _exec(line: int, code: str) -> None:
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__main__"})


def run_each_in_a_fresh_process(blocks: list[tuple[int, str]]) -> bool:
    """Fork one process per block; print ``README.md:LINE ok`` or its traceback. All ok?"""
    import importlib

    for module in ("torch", "vocabpar.integrations.hf", "transformers.models.gpt2.modeling_gpt2"):
        importlib.import_module(module)  # once, before forking

    ok = True
    for line, code in blocks:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the block's own process
            status = 0
            try:
                _exec(line, code)
            except BaseException:
                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        passed = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        print(f"README.md:{line} {'ok' if passed else 'FAILED'}", flush=True)
        ok &= passed
    return ok


def run_on_these_ranks(blocks: list[tuple[int, str]]) -> bool:
    """Under torchrun: every block, then examples/engine.py, on this process's rank; nothing sets
    the process group up before vocabpar's first use."""
    from vocabpar import comm

    world = comm.world_size()  # under torchrun, the first question sets the default group up
    me = comm.rank()
    if me == 0:
        print(f"first use: a world of {world}", flush=True)
    for line, code in blocks:
        _exec(line, code)
        if me == 0:
            print(f"README.md:{line} ok", flush=True)
    try:
        runpy.run_path(str(ENGINE), run_name="__main__")
    except SystemExit as e:
        return e.code in (0, None)
    return True


@pytest.fixture(scope="module")
def blocks() -> list[tuple[int, str]]:
    found = readme_blocks()
    assert len(found) >= 5 and sum(code.startswith(MARK) for _, code in found) >= 4, found
    return found


@pytest.fixture(scope="module")
def runs(blocks) -> dict[str, subprocess.CompletedProcess]:
    """Both launches, started together: every block in one process each, and the marked blocks
    and the engine example on 2 ranks."""
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    commands = {"one": [sys.executable, __file__, "one"],
                "ranks": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__,
                          "ranks"]}
    started = {name: subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env, cwd=ROOT) for name, command in commands.items()}
    done = {}
    for name, proc in started.items():
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done[name] = subprocess.CompletedProcess(commands[name], proc.returncode, out, err)
    return done


@pytest.fixture(scope="module")
def one_process(runs) -> subprocess.CompletedProcess:
    return runs["one"]


@pytest.fixture(scope="module")
def two_ranks(runs) -> subprocess.CompletedProcess:
    return runs["ranks"]


def test_every_block_runs_alone_in_one_process(blocks, one_process):
    assert one_process.returncode == 0, one_process.stdout[-3000:] + one_process.stderr[-3000:]
    for line, _ in blocks:
        assert f"README.md:{line} ok" in one_process.stdout, one_process.stdout
    assert "rank 0 of 1" in one_process.stdout  # the library block, unsharded


def test_marked_blocks_run_on_two_ranks_without_an_abort_at_exit(blocks, two_ranks):
    out = two_ranks.stdout + two_ranks.stderr
    assert two_ranks.returncode == 0, out[-5000:]
    for line, code in blocks:
        if code.startswith(MARK):
            assert f"README.md:{line} ok" in two_ranks.stdout, out[-5000:]
    assert "first use: a world of 2" in out  # nobody initialised the group: vocabpar's first use did
    assert "rank 0 of 2" in out and "rank 1 of 2" in out  # the library block ran sharded
    assert "terminate called" not in out and "SIGABRT" not in out


def test_engine_example_passes_its_checks_on_a_tp_group(two_ranks):
    out = two_ranks.stdout
    assert "2 ranks, TP groups of 2" in out and "VocabLayout(scheme='padded')" in out, out[-3000:]
    for check in ("sample", "verify", "token_logprobs", "Sampler.sample", "Sampler.verify",
                  "Sampler.token_logprobs"):
        assert f"ok   {check}\n" in out, out[-3000:]
    assert "all checks passed" in out


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "one"
    found = readme_blocks()
    if mode == "ranks":
        marked = [(line, code) for line, code in found if code.startswith(MARK)]
        sys.exit(0 if run_on_these_ranks(marked) else 1)
    sys.exit(0 if run_each_in_a_fresh_process(found) else 1)
