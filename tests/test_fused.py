"""The fused passes compiled (Inductor) against the same passes eager: the same bits for every
pass and shape, the same tokens from ``sample``, ``verify`` and the engine ``Sampler`` and the
same logprobs and top-n from ``token_logprobs`` at 1-4 ranks (tokens and top ids equal to the
reference too; the engine's step compiled whole, one graph with the collectives in it: its
``sample`` at 4 ranks, its ``verify`` at 3), one compilation per pass whatever the shapes; and the
float64 ``log`` / ``exp`` they rest on against libm. The rest of the suite runs the passes eager
(``VOCABPAR_COMPILE=0`` in conftest): in the one launch here two ranks warm half the passes each
(compiled into the store where it lacks them: on a fresh machine, or after a pass or what it
reads changed) and every rank then loads them all from it."""

import contextlib
import dataclasses
import functools
import io
import math
import os
import shutil
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from vocabpar import (
    SamplingParams,
    VocabLayout,
    comm,
    exactmath,
    launch,
    reference_sample,
    reference_verify,
    sample,
    token_logprobs,
)
from vocabpar.kernels import fused, store, warm
from vocabpar.launch import run
from vocabpar.sampling import Sampler, search, verify
from vocabpar.sampling.semantics import mass_bits, rank_key

V, B, K, TOP_N = 3000, 6, 2, 3
PARAMS = {
    "top-p 0.9": SamplingParams(top_p=0.9),
    "top-k 700": SamplingParams(top_k=700),
    "min-p 0.1": SamplingParams(min_p=0.1),
    "mixed": SamplingParams(temperature=[0.0, 0.7, 1.0, 1.3, 0.9, 1.0], top_k=[0, 40, 0, 900, 0, 5],
                            top_p=[1.0, 0.9, 0.5, 1.0, 0.95, 1.0], min_p=[0.0, 0.0, 0.05, 0.0, 0.1, 0.0]),
}


def test_log_and_exp_are_within_an_ulp_or_two_of_libm():
    g = torch.Generator().manual_seed(0)
    x = torch.exp(torch.empty(200_000, dtype=torch.float64).uniform_(-700, 700, generator=g))
    x = torch.cat([x, torch.tensor([1.0, 2.0, 0.5, math.sqrt(2), 1 - 2**-53, 1 + 2**-52, 2.0**-1022])])
    assert ((exactmath.log(x) - torch.log(x)).abs() <= 4e-16 * torch.log(x).abs().clamp(min=1e-300)).all()
    assert exactmath.log(torch.tensor([1.0], dtype=torch.float64)).item() == 0.0
    d = -torch.empty(200_000, dtype=torch.float64).uniform_(0, 60, generator=g)
    d = torch.cat([d, torch.tensor([0.0, -1e-300, float("-inf"), -800.0])])
    for shift in (0, 30, 45, 61):
        got, want = exactmath.exp_fixed(d, shift), torch.floor(torch.exp(d) * 2.0**shift)
        assert ((got.double() - want).abs() <= 1 + 4e-16 * want).all(), shift
    ends = torch.tensor([0.0, float("-inf")], dtype=torch.float64)
    assert exactmath.exp_fixed(ends, 45).tolist() == [2**45, 0]


PASSES = {name.split()[0]: fn for name, (fn, _) in warm.example_calls(1, 1).items()}
"""Every pass, by name: ``warm.example_calls`` holds each in every calling convention."""


def test_warm_covers_every_pass():
    assert set(PASSES.values()) == {f for f in vars(fused).values() if isinstance(f, fused.Fused)}


