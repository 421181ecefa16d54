"""Count the kernel launches and host reads of vocabpar's own code paths, for the planner's data
(:mod:`vocabpar.plan.host`): each measured on real gloo ranks, agreement checks off.
``scripts/count_launches.py`` writes :func:`tables` of every entry to the data file;
``tests/test_host_work.py`` counts a sample again and compares.

A launch is an ATen operation that does work: views, allocations, metadata queries and the
collectives themselves (priced apart) are left out; on a GPU each of the others is about one kernel
launch or one small copy. A fused pass (:mod:`vocabpar.kernels.fused`) counts as one launch,
what it is compiled (the suite runs it eager: its inner operations are not counted). Host reads
are :func:`vocabpar.host_reads.counting`'s. Counts are per
call and do not depend on the batch size.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from vocabpar import ParallelLMHead, SamplingParams, VocabLayout, comm, compute_logits, sample
from vocabpar.collect import broadcast_tokens
from vocabpar.host_reads import counting
from vocabpar.kernels import fused
from vocabpar.plan import host
from vocabpar.sampling import Sampler, verify
from vocabpar.sampling.engine import STEP_OPTIONS
from vocabpar.sampling.scoring import token_logprobs
from vocabpar.wire import filters

FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
        "alias", "_local_scalar_dense", "set_", "resize_", "sym_size", "sym_stride", "sym_numel", "dim",
        "is_nonzero", "item", "_has_compatible_shallow_copy_type"}
"""Operations that launch nothing: allocation, aliasing, metadata (``_local_scalar_dense`` is the
copy behind a host read, counted as a read)."""


class Launches(TorchDispatchMode):
    """Counts launching ATen operations by name."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ in a Dynamo-disabling frame per operation (and
        # imports Dynamo for it, 1 s per rank); nothing runs compiled under this mode
        return False

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not (func.is_view or name in FREE or func.namespace in ("c10d", "_c10d_functional")):
            self.counts[name] += 1
        return out


@contextlib.contextmanager
def _one_launch_per_pass(launches: Launches) -> Iterator[None]:
    """Inside the block, each fused pass adds one launch and hides its inner operations."""
    call = fused.Fused.__call__

    def counted_call(self, *args):
        launches.counts[f"fused {self.__name__}"] += 1
        with _disable_current_modes():
            return call(self, *args)

    fused.Fused.__call__ = counted_call
    try:
        yield
    finally:
        fused.Fused.__call__ = call


def counted(fn, *args, **kwargs) -> tuple[int, int]:
    """``(launches, host reads)`` of ``fn(*args, **kwargs)``."""
    launches = Launches()
    with counting() as reads, launches, _one_launch_per_pass(launches):
        fn(*args, **kwargs)
    return sum(launches.counts.values()), sum(reads.values())


V, B, K = 4000, 4, 2


def families(rows: int = B) -> dict[str, torch.Tensor]:
    """Peaked (LLM-like: the planner's typical case), flat, Zipf and heavily tied logit rows."""
    g = torch.Generator().manual_seed(7)
    zipf = torch.stack([-1.1 * torch.log1p(torch.randperm(V, generator=g).float()) for _ in range(rows)])
    return {"peaked": torch.randn(rows, V, generator=g) * 5, "flat": torch.randn(rows, V, generator=g) * 0.5,
            "zipf": zipf + torch.randn(rows, V, generator=g) * 0.1,
            "tied": (torch.randint(0, 4, (rows, V), generator=g).float() * 0.25)}


def params(key: str, rows: int) -> SamplingParams:
    """Sampling parameters standing for entry ``key``: each filter's example values
    (:func:`vocabpar.wire.filters.example`: top-k 50 within the candidates or 1000 a search, top-p
    0.9, min-p 0.05, top-n-sigma 1)."""
    s = filters.example(key)
    return SamplingParams(temperature=s.temperature, **{f.name: getattr(s, f.name) for f in filters.FILTERS},
                          seed=list(range(rows)))


