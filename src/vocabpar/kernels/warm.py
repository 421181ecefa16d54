"""Compile the local passes ahead of the first call that needs them.

Each compiled pass is kept on disk as a program (:mod:`vocabpar.kernels.store`); a later process
that calls a pass the same way loads it in milliseconds instead of compiling it for 0.3-10 s
(plus Inductor's start-up). Its C++ kernels are specialised on the number of threads the process
runs with (``torch.get_num_threads()``), so a warm store serves only processes with that many
threads. :func:`warm` compiles every pass of :mod:`vocabpar.kernels.fused` in every calling
convention the samplers use, on small synthetic rows: the shapes do not matter (every dimension
is dynamic), the dtypes and static flags do.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time

import torch

from vocabpar.kernels import fused
from vocabpar.sampling.noise import gumbel_bound, row_keys
from vocabpar.sampling.semantics import mass_bits, mass_shift, order_key

VOCAB = 3000
"""The vocabulary size the examples' masses are scaled for (one graph serves every size)."""


def example_calls(rows: int = 5, columns: int = 300, seed: int = 0) -> dict[str, tuple[fused.Fused, tuple]]:
    """Every pass in every calling convention, name -> (pass, arguments), on ``[rows, columns]``
    float32 logits with padding columns (id -1), -inf and tied values (``rows, columns >= 1``).
    Deterministic in ``seed``; a name with a second word is a pass's further convention."""
    F, R = rows, columns
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(F, R, generator=g) * 2).bfloat16().float()  # bfloat16 steps: tied values
    x[:, ::7] = float("-inf")
    ids = torch.randperm(4 * R, generator=g)[:R].sort().values
    ids[-(R // 5):] = -1
    t = torch.rand(F, generator=g, dtype=torch.float64) + 0.5
    z_max = (x.double() / t[:, None]).amax(1)
    lower = torch.where(torch.arange(F) % 2 == 0, x.double().quantile(0.3, 1), float("-inf"))
    min_z = z_max - 3
    keys = row_keys(torch.arange(F) + seed, torch.arange(F) * 3)
    scale = mass_shift(VOCAB) - seed % 3
    with fused.compiling(False):
        p = fused.masses(x, lower, t, min_z, z_max, scale)
        q = fused.masses(x.flip(1), lower, t, min_z, z_max, scale)
    real, eleven, zeros = ids >= 0, torch.full((F,), 11), torch.zeros(F, dtype=torch.long)
    first = order_key(x[:, 0]) + 2**31  # order keys of the rows' first column
    shift = torch.randint(11, 33, (F,), generator=g)  # at least the 11 bits a round reads
    order = torch.randint(0, 2**32, (F, R), generator=g)
    per_token = (shift[:, None], torch.full((F, 1), 11), order[:, :1] >> shift[:, None])
    listed = [a.expand(F, R).flatten().clone() for a in (order, p, *per_token)]  # copies, as a search lists
    entry_ids = torch.where(x > -2, ids.expand(F, R), -1)  # merged candidates: ids per entry
    counts, weighed = fused.int32_sums(1, R), fused.int32_sums(mass_bits(VOCAB), R)
    with_nan = torch.where(x > 2, float("nan"), x)  # raw logits holding NaN
    return {
        "masses": (fused.masses, (x, lower, t, min_z, z_max, scale)),
        "masses candidates": (fused.masses, (x.double(), lower, t, min_z, z_max, scale)),
        "mass_totals": (fused.mass_totals, (x, lower, t, min_z, z_max, scale)),
        "best_kept": (fused.best_kept, (x, ids, lower, t, min_z, keys)),
        "best_kept candidates": (fused.best_kept, (x.double(), entry_ids, lower, t, min_z, keys)),
        "reachable": (fused.reachable, (x, ids, lower, t, min_z, z_max + 3.5, keys[:, 0].contiguous(),
                                        gumbel_bound())),
        "residual_pass": (fused.residual_pass, (p, p.sum(1), q, q.sum(1).clamp(min=1), keys, ids)),
        "residual_keys": (fused.residual_keys, (torch.arange(F) * 7, torch.arange(F) + 3)),
        "sample_keys": (fused.sample_keys, (torch.arange(F) * 2**40 + seed, torch.arange(F) * 5)),
        "accept_uniforms": (fused.accept_uniforms, (torch.arange(3 * F) // 3, torch.arange(3 * F))),
        "first_max": (fused.first_max, (x.double(), ids)),
        "nan_and_ties": (fused.nan_and_ties, (with_nan, x, real, x[:, R // 2].double())),
        "nan_and_ties uncut": (fused.nan_and_ties, (with_nan, x, real, None)),
        "histogram": (fused.histogram, (x, real, p, shift, eleven, first >> shift, 2048, weighed)),
        "histogram units": (fused.histogram, (x, real, None, shift, eleven, first >> shift, 2048, counts)),
        "members": (fused.members, (x, real, p, first - 2**20, first + 2**20)),
        "members units": (fused.members, (x, real, None, first - 2**20, first + 2**20)),
        "logit_histogram units": (fused.logit_histogram, (x, ids, lower, t, min_z, z_max, scale, 32, 11,
                                                          zeros, 2048, True, counts)),
        "logit_histogram masses": (fused.logit_histogram, (x, ids, lower, t, min_z, z_max, scale, 21, 11,
                                                           zeros + 1024, 2048, False, weighed)),
        "digits": (fused.digits, (*listed, 2048)),
        "rank_keys": (fused.rank_keys, (x, ids)),
        "order_keys": (fused.order_keys, (x.flatten(),)),
        "scored": (fused.scored, tuple(a.clone() for a in (x.double().flatten(), keys.repeat_interleave(R, 0),
                                                          ids.clamp(min=0).repeat(F)))),
    }


def checked(names: list[str] | None) -> list[str]:
    """``names`` (every call of :func:`example_calls` when None), or ``ValueError`` naming the
    unknown ones and the known ones."""
    known = sorted(example_calls(1, 1))
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown pass(es) {', '.join(unknown)}; the passes are: {', '.join(known)}")
    return known if names is None else list(names)


def warm(names: list[str] | None = None) -> dict[str, float | None]:
    """Compile the calls of :func:`example_calls` named (all when None; see :func:`checked`) in
    this process, with its current thread count; seconds per call, None for a pass that could
    not compile (it runs eager, and has warned why). Compiles even where ``VOCABPAR_COMPILE=0``;
    silences :data:`~vocabpar.kernels.fused.NOTICE` in this process (compiling is what it is for)."""
    names, calls = checked(names), example_calls()
    fused.quiet()
    seconds: dict[str, float | None] = {}
    with fused.compiling(True):
        for name in names:
            start = time.perf_counter()
            fn, args = calls[name]
            fn(*args)
            seconds[name] = None if fn.broken else time.perf_counter() - start
    return seconds


def warm_in_processes(names: list[str] | None, jobs: int, threads: int) -> dict[str, float | None]:
    """:func:`warm` split over ``jobs`` fresh processes of ``threads`` threads each (the count the
    store will serve), side by side; as :func:`warm`, in the order of ``names``."""
    names = checked(names)
    if not names:
        return {}
    shares = [names[i::jobs] for i in range(min(jobs, len(names)))]
    context = multiprocessing.get_context("spawn")  # no torch state inherited: each compiles from scratch
    with concurrent.futures.ProcessPoolExecutor(len(shares), mp_context=context) as pool:
        done = [pool.submit(_warm_share, share, threads) for share in shares]
        seconds = {k: v for future in done for k, v in future.result().items()}
    return {name: seconds[name] for name in names}


def _warm_share(names: list[str], threads: int) -> dict[str, float | None]:
    torch.set_num_threads(threads)
    return warm(names)