def _same(a, b) -> bool:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full target rows ``[B·(K+1), V]`` (half peaked, half flat), draft rows ``[B·K, V]``,
    draft tokens ``[B, K]`` and positions ``[B]`` every world size samples and verifies."""
    g = torch.Generator().manual_seed(1)
    full = torch.randn(B * (K + 1), V, generator=g) * 0.5
    full[: B * (K + 1) // 2] *= 10
    draft = torch.randn(B * K, V, generator=g) * 0.5
    return full, draft, torch.randint(0, V, (B, K), generator=g), torch.arange(B) * 5


def _sample_listed(local: torch.Tensor, layout: VocabLayout, params: SamplingParams, positions: torch.Tensor,
                   group: dist.ProcessGroup) -> torch.Tensor:
    """``sample``'s tokens with every threshold search on listed tokens (``DENSE_SHARE`` 1): a
    top-k search then draws from the tokens it listed above its bucket, not from the shard."""
    shipped, search.DENSE_SHARE = search.DENSE_SHARE, 1
    try:
        return sample(local, layout, params, positions=positions, group=group).tokens
    finally:
        search.DENSE_SHARE = shipped


def _tokens(n: int, group: dist.ProcessGroup) -> dict:
    """Per parameter set, the tokens of sample, the engine, verify and the engine's verify on the
    ``n`` ranks of ``group``, compiled and eager."""
    full, draft, drafts, pos = _inputs()
    layout = VocabLayout(V, n, scheme="uneven" if n % 2 else "padded", pad_to=16)
    ids = layout.local_token_ids(comm.rank(group))
    shard = lambda t: torch.where(ids >= 0, t[:, ids.clamp(min=0)], float("-inf"))  # noqa: E731
    sampler = Sampler(layout, group=group, max_rows=B * (2 * K + 1), max_top_n=TOP_N)
    out = {}
    for name, params in PARAMS.items():
        p = dataclasses.replace(params, seed=list(range(7, 7 + B)))
        batch = sampler.prepare(p, positions=pos)
        target, drafted = shard(full).view(B, K + 1, -1), shard(draft).view(B, K, -1)
        got = {}
        for mode in (True, False):
            with fused.compiling(mode):
                got[mode] = (sample(shard(full[:B]), layout, p, positions=pos, group=group).tokens,
                             sampler.sample(shard(full[:B]), batch).tokens,
                             verify(target, layout, p, drafts, positions=pos, draft_logits=drafted,
                                    group=group).tokens,
                             sampler.verify(target, batch, drafts, drafted).tokens,
                             _sample_listed(shard(full[:B]), layout, p, pos, group))
        out[n, name] = (got[True], got[False])
        if name == "mixed" and n > 2:
            out[n, "whole"] = _whole_step(sampler, shard(full[:B]), batch, target, drafts, drafted)
    scored = torch.arange(B) * 37 % V
    for mode in (True, False):
        with fused.compiling(mode):
            logprobs = (token_logprobs(shard(full[:B]), layout, scored, top_n=TOP_N, group=group),
                        sampler.token_logprobs(shard(full[:B]), scored, top_n=TOP_N))
        out[n, "logprobs", mode] = [(s.logprobs, s.ranks, s.top_ids, s.top_logprobs) for s in logprobs]
    return out


def _whole_step(sampler: Sampler, logits: torch.Tensor, batch, target: torch.Tensor, drafts: torch.Tensor,
                draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's call compiled whole (one graph, the collectives inside: Dynamo's capture, run
    by the eager backend) and eager, (compiled, eager) tokens: on 4 ranks (the padded layout) its
    ``sample``, on 3 (the uneven one) its ``verify`` (a trace costs seconds per rank)."""
    fn, args = (sampler.sample, (logits, batch)) if sampler.ranks.n == 4 else \
        (sampler.verify, (target, batch, drafts, draft_logits))
    with fused.compiling(False):
        return torch.compile(fn, fullgraph=True, backend="eager")(*args).tokens, fn(*args).tokens


def _check_passes(F: int, R: int, share: slice) -> dict[tuple[str, int, int], bool]:
    """Whether each call of ``share`` (of the sorted names of ``warm.example_calls``) gives the
    eager bits at ``[F, R]``."""
    calls = warm.example_calls(F, R, F + R)
    with fused.compiling(False):
        eager = {name: fn(*args) for name, (fn, args) in sorted(calls.items())[share]}
    return {(name, F, R): _same(calls[name][0](*calls[name][1]), want) for name, want in eager.items()}


SHAPES = ((5, 300), (1, 1000), (9, 7), (64, 513))
COMPILERS = 2
"""Ranks that warm the passes, half each (one per core of a 2-core machine) while the others
wait: every rank then loads every pass from the store."""


def _programs(f: fused.Fused) -> int:
    """How many programs ``f`` holds in this process."""
    return sum(map(len, f.programs.values()))


def _specialising(x: torch.Tensor, n: int) -> torch.Tensor:
    """A pass that compiles once per value of ``n`` (``bit_length`` specialises it)."""
    return x + n.bit_length()


