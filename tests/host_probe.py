"""Count the kernel launches and host reads of vocabpar's own code paths, for the planner's data
(:mod:`vocabpar.plan.host`): each measured on real gloo ranks, agreement checks off.

A launch is an ATen operation that does work: views, allocations, metadata queries and the
collectives themselves (priced apart) are left out; on a GPU each of the others is about one kernel
launch or one small copy. A fused pass (:mod:`vocabpar.sampling.fused`) counts as one launch,
what it is compiled (the suite runs it eager: its inner operations are not counted). Host reads
are :func:`vocabpar.host_reads.counting`'s. Counts are per
call and do not depend on the batch size.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from vocabpar import ParallelLMHead, SamplingParams, VocabLayout, comm, compute_logits, sample
from vocabpar.collect import broadcast_tokens
from vocabpar.host_reads import counting
from vocabpar.plan import host
from vocabpar.sampling import Sampler, fused, verify
from vocabpar.sampling.scoring import token_logprobs

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


def params(key: host.SamplerKey, rows: int) -> SamplingParams:
    """Sampling parameters standing for ``key``: top-k 50 (within the candidates) or 1000 (a
    search), top-p 0.9, min-p 0.05."""
    if key.greedy:
        return SamplingParams(temperature=0.0, seed=list(range(rows)))
    return SamplingParams(temperature=1.0, top_k={"none": 0, "candidates": 50, "search": 1000}[key.top_k],
                          top_p=0.9 if key.top_p else 1.0, min_p=0.05 if key.min_p else 0.0,
                          seed=list(range(rows)))


def _shard(full: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    ids = layout.local_token_ids(comm.rank())
    local = full[..., ids.clamp(min=0)]
    local[..., ids < 0] = float("-inf")
    return local


def measure(rows: int = B, parts: tuple[str, ...] = ("sample", "score", "collect", "engine"),
            keys: tuple[host.SamplerKey, ...] = host.SAMPLER_KEYS) -> dict[str, dict]:
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
            for draft in (False, True) if not key.greedy else (False,):
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
            for draft in (False, True) if not key.greedy else (False,):
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