def _shard(full: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    ids = layout.local_token_ids(comm.rank())
    local = full[..., ids.clamp(min=0)]
    local[..., ids < 0] = float("-inf")
    return local


def measure(rows: int = B, parts: tuple[str, ...] = ("sample", "score", "collect", "engine"),
            keys: tuple[str, ...] = filters.keys()) -> dict[str, dict]:
    """On each rank: per sampler key (of ``keys``) and family, ``(launches, reads)`` of ``sample``
    and of ``verify`` (one-hot drafts and, sampled, draft logits) and of the engine
    ``Sampler.sample``; per top-n of ``token_logprobs``; per strategy of ``compute_logits`` and
    the ids exchange (``parts``: which of the four)."""
    layout = VocabLayout(V, comm.world_size())
    out: dict[str, dict] = {"sample": {}, "verify": {}, "score": {}, "collect": {}, "engine": {}}
    fams = families(rows * (2 * K + 1))
    engine = Sampler(layout, max_rows=rows, check=False)
    for key in keys if "engine" in parts else ():
        batch = engine.prepare(params(key, rows), positions=torch.arange(rows))
        verifier = Sampler(layout, max_rows=rows * (2 * K + 1), check=False)
        for name, full in fams.items():
            out["engine"][key, name] = counted(engine.sample, _shard(full[:rows], layout), batch)
            target = _shard(full[: rows * (K + 1)], layout).view(rows, K + 1, -1)
            drafts = full[:rows, :K].argsort(1)[:, :K] % V
            for draft in (False, True) if key != "greedy" else (False,):
                dl = _shard(full[rows * (K + 1):], layout).view(rows, K, -1) if draft else None
                vbatch = verifier.prepare(params(key, rows), positions=torch.arange(rows))
                out["engine"][key, draft, name] = counted(verifier.verify, target, vbatch, drafts, dl)
    for key in keys if "sample" in parts else ():
        p = params(key, rows)
        for name, full in fams.items():
            local = _shard(full[:rows], layout)
            pos = torch.arange(rows)
            out["sample"][key, name] = counted(sample, local, layout, p, positions=pos, check=False)
            target = _shard(full[: rows * (K + 1)], layout).view(rows, K + 1, -1)
            drafts = full[:rows, :K].argsort(1)[:, :K] % V
            for draft in (False, True) if key != "greedy" else (False,):
                dl = _shard(full[rows * (K + 1):], layout).view(rows, K, -1) if draft else None
                out["verify"][key, draft, name] = counted(verify, target, layout, p, drafts, positions=pos,
                                                          draft_logits=dl, check=False)
    if "score" in parts:
        local = _shard(families()["peaked"], layout)
    for top_n in (0, 5) if "score" in parts else ():
        out["score"][top_n] = counted(token_logprobs, local, layout, torch.arange(B), top_n=top_n,
                                      check=False)
    if "collect" not in parts:
        return out
    hidden = torch.randn(comm.world_size() * 2, 16)
    for strategy in ("all_gather", "gather", "all_to_all", "dp_gather_scatter", "none"):
        head = ParallelLMHead(layout, 16)
        rows_in = hidden[:2] if strategy == "dp_gather_scatter" else hidden
        out["collect"][strategy] = counted(compute_logits, head, rows_in, strategy=strategy, check=False,
                                           scatter="all_gather")
    replicated = VocabLayout(V, comm.world_size(), scheme="replicated")
    out["collect"]["replicated"] = counted(compute_logits, ParallelLMHead(replicated, 16), hidden,
                                           strategy="replicated", check=False)
    tokens = torch.arange(hidden.shape[0])
    out["collect"]["broadcast_ids"] = counted(broadcast_tokens, tokens if comm.rank() == 0 else None,
                                              hidden.shape[0], check=False)
    out["collect"]["all_gather_ids"] = counted(comm.all_gather_uneven, tokens[:2], [2] * comm.world_size())
    return out


def busiest(per_rank: list[dict], part: str, key) -> tuple[int, int]:
    """``(launches, host reads)`` of ``part``'s ``key`` on the rank that launches most."""
    return max(r[part][key] for r in per_rank)


def tables(two: list[dict], three: list[dict]) -> dict[str, dict[str, list[int]]]:
    """The planner's measured tables (:data:`vocabpar.plan.host.MEASURED`, entries by name) from
    :func:`measure` on two ranks and (score and collect) three: a sampler's typical work is the
    busiest rank's on peaked rows, its worst the most on any family; scoring and collection are
    fitted as launches plus launches per rank (their reads must not grow with the ranks). Holds
    the keys the measurements hold."""
    out: dict[str, dict[str, list[int]]] = {table: {} for table in host.MEASURED}
    families_seen: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
    for part, table in (("sample", "functional"), ("verify", "functional_verify"), ("engine", "engine")):
        for key in two[0][part]:
            *branch, family = key  # (sampler key, family) or, verifying, (sampler key, draft, family)
            name = host.verify_name(*branch) if len(branch) == 2 else branch[0]
            where = (f"{table}_verify" if part == "engine" and len(branch) == 2 else table, name)
            families_seen.setdefault(where, {})[family] = busiest(two, part, key)
    for (table, name), counts in families_seen.items():
        worst = [max(c[i] for c in counts.values()) for i in (0, 1)]
        out[table][name] = [*counts["peaked"], *worst]
    fitted = {"score": {host.score_name(n): n for n in two[0]["score"]},
              "collect": {s: s for s in two[0]["collect"] if not s.endswith("_ids")}}
    for table, names in fitted.items():
        for name, key in names.items():
            (l2, r2), (l3, r3) = busiest(two, table, key), busiest(three, table, key)
            if r2 != r3:
                raise ValueError(f"{table} {name!r} reads {r2} times on two ranks, {r3} on three")
            out[table][name] = [l2 - 2 * (l3 - l2), l3 - l2, r2]
    return out


KERNEL_CALL = re.compile(r"^\s+(?:\w+ = )?(\w+\.run|cpp_fused_\w+|extern_kernels\.\w+|aten\.[\w.]+"
                         r"|torch\.ops\.[\w.]+)\(", re.M)
"""A call in the ``call`` function of Inductor's generated program that runs a kernel: a generated
kernel (C++ ``cpp_fused_*`` here, a Triton kernel's ``.run`` on a GPU), an extern kernel or an ATen
operation Inductor left in the program."""


def program_kernels(code: str) -> int:
    """Kernels one run of an Inductor program (its generated source ``code``) launches, the
    collectives and their waits left out (priced apart)."""
    body = code[code.index("def call("):]
    calls = KERNEL_CALL.findall(body)
    return sum(1 for name in calls if "_c10d_functional" not in name and "wait_tensor" not in name)


class _Generated(Exception):
    """Raised once Inductor has generated a program's source: nothing builds or runs it."""


def compiled_kernels(fn, *args) -> int:
    """Kernels per call of ``fn(*args)`` compiled whole (``torch.compile(fullgraph=True)``,
    Inductor) with vocabpar's passes traced into the program. Inductor lowers and schedules the
    program and writes its source, then the compile stops (as ``torch._inductor.utils.get_code``
    does): nothing is built or run, so a count sends nothing. Under the options a step is compiled
    with (:data:`vocabpar.sampling.engine.STEP_OPTIONS`); Inductor's caches off: a cached program
    would skip the lowering."""
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []

    def generate(graph: GraphLowering):
        wrapper, _ = graph.codegen_with_cpp_wrapper() if graph.cpp_wrapper else graph.codegen()
        codes.append(wrapper.value)
        raise _Generated

    torch._dynamo.reset()
    uncached = torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False, **STEP_OPTIONS)
    with fused.compiling(False), mock.patch.object(GraphLowering, "compile_to_module", generate), uncached, \
            torch._functorch.config.patch(enable_autograd_cache=False):
        try:
            torch.compile(fn, fullgraph=True)(*args)
        except Exception as error:  # Dynamo wraps the stop in its own error: anything else is raised
            chain = [error]
            while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
                chain.append(chain[-1].__cause__ or chain[-1].__context__)
            if not any(isinstance(e, _Generated) for e in chain):
                raise
    torch._dynamo.reset()
    return sum(program_kernels(code) for code in codes)


