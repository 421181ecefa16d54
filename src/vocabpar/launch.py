"""Run a function on N local ranks (tests, demo, benchmarks), or on the ranks torchrun started.

Local runs use gloo on 127.0.0.1, one process per rank started from a ``forkserver`` that has
torch preloaded (fast and fork-safe; ``fork`` after OpenMP work hangs; :func:`preload` adds
modules). ``fn`` must therefore be a module-level function. The ranks meet through a file in a
fresh temporary directory (``FileStore``), not a TCP store: no free port to race for, and no
connection stall (3 of 30 four-rank launches on a 2-core machine spent 5 s connecting to a TCP
store that was already listening). Every rank's return value comes back to the caller; an
exception on any rank, or a rank that dies, raises :class:`LaunchError` naming the rank(s); the
collective timeout makes survivors of a dead peer fail instead of hanging. A rank that
succeeded stays until every rank has reported (a peer may still be connecting to it), then the
caller releases it and it exits on its own, with what multiprocessing registered in it released
(a rank that does not exit within :data:`EXIT_GRACE` is killed).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import multiprocessing.util as mp_util
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

# modules the forkserver imports once, before it forks the first rank (see preload)
PRELOAD = ["torch", "vocabpar"]
EXIT_GRACE = 2.0
"""Seconds a local run waits for its ranks to exit on their own once released (a reported rank
takes milliseconds) before it kills the rest."""


def preload(*modules: str) -> None:
    """Have the ranks of local runs start with ``modules`` imported: the forkserver imports them
    once instead of every rank (``transformers``' model code takes seconds per process). Only a
    forkserver that is not running yet sees them, so call this before the process's first local
    run; a module that fails to import is skipped."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


class LaunchError(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> one-line reason, ``tracebacks``
    rank -> full traceback text where the rank lived long enough to report it."""

    def __init__(self, failures: dict[int, str], tracebacks: dict[int, str]):
        self.failures, self.tracebacks = failures, tracebacks
        lines = [f"rank {r}: {why}" for r, why in sorted(failures.items())]
        first = min(tracebacks) if tracebacks else None
        detail = f"\n--- traceback of rank {first} ---\n{tracebacks[first]}" if first is not None else ""
        super().__init__(f"{len(failures)} rank(s) failed:\n" + "\n".join(lines) + detail)


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether torchrun (or anything setting its variables) started this process."""
    return all(k in os.environ for k in TORCHRUN_VARS)


def init_from_env(timeout: float = 300.0, backend: str | None = None) -> None:
    """Initialise the default group from torchrun's environment (NCCL when CUDA is present) and
    register :func:`shutdown` to run at a normal exit; nothing when a group already exists."""
    if dist.is_initialized():
        return
    missing = [k for k in TORCHRUN_VARS if k not in os.environ]
    if missing:
        raise RuntimeError(f"no torchrun environment ({', '.join(missing)} unset): start the script "
                           f"with `torchrun --nproc-per-node N script.py`")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # torch.distributed.nn's functions take ``group=group.WORLD`` as a default, evaluated when it is
    # imported: imported after the group exists (building a transformers model does), they would keep
    # it alive past destroy_process_group, whose destructor is what joins gloo's worker threads
    importlib.import_module("torch.distributed.nn")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    atexit.register(_shutdown_at_exit)


def init(timeout: float = 300.0, backend: str | None = None) -> int:
    """Set up the default process group once and return the world size: under torchrun from its
    environment (torn down at exit, see :func:`shutdown`), otherwise a single process (1, nothing
    set up). A group the caller initialised already is used as it is."""
    if not dist.is_initialized() and under_torchrun():
        init_from_env(timeout, backend)
    return dist.get_world_size() if dist.is_initialized() else 1


def shutdown() -> None:
    """Tear every process group down in an order that exits cleanly; idempotent.

    A barrier first, so no rank destroys a group a peer is still using; then
    ``destroy_process_group``, whose gloo destructor joins its worker threads with the GIL
    released. Left to interpreter exit instead, a worker thread that still holds the last
    reference to a tensor of the final collective needs the GIL to free it while Python is
    finalising, and the process aborts (``terminate called without an active exception``)."""
    _teardown(after_error=False)


def _teardown(after_error: bool) -> None:
    """Destroy every process group, so that no backend thread outlives this call: after a barrier
    (:func:`shutdown`), or ``after_error`` without one, aborting it (NCCL's communicators are
    aborted instead of flushed; gloo's worker threads are joined either way, once the collective
    this rank left in flight, if any, completes or times out)."""
    if not dist.is_initialized():
        return
    world = dist.group.WORLD
    try:
        if not after_error:
            dist.barrier()
    finally:
        (_abort_process_group if after_error else dist.destroy_process_group)()
    if sys.getrefcount(world) > 2:  # still referenced elsewhere: its threads outlive this call, so leave
        time.sleep(0.05)  # them the GIL to finish what they hold before the interpreter finalises


def _shutdown_at_exit() -> None:
    """:func:`shutdown` at a normal exit. After an uncaught exception (its traceback already
    printed) a peer may never reach the barrier, so the groups are aborted without one (and the
    locals of the traceback's frames dropped first, lest they keep a group alive): the process
    then exits with status 1, never by ``SIGABRT``, and a peer's next collective fails with a
    connection error (or its timeout) instead of waiting for this rank."""
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if error is not None:  # its frames may hold groups or tensors: drop their locals, printed already
        traceback.clear_frames(error.__traceback__)
    try:
        _teardown(after_error=error is not None)
    except Exception as e:  # a peer already gone: say so in one line, exit as planned
        first = (str(e).splitlines() or [""])[0]
        print(f"vocabpar: process group teardown failed: {type(e).__name__}: {first}", file=sys.stderr)


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
        run_timeout: float = 600.0, threads_per_rank: int | None = None, **kwargs: Any) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results in rank order.

    ``timeout`` bounds every collective; ``run_timeout`` bounds the whole run. Under torchrun
    the process group comes from the environment, ``world_size`` must be the number of processes
    torchrun started (``ValueError`` otherwise), ``fn`` runs once in this process and the
    returned list holds this rank's result only."""
    for name, seconds in (("timeout", timeout), ("run_timeout", run_timeout)):
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
            raise ValueError(f"{name} must be a positive finite number of seconds, got {seconds!r}")
    if under_torchrun():
        started = int(os.environ["WORLD_SIZE"])
        if world_size != started:
            raise ValueError(f"{world_size} ranks asked for, but torchrun started {started} processes: "
                             f"ask for {started} or start torchrun with --nproc-per-node {world_size}")
        init_from_env(timeout)
        return [fn(*args, **kwargs)]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    procs, conns = [], []
    with tempfile.TemporaryDirectory(prefix="vocabpar-launch-") as rendezvous:
        store = os.path.join(rendezvous, "store")
        for r in range(world_size):
            mine, theirs = ctx.Pipe()  # results come back on it; closing ours releases the rank
            p = ctx.Process(target=_rank_main, daemon=True,
                            args=(fn, r, world_size, store, timeout, threads, theirs, args, kwargs))
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(mine)
        pending = set(range(world_size))
        try:
            return _collect(procs, conns, pending, time.monotonic() + run_timeout, grace=timeout + 10)
        finally:
            for conn in conns:  # releases the ranks that reported: they exit on their own, cleaned up
                conn.close()
            exited = time.monotonic() + EXIT_GRACE
            for r, p in enumerate(procs):
                if r not in pending:
                    p.join(max(0.0, exited - time.monotonic()))
                if p.is_alive():  # never reported (stuck, or the run timed out), or did not exit in time
                    p.kill()
                    p.join(5)


def _rank_main(fn, rank, world_size, store, timeout, threads, conn, args, kwargs) -> None:
    # what the forkserver imported is never garbage: collections (a full one costs ~0.2 s with
    # transformers loaded) then scan only the rank's own objects and leave the shared pages alone
    gc.freeze()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    try:
        rendezvous = dist.FileStore(store, world_size)
        rendezvous.set_timeout(timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=rendezvous, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        message = (True, fn(*args, **kwargs))
    except BaseException as e:  # report anything, including KeyboardInterrupt/SystemExit
        message = (False, (f"{type(e).__name__}: {e}", traceback.format_exc()))
    try:
        payload = pickle.dumps(message)
    except Exception as e:
        payload = pickle.dumps((False, (f"result could not be pickled: {e}", traceback.format_exc())))
    conn.send_bytes(payload)
    if message[0]:
        # stay until every rank has reported: a peer may still be connecting to this one; the
        # caller then closes its end of the pipe or ends this process
        try:
            conn.recv_bytes()
        except (EOFError, OSError):
            pass
    # what multiprocessing does at the end of its own processes: release what it registered in this
    # one (a semaphore left registered makes the resource tracker warn of a leak when the caller
    # exits; torch's compiler, through tqdm's lock, creates one per process)
    mp_util._run_finalizers(0)
    os._exit(0)  # skip interpreter teardown: a dead peer must not make this rank hang on exit


def _collect(procs, conns, pending: set[int], deadline: float, grace: float) -> list[Any]:
    """The ranks' results in rank order, or :class:`LaunchError`; ``pending`` (every rank at
    first) loses each rank as it reports or dies."""
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    tracebacks: dict[int, str] = {}
    shortened = False
    while pending:
        if failures and not shortened:  # survivors get one collective timeout to fail too
            deadline, shortened = min(deadline, time.monotonic() + grace), True
        left = deadline - time.monotonic()
        if left <= 0:
            for r in pending:
                failures[r] = "did not finish in time (killed)"
            break
        waitables = {conns[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
        for ready in mpc.wait(list(waitables), timeout=left):
            r = waitables[ready]
            if r not in pending:
                continue
            ok, value = False, None
            if ready is conns[r] or conns[r].poll():
                try:
                    ok, value = pickle.loads(conns[r].recv_bytes())
                except EOFError:  # the pipe closed without a report: the process died
                    pass
            if ok:
                results[r] = value
            elif value is not None:
                failures[r], tracebacks[r] = value
            else:
                procs[r].join(5)
                failures[r] = f"died (exit code {procs[r].exitcode})"
            pending.discard(r)
    if failures:
        raise LaunchError(failures, tracebacks)
    return [results[r] for r in range(len(procs))]
