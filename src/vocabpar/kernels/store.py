"""Compiled passes kept on disk, so that a later process loads a pass instead of compiling it again.

``torch.compile`` keeps Inductor's kernels on disk, but every new process still traces each pass
with Dynamo and lowers it again before it finds them (0.2-9 s per pass here). ``aot_compile``
saves the traced and lowered program itself; loading one takes ~15 ms (the first load in a
process also pays Inductor's start-up, ~3 s). Compiling a program this way does not use the
kernels Inductor cached for ``torch.compile``: a pass missing from the store costs a full compile.

A program serves one pass in one calling convention (per argument: device, dtype and rank of a
tensor, the type of an int, the value of anything else); it keeps Dynamo's guards on its
arguments (tensor metadata, the sizes and int ranges its code assumes) and drops those on module
globals, which the key stands for instead: the torch and Python versions, the CPU's vector
instruction set, the thread count (Inductor specialises its C++ loops on it), the Inductor
settings, the pass's code and the source of every module it can reach. An edited or upgraded
install therefore never loads a stale program, while an edit elsewhere keeps the store.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import platform
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

Program = Any
"""A saved program (``torch._dynamo.aot_compile.AOTCompiledFunction``): ``guard_check(*args)``
says whether it serves ``args``; calling it runs it."""
DIRECTORY = "VOCABPAR_PASS_STORE"
"""Environment variable naming the store's directory; by default ``vocabpar`` in Inductor's cache
directory (``TORCHINDUCTOR_CACHE_DIR``, else ``/tmp/torchinductor_$USER``), whose kernels the
saved programs use."""


def convention(args: tuple[object, ...]) -> str:
    """The calling convention of ``args`` (per argument: device, dtype and rank of a tensor, the
    type of an int, the value of anything else): the programs of one convention differ at most in
    what their guards check (the ranges of its ints)."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            device = a.device.type if a.device.type == "cpu" else torch.cuda.get_device_name(a.device)
            parts.append(f"{device}/{a.dtype}/{a.dim()}/{int(a.requires_grad)}")
        else:
            parts.append("int" if type(a) is int else repr(a))
    return f"{'|'.join(parts)}; grad {int(torch.is_grad_enabled())}"


def _local_guards(entries: list) -> list[bool]:
    """Dynamo's guards to keep in a saved program: those on its arguments (tensor metadata, the
    sizes and ints its code assumes, the constants it was traced with) and on global state; not
    those on module globals, which the source digest stands for, nor class matches (torch cannot
    save them; the convention's types stand for them)."""
    kept = ("GLOBAL_STATE", "SHAPE_ENV")
    return [(not g.is_global and g.guard_type != "CLASS_MATCH") or g.guard_type in kept for g in entries]


def directory() -> Path:
    """The store's directory."""
    if os.environ.get(DIRECTORY):
        return Path(os.environ[DIRECTORY])
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "vocabpar"


@functools.cache
def _source_digest(module: str) -> str:
    """A digest of the source of ``module`` and of every module it reaches through its globals
    (modules, and functions or classes defined in a module of the same package), recursively:
    whatever a pass defined there can read. Once per module and process."""
    root, seen, todo = module.split(".")[0], set(), [module]
    while todo:
        name = todo.pop()
        if name in seen or name not in sys.modules:
            continue
        seen.add(name)
        for value in vars(sys.modules[name]).values():
            is_module = isinstance(value, types.ModuleType)
            home = value.__name__ if is_module else getattr(value, "__module__", None)
            if (is_module or callable(value)) and isinstance(home, str) and home.split(".")[0] == root:
                todo.append(home)
    digest = hashlib.sha256()
    for name in sorted(seen):
        file = getattr(sys.modules[name], "__file__", None)
        digest.update(name.encode() + b"\0" + (Path(file).read_bytes() if file else b""))
    return digest.hexdigest()


def files(fn: Callable[..., object], args: tuple[object, ...], options: dict[str, object]) -> Iterator[Path]:
    """Where the programs of ``fn`` compiled with Inductor ``options`` for the convention of
    ``args`` are kept, in order: the first that does not exist is the next to write."""
    machine = (platform.machine(), torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
    setting = "|".join([torch.__version__, sys.version, repr(machine),
                        repr(sorted(options.items()))])
    folder = hashlib.sha256(setting.encode()).hexdigest()[:16]
    code = fn.__code__  # the pass itself, also where it is not part of the package (marshal is not stable)
    entry = hashlib.sha256(repr((fn.__module__, fn.__qualname__, code.co_code, code.co_consts, code.co_names,
                                 convention(args), _source_digest(fn.__module__))).encode()).hexdigest()[:16]
    return (directory() / folder / f"{fn.__name__}-{entry}-{i}.aot" for i in itertools.count())


def load(fn: Callable[..., object], args: tuple[object, ...], options: dict[str, object]) -> Program | Path:
    """The first program kept for ``fn`` whose guards pass ``args``, or the file to keep a new one
    in. A torn or foreign file is skipped (and overwritten once a new program is compiled)."""
    for file in files(fn, args, options):  # endless: the loop ends at a missing or unreadable file
        if not file.exists():
            break
        try:
            with file.open("rb") as f:
                program = torch.compiler.load_compiled_function(f, f_globals=fn.__globals__)
        except Exception:  # noqa: BLE001 -- unpickling a foreign file fails in many ways
            break
        if program.guard_check(*args):
            return program
    return file


def compile_and_save(fn: Callable[..., object], args: tuple[object, ...], options: dict[str, object],
                     file: Path) -> Program:
    """``fn`` compiled for ``args`` (every dimension dynamic and unbacked, so no size specialises
    it, 0 and 1 included; floats fixed) and saved at ``file`` for later processes; a store that
    cannot be written warns once and costs only the saving."""
    for t in args:
        if isinstance(t, torch.Tensor):
            for dim in range(t.dim()):
                torch._dynamo.decorators.mark_unbacked(t, dim)
    guarded = options | {"guard_filter_fn": _local_guards}
    with torch._dynamo.config.patch(specialize_float=True):  # module constants, not graph inputs
        compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=guarded).aot_compile((args, {}))
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        compiled.save_compiled_function(str(file))
    except OSError as error:
        _unwritable(str(file.parent), str(error))
    return compiled


@functools.cache
def _unwritable(folder: str, error: str) -> None:
    warnings.warn(f"vocabpar: cannot keep compiled passes in {folder} ({error}); every process compiles "
                  f"them again (set {DIRECTORY} to a writable directory)", RuntimeWarning, stacklevel=4)