def measure_compiled(rows: int = B, keys: tuple[str, ...] = filters.keys()) -> dict[str, dict]:
    """On each rank: per sampler key (of ``keys``), the kernels of the engine ``Sampler.sample``
    and ``verify`` (one-hot drafts and, sampled, draft logits) compiled whole, on peaked rows."""
    layout = VocabLayout(V, comm.world_size())
    full = families(rows * (2 * K + 1))["peaked"]
    engine = Sampler(layout, max_rows=rows, check=False)
    verifier = Sampler(layout, max_rows=rows * (2 * K + 1), check=False)
    out: dict[str, dict] = {"engine": {}}
    for key in keys:
        batch = engine.prepare(params(key, rows), positions=torch.arange(rows))
        out["engine"][key] = compiled_kernels(engine.sample, _shard(full[:rows], layout), batch)
        target = _shard(full[: rows * (K + 1)], layout).view(rows, K + 1, -1)
        drafts = full[:rows, :K].argsort(1)[:, :K] % V
        vbatch = verifier.prepare(params(key, rows), positions=torch.arange(rows))
        for draft in (False, True) if key != "greedy" else (False,):
            dl = _shard(full[rows * (K + 1):], layout).view(rows, K, -1) if draft else None
            out["engine"][key, draft] = compiled_kernels(verifier.verify, target, vbatch, drafts, dl)
    return out


def measure_compiled_scores(rows: int = B, top_n: int = 5) -> dict[str, int]:
    """On each rank: the kernels of the engine ``Sampler``'s greedy ``sample`` with top-``top_n``
    logprobs and of its ``token_logprobs`` with ``top_n``, each compiled whole."""
    layout = VocabLayout(V, comm.world_size())
    local = _shard(families(rows)["peaked"], layout)
    engine = Sampler(layout, max_rows=rows, max_top_n=top_n, check=False)
    batch = engine.prepare(SamplingParams(temperature=0.0, logprobs=top_n, seed=list(range(rows))),
                           positions=torch.arange(rows))
    def score(x: torch.Tensor, ids: torch.Tensor):
        return engine.token_logprobs(x, ids, top_n=top_n)

    return {"sample+logprobs": compiled_kernels(engine.sample, local, batch),
            "token_logprobs+top_n": compiled_kernels(score, local, torch.arange(rows))}