def _past_the_recompile_limit() -> dict:
    """A pass called in more conventions than Dynamo's recompile limit (2 here): the outputs,
    the warnings, its state and its programs."""
    specialising, x = fused.Fused(_specialising), torch.arange(3.0)
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(recompile_limit=2):
        warnings.simplefilter("always")
        got = [specialising(x, n) for n in (1, 2, 4, 8, 1)]
    return {"got": got, "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
            "broken": specialising.broken, "full": specialising.full, "programs": _programs(specialising)}


@contextlib.contextmanager
def _own_store(directory: str) -> Iterator[None]:
    """Keep programs in ``directory`` inside the block, not in the machine's store."""
    before, os.environ[store.DIRECTORY] = os.environ.get(store.DIRECTORY), directory
    try:
        yield
    finally:
        os.environ.pop(store.DIRECTORY)
        if before is not None:
            os.environ[store.DIRECTORY] = before


def _store_keeps_programs_apart(directory: str) -> dict:
    """In a store of its own: how a pass object fares (programs compiled, loaded; outputs) where a
    torn file lies where its program belongs, then in a fresh object (as a new process), then for
    an int its program's guards reject (``bit_length`` specialises it), then again fresh; and in
    a store that cannot be written (under a file), the warnings and the output."""
    x, out = torch.arange(3.0), {}

    def call(f: fused.Fused, *ints: int) -> tuple[int, int, bool]:
        right = [torch.equal(f(x, n), x + n.bit_length()) for n in ints]
        return f.compiled, f.loaded, all(right)

    with _own_store(directory):
        fused.Fused(_specialising)(x, 1)
        (torn,) = list(store.directory().glob("*/*.aot"))
        torn.write_bytes(b"torn")
        out["over torn"] = call(fused.Fused(_specialising), 1)
        out["fresh"] = call(fused.Fused(_specialising), 1)
        out["other int"] = call(again := fused.Fused(_specialising), 1, 2)
        out["fresh, both"] = call(fused.Fused(_specialising), 1, 2)
        out["other int, again"] = call(again, 2, 1)
        out["files"] = sorted(p.name.rsplit("-", 1)[1] for p in store.directory().glob("*/*.aot"))
    blocker = os.path.join(directory, "a file")
    open(blocker, "w").close()
    with _own_store(os.path.join(blocker, "store")), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["unwritable"] = call(fused.Fused(_specialising), 1)
    out["unwritable warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    return out


def _compile_notices() -> list[str]:
    """What this rank prints on stderr as fresh pass objects run: one loaded from the store, then
    two that must compile (the store and the compiler stood in for: nothing compiles)."""
    program = types.SimpleNamespace(fn=_specialising, guard_check=lambda *args: True)
    kept = store.load, store.compile_and_save, fused._noticed[0]
    printed = []
    store.compile_and_save = lambda fn, args, options, file: program
    fused._noticed[0] = False  # warm silenced it in this process
    try:
        for found in (program, Path("missing"), Path("missing")):
            store.load = functools.partial(lambda found, *given: found, found)
            with contextlib.redirect_stderr(io.StringIO()) as err:
                fused.Fused(_specialising)(torch.arange(3.0), 1)
            printed.append(err.getvalue())
    finally:
        store.load, store.compile_and_save, fused._noticed[0] = kept
    return printed


def _ranks_job(world: int, directory: str) -> dict:
    """Every check on this rank, compiled: its share of the passes (in every calling convention)
    at several shapes against eager, then at each world size 1..``world`` (subgroups of the first
    n ranks) the tokens of sample, verify and the engine compiled and eager (the main process
    compares them with the reference's). The store's own checks keep their programs in
    ``directory``."""
    torch.manual_seed(0)
    out: dict = {"passes": {}, "tokens": {}}
    groups = {n: dist.new_group(list(range(n))) for n in range(1, world + 1)}
    share = slice(comm.rank(), None, COMPILERS) if comm.rank() < COMPILERS else slice(0)
    out["warmed"] = warm.warm(warm.checked(None)[share])
    with fused.compiling(True):
        for F, R in SHAPES:
            out["passes"] |= _check_passes(F, R, share)
        if comm.rank() == COMPILERS:  # ranks that wait for the compilers meanwhile
            # its programs kept apart from the passes', but from one run to the next: loaded
            # after the first run, they count against the limit as compiled ones do
            with _own_store(str(store.directory() / "test_fused limit")):
                out["limit"] = _past_the_recompile_limit()
        if comm.rank() == COMPILERS + 1:
            out["store"] = _store_keeps_programs_apart(os.path.join(directory, "own"))
        out["notices"] = _compile_notices()
        dist.barrier()
        out["passes"] |= _check_passes(2, 5, slice(None))  # every pass, loaded from the store
        for n in range(1, world + 1):
            if comm.rank() < n:
                out["tokens"] |= _tokens(n, groups[n])
    out["ran"] = sorted(fused.COMPILE_SECONDS)
    out["compiled"] = sorted(f.__name__ for f in PASSES.values() if f.compiled)
    out["loaded"] = sorted(f.__name__ for f in PASSES.values() if f.loaded)
    out["broken"] = sorted(k for k, f in PASSES.items() if f.broken)
    out["programs"] = {name: _programs(f) for name, f in PASSES.items()}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler for Inductor: the passes run eager (the rest of the suite checks them)")
    directory = str(tmp_path_factory.mktemp("store"))
    # Dynamo and Inductor (2.5 s of imports per process), once in the forkserver instead of in each
    # rank: conftest starts this file first on its worker, before the worker's first launch
    launch.preload("torch._dynamo", "torch._inductor.compile_fx")
    return run(_ranks_job, 4, 4, directory, timeout=600, run_timeout=1200, threads_per_rank=1)


def test_every_pass_compiled_gives_the_eager_bits(ranks):
    names = set(warm.example_calls(1, 1))
    # warm compiled every call before the checks, half on each compiling rank, outside any
    # ``compiling`` block (this process and the ranks run with VOCABPAR_COMPILE=0)
    assert ranks[0]["warmed"].keys() | ranks[1]["warmed"].keys() == names
    compiled_here = ranks[0]["passes"].keys() | ranks[1]["passes"].keys()
    assert compiled_here >= {(name, F, R) for name in names for F, R in SHAPES}
    for rank in ranks:  # and every rank ran every pass from the store
        assert {name for name, F, R in rank["passes"] if (F, R) == (2, 5)} == names
        assert all(rank["passes"].values()), [k for k, ok in rank["passes"].items() if not ok]
    assert not any(rank["broken"] for rank in ranks)
    every = {f.__name__ for f in PASSES.values()}
    assert all(every <= set(rank["ran"]) for rank in ranks)
    # the warming ranks compiled or loaded their share; the waiting ranks compiled none, they
    # loaded them all from the store
    assert set(ranks[0]["compiled"] + ranks[0]["loaded"] + ranks[1]["compiled"] + ranks[1]["loaded"]) == every
    assert not ranks[2]["compiled"] and not ranks[3]["compiled"], (ranks[2]["compiled"], ranks[3]["compiled"])
    assert set(ranks[2]["loaded"]) == set(ranks[3]["loaded"]) == every


def test_each_pass_compiles_once_whatever_the_shapes(ranks):
    """One program per pass and calling convention: batch sizes, widths (1 included), world sizes
    and parameters never recompile. Some passes have two calling conventions: ``best_kept`` and
    ``first_max`` take a shard (ids per column) or merged candidates (ids per entry), ``masses``
    a float32 shard or float64 candidates, ``logit_histogram`` unit weights or masses (a static
    flag), ``nan_and_ties`` a cut or none (greedy rows)."""
    conventions = {"first_max": 2, "logit_histogram": 2, "best_kept": 2, "masses": 2, "histogram": 2,
                   "members": 2, "nan_and_ties": 2}
    for rank in ranks:
        assert all(count <= conventions.get(name, 1) for name, count in rank["programs"].items()), \
            str(rank["programs"])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_tokens_compiled_equal_eager_and_the_reference_at_every_world_size(ranks, n):
    full, draft, drafts, pos = _inputs()
    for name, params in PARAMS.items():
        p = dataclasses.replace(params, seed=list(range(7, 7 + B)))
        want_sample = reference_sample(full[:B], p, positions=pos).tokens
        want_verify = reference_verify(full.view(B, K + 1, V), p, drafts, positions=pos,
                                       draft_logits=draft.view(B, K, V)).tokens
        for rank in ranks[:n]:
            compiled, eager = rank["tokens"][n, name]
            for got in (compiled, eager):
                assert all(torch.equal(got[i], want_sample) for i in (0, 1, 4)), (n, name)
                assert torch.equal(got[2], want_verify) and torch.equal(got[3], want_verify), (n, name)
        if name == "mixed" and n > 2:  # the engine's step compiled whole, collectives in the graph
            want = want_sample if n == 4 else want_verify
            for rank in ranks[:n]:
                compiled, eager = rank["tokens"][n, "whole"]
                assert torch.equal(compiled, want) and torch.equal(eager, want), n
    want_top = rank_key(full[:B], torch.arange(V)).topk(TOP_N, 1).indices
    for rank in ranks[:n]:
        compiled, eager = rank["tokens"][n, "logprobs", True], rank["tokens"][n, "logprobs", False]
        for got, want in zip(compiled, eager, strict=True):  # functional, then the engine
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), n
            assert torch.equal(got[2], want_top), n


