"""How launched processes end: an uncaught exception in a script under torchrun ends every rank
with status 1 and the exception's traceback, never with SIGABRT (``terminate called without an
active exception``); a local run leaves no semaphore to the resource tracker.

One driver process does both, once:

- 20 two-rank jobs in torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), 10 at
  a time, each rank an interpreter forked from the driver (torch imported once) that runs to its
  own exit: one collective, then a second that rank 0 leaves in flight and its peer joins 0.3 s
  later, then ``ValueError`` on every rank or on rank 0 only (the peer's next collective then
  fails: rank 0 is gone). Left to the interpreter's exit, rank 0's gloo worker finishes that
  collective and needs the GIL to drop its tensor while Python finalises, and the process
  aborts. A busy machine loses that race now and then (7 of 40 plain ``torchrun --nproc-per-node
  2`` runs on 2 cores); here an exit handler that blocks in C holding the GIL (registered first,
  it runs last) keeps the GIL from the worker until finalisation, which makes it near certain:
  without the teardown after an error, all 20 jobs aborted.
- two local :func:`vocabpar.launch.run` of 2 ranks (one succeeds, one fails on rank 1) whose
  ranks create a multiprocessing lock that lives as long as they do, as tqdm's does when torch's
  compiler runs in a rank: without their clean-up, 4 semaphores leaked."""

import json
import re
import subprocess
import sys

import pytest
from ports import free_ports

DRIVER = r'''
import sys

if __name__ == "__main__":
    import atexit
    import ctypes

    # registered before torch's handlers, so it runs last at exit: a C call that holds the GIL
    atexit.register(ctypes.PyDLL(None).usleep, 1_000_000)

import gc
import json
import multiprocessing
import os
import time

import torch
import torch.distributed as dist

from vocabpar import launch

LAG = 0.3  # seconds the peer takes to join the collective rank 0 left in flight
HELD = []


def rank_main(rank: int, who: str) -> None:
    launch.init(timeout=10)
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(LAG)
    dist.all_reduce(t, async_op=rank == 0)
    if who == "every" or rank == 0:
        raise ValueError(f"boom on rank {rank}")
    dist.all_reduce(t)  # rank 0 has gone: a connection error (or the timeout)


def jobs(cases: list[str], ports: list[int], out: str, parallel: int) -> dict[str, int]:
    """Each case a two-rank job on its own port, ``parallel`` at a time; name -> exit status
    (-6: SIGABRT)."""
    status = {}
    for first in range(0, len(cases), parallel):
        children = {}
        batch = range(first, min(len(cases), first + parallel))
        for job in batch:
            for rank in range(2):
                name = f"{job}-{rank}"
                pid = os.fork()
                if pid:
                    children[pid] = name
                    continue
                fd = os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[job]))
                rank_main(rank, cases[job])  # raises: this interpreter exits as a script's would
                os._exit(3)
        while children:
            pid, code = os.wait()
            status[children.pop(pid)] = os.waitstatus_to_exitcode(code)
    return status


def holds_a_lock(fail: bool) -> int:
    HELD.append(multiprocessing.Lock())
    dist.barrier()  # both ranks connected: a peer dying while gloo connects is another error
    if fail and dist.get_rank() == 1:
        raise ValueError("rank 1 fails as asked")
    return dist.get_rank()


if __name__ == "__main__":
    cases, ports, out = sys.argv[1].split(","), [int(p) for p in sys.argv[2].split(",")], sys.argv[3]
    gc.freeze()  # the ranks' collections, at exit too, then skip what the driver imported
    status = jobs(cases, ports, out, parallel=10)
    runs = [launch.run(holds_a_lock, 2, False)]
    try:
        launch.run(holds_a_lock, 2, True)
    except launch.LaunchError as e:
        runs.append(str(e).splitlines()[1])
    print(json.dumps({"status": status, "runs": runs}), flush=True)
    os._exit(0)
'''
CASES = ["every", "one"] * 10
PEER_GONE = re.compile(r"Connection (closed|reset) by peer|[Tt]imed out")


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    folder = tmp_path_factory.mktemp("launch")
    (folder / "driver.py").write_text(DRIVER)
    done = subprocess.run([sys.executable, str(folder / "driver.py"), ",".join(CASES),
                           ",".join(map(str, free_ports(len(CASES)))), str(folder)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr, folder


def test_an_uncaught_exception_under_torchrun_exits_1_never_sigabrt(driven):
    found, _, folder = driven
    for job, who in enumerate(CASES):
        for rank in range(2):
            text = (folder / f"{job}-{rank}").read_text()
            assert found["status"][f"{job}-{rank}"] == 1, text
            assert "terminate called" not in text and "Fatal Python error" not in text, text
            if who == "every" or rank == 0:
                assert f"ValueError: boom on rank {rank}" in text, text
            else:  # its peer gone, its collective failed instead of waiting for it
                assert PEER_GONE.search(text), text


def test_local_runs_leave_no_semaphore_behind(driven):
    found, stderr, _ = driven
    assert found["runs"] == [[0, 1], "rank 1: ValueError: rank 1 fails as asked"]
    assert "leaked" not in stderr, stderr