def test_past_the_recompile_limit_new_conventions_run_eager_and_the_compiled_ones_stay(ranks):
    limit = ranks[COMPILERS]["limit"]
    x = torch.arange(3.0)
    assert all(torch.equal(got, x + n.bit_length()) for got, n in zip(limit["got"], (1, 2, 4, 8, 1)))
    assert len(limit["warnings"]) == 1 and "recompile limit" in limit["warnings"][0], limit["warnings"]
    assert limit["full"] and not limit["broken"] and limit["programs"] == 2


def test_the_store_replaces_a_torn_file_and_keeps_one_program_per_guarded_int(ranks):
    """A torn file is compiled over, then loaded by a fresh pass object; an int the first
    program's guards reject gets a second file, and a fresh object loads the right one for each."""
    got = ranks[COMPILERS + 1]["store"]
    assert got["over torn"] == (1, 0, True) and got["fresh"] == (0, 1, True), got
    assert got["other int"] == (1, 1, True) and got["fresh, both"] == (0, 2, True), got
    assert got["other int, again"] == (1, 1, True), got  # its programs stay in the object
    assert got["files"] == ["0.aot", "1.aot"], got


def test_a_store_that_cannot_be_written_warns_once_and_the_pass_still_runs_compiled(ranks):
    got = ranks[COMPILERS + 1]["store"]
    assert got["unwritable"] == (1, 0, True), got
    (warning,) = got["unwritable warnings"]
    assert "cannot keep compiled passes in" in warning and "VOCABPAR_PASS_STORE" in warning, warning


def test_the_first_compile_in_a_process_says_so_once_on_rank_0(ranks):
    """Not when a pass loads from the store; on rank 0 before the first compilation, not again
    for the next pass; never on the other ranks."""
    assert ranks[0]["notices"] == ["", fused.NOTICE + "\n", ""]
    assert all(rank["notices"] == ["", "", ""] for rank in ranks[1:])
    assert "vocabpar warm" in fused.NOTICE and "minute" in fused.NOTICE


@pytest.mark.parametrize(("rank", "quiet", "said"), [(None, False, True), ("0", False, True),
                                                     ("1", False, False), (None, True, False)])
def test_the_compile_notice_without_a_process_group_follows_rank_and_quiet(monkeypatch, capsys, rank,
                                                                            quiet, said):
    """Without a process group, the ``RANK`` variable (unset: 0) decides; :func:`fused.quiet`
    silences it; at most once per process."""
    monkeypatch.setattr(fused, "_noticed", [False])
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    if quiet:
        fused.quiet()
    fused.notice_compiling()
    fused.notice_compiling()
    assert capsys.readouterr().err == (fused.NOTICE + "\n" if said else "")


def test_histogram_bins_fit_int32_only_where_no_bin_can_overflow():
    """Counts take int32 bins; at the widest shard they allow, every token in one bin at the
    largest weight still sums exactly (here run eager; the passes above pin compiled = eager)."""
    assert fused.int32_sums(1, 2**29) and not fused.int32_sums(mass_bits(129280), 300)
    columns = 2**16 - 1
    assert fused.int32_sums(15, columns) and not fused.int32_sums(16, columns)
    column = torch.full((2, columns), 7)
    column[1] = torch.arange(columns) % 257
    added = torch.full((2, columns), 2**15 - 1)
    got = fused._int32_bins(column, added, 256)
    assert torch.equal(got, torch.zeros(2, 257, dtype=torch.long).scatter_add_(1, column, added))
    assert got[0, 7] == columns * (2**15 - 1) == 2**31 - 2**16 - 2**15 + 1
