"""Where a sampler call's local time goes: each fused pass (``vocabpar.kernels.fused``, compiled)
against the rest (eager glue: candidates, gathers of listed tokens, small ops), on 4 local gloo
ranks (B=256, V=129280, FP32; the configurations and logits of ``bench_sampling.py``).

Run: ``.venv/bin/python benchmarks/bench_passes.py [--quick]`` (``--quick``: the quick sizes of
``bench_sampling.py``, three configurations). Per configuration and sampler (the
functional ``sample()`` and the engine ``Sampler``), after two warm-up calls, one call with every
pass timed (wall ms on the slowest rank, 2 ranks per core) beside the floor (one row-max pass plus
an all-gather of 16 bytes per row); the rest split into ``wire`` (inside vocabpar's collectives,
waits for slower peers included), ``select`` (``Tensor.topk`` and ``Tensor.sort`` outside the
passes: round one's candidates, merges of gathered candidates), ``compact`` (``Tensor.nonzero``: a
pass's flags turned into the rows and columns of the tokens it flagged), ``max`` (``Tensor.max``:
round one's row max of the shard, the floor's own pass, and maxima of gathered values) and
``glue`` (everything else: eager small ops, gathers of listed tokens, Python); ``coll``:
collectives per call, ``bytes``: bytes received per call, ``reads``: host reads of device values
per call (busiest rank; counted in a further, untimed call). Then round one's selection against
the fusable alternative built from the library's own compiled passes: ``Tensor.topk`` of the
candidates beside the three digit ``histogram`` rounds and the ``members`` pass an exact radix
select needs at least (its compaction of the flags into columns not counted), and the engine's
round-one checks as one compiled pass beside the same operations eager. Then, side by side,
the functional call with the threshold search's rounds always on the listed bucket and as shipped.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from vocabpar import SamplingParams, VocabLayout, comm, sample
from vocabpar.kernels import fused
from vocabpar.launch import run
from vocabpar.sampling import Sampler, search
from vocabpar.wire.filters import candidate_count

sys.path.insert(0, str(Path(__file__).parent))
import bench_sampling as bs  # noqa: E402
from common import bottom_line, host_reads, ms, over, passes_note, show, sized, stored_passes, table  # noqa: E402

NAMES = sized(("top-p 0.9 (flat)", "top-p 0.9 (zipf)", "top-k 1000 (peaked)", "min-p 0.1 (flat)",
               "top-p 0.9 (peaked)", "t0.8 k50 p0.95 minp0.05"),
              ("top-p 0.9 (flat)", "top-k 1000 (peaked)", "t0.8 k50 p0.95 minp0.05"))


def _warm_then_time(fn) -> tuple[float, object]:
    """Seconds of one call of ``fn`` after a warm-up call (a barrier between the two), and what
    that call returned."""
    fn()
    torch.distributed.barrier()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _side_by_side(fn, module, name: str, values: tuple) -> tuple[float, float, bool]:
    """Seconds of one call of ``fn`` (a ``sample()``) with ``module.name`` set to each of two
    ``values``, each after a warm-up call; and whether both draw the same tokens."""
    shipped, seconds, tokens = getattr(module, name), [], []
    for value in values:
        setattr(module, name, value)
        spent, out = _warm_then_time(fn)
        seconds.append(spent)
        tokens.append(out.tokens)
    setattr(module, name, shipped)
    return seconds[0], seconds[1], torch.equal(*tokens)


ALTERNATIVES = {
    "search": (search, "DENSE_SHARE", (1, search.DENSE_SHARE), "listed", "shipped",
               "the search's rounds on the listed bucket vs as shipped (in place when the bucket "
               f"holds over 1/{search.DENSE_SHARE} of the shard)"),
}
"""Side-by-side runs of the functional ``sample()``: a module constant set to the form not
shipped, then to the shipped one."""


COLLECTIVES = ("all_reduce", "all_reduce_max", "all_gather", "gather", "broadcast", "all_to_all")
"""The functions of ``vocabpar.comm`` that issue a collective (the others call these)."""
TENSOR_PARTS = {"topk": "select", "sort": "select", "nonzero": "compact", "max": "max"}
"""The ``Tensor`` methods timed outside the passes, and the part each one's time counts in."""
PARTS = ("wire", "select", "compact", "max")


@contextlib.contextmanager
def _timing(spent: collections.Counter) -> Iterator[None]:
    """Inside the block, ``spent`` adds up the seconds in each fused pass (by name), in the
    collectives (``wire``) and in the :data:`TENSOR_PARTS` methods (by part)."""
    originals = {(fused.Fused, "__call__"): fused.Fused.__call__}
    originals |= {(comm, name): getattr(comm, name) for name in COLLECTIVES}
    originals |= {(torch.Tensor, name): getattr(torch.Tensor, name) for name in TENSOR_PARTS}

    def timed(fn, label):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[label(args)] += time.perf_counter() - start
            return out
        return wrapper

    for (owner, name), fn in originals.items():
        part = "wire" if owner is comm else TENSOR_PARTS.get(name)
        label = (lambda args: args[0].__name__) if owner is fused.Fused else (lambda args, part=part: part)
        setattr(owner, name, timed(fn, label))
    try:
        yield
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)


def _select(local: torch.Tensor, real: torch.Tensor, c: int) -> tuple[float, float]:
    """Seconds of round one's ``topk`` of ``c`` candidates per row of ``local``, and of the passes
    an exact radix select of them would run instead: a ``histogram`` of each digit of the order
    keys (11 + 11 + 10 bits, each in the bucket the previous one picked), then ``members`` to flag
    the tokens at or above the c-th key; each after a warm-up call."""
    rows = local.shape[0]

    def radix():
        prefix = torch.zeros(rows, dtype=torch.long)
        for shift, bits in ((32, 11), (21, 11), (10, 10)):
            fused.histogram(local, real, None, torch.full((rows,), shift), torch.full((rows,), bits), prefix,
                            2**11, True)
        fused.members(local, real, None, prefix, torch.full((rows,), 2**32))

    return _warm_then_time(lambda: local.topk(c, 1))[0], _warm_then_time(radix)[0]


def _checks(local: torch.Tensor, real: torch.Tensor, c: int) -> tuple[float, float]:
    """Seconds of the engine's round-one checks (``fused.nan_and_ties``: the NaN check and the
    ties at the c-th candidate) compiled, and eager (the same operations one by one); each after a
    warm-up call."""
    cut = local.topk(c, 1).values[:, -1].double()
    spent = []
    for compiled in (True, False):
        with fused.compiling(compiled):
            spent.append(_warm_then_time(lambda: fused.nan_and_ties(local, local, real, cut))[0])
    return spent[0], spent[1]


def _job(names: tuple[str, ...]) -> dict:
    with stored_passes() as eager:
        out = _calls(names)
    return out | {"note": passes_note(eager)}


def _calls(names: tuple[str, ...]) -> dict:
    layout = VocabLayout(bs.V, bs.N)
    pos = torch.arange(bs.B)
    sampler = Sampler(layout, max_rows=bs.B)
    spent: collections.Counter = collections.Counter()

    out = {}
    for name in names:
        kind, params = bs.CONFIGS[name]
        local = bs._logits(kind, layout)
        p = SamplingParams(**{**params.__dict__, "seed": list(range(bs.B))})
        batch = sampler.prepare(p, positions=pos)
        paths = (("func", lambda local=local, p=p: sample(local, layout, p, positions=pos, check=False)),
                 ("engine", lambda local=local, batch=batch: sampler.sample(local, batch)))
        for which, fn in paths:
            fn()
            fn()
            spent.clear()
            torch.distributed.barrier()
            with _timing(spent):
                start = time.perf_counter()
                fn()
                total = time.perf_counter() - start
            start = time.perf_counter()
            bs._floor(local)
            floor = time.perf_counter() - start
            with comm.recording() as sent:  # an untimed call: the read counter slows every op
                reads = host_reads(fn)
            out[name, which] = (total, dict(spent), floor, len(sent), reads, sum(b for _, b in sent))
        for alternative, (module, constant, values, *_) in ALTERNATIVES.items():
            out[name, alternative] = _side_by_side(paths[0][1], module, constant, values)
    real = layout.local_token_ids(comm.rank()) >= 0
    c = candidate_count(bs.N, int(real.sum()), {"top_p": [0.9]})
    peaked = bs._logits("peaked", layout)
    out["select"] = (c, *_select(peaked, real, c))
    out["checks"] = _checks(peaked, real, c)
    return out


def _share(rows: list[tuple[float, dict[str, float]]]) -> str:
    """The bottom line from (total seconds, seconds per part) of each call: what share of the
    summed time the passes take, and each other part."""
    total = sum(t for t, _ in rows)
    parts = {part: sum(p.get(part, 0.0) for _, p in rows) / total for part in ("passes", *PARTS, "glue")}
    rest = ", ".join(f"{part} {share:.0%}" for part, share in parts.items() if part != "passes")
    return (f"the compiled passes take {parts['passes']:.0%} of a sampler call's time (both samplers, "
            f"{len(rows) // 2} configurations, {total * 1e3:.0f} ms in all); the rest: {rest}")


def main() -> None:
    per_rank = run(_job, bs.N, NAMES, run_timeout=1800, timeout=300)
    show(f"B={bs.B} V={bs.V} ranks={bs.N} gloo, FP32; one call, slowest rank; ms; "
         f"{per_rank[0]['note'] or 'passes compiled'}")
    rows, shares = [], []
    for key in [k for k in per_rank[0] if isinstance(k, tuple) and k[1] not in ALTERNATIVES]:
        total, spent, floor, calls, *_ = max(per_rank, key=lambda r: r[key][0])[key]
        reads, received = (max(r[key][i] for r in per_rank) for i in (4, 5))
        parts = {part: spent.pop(part, 0.0) for part in PARTS}
        passes = sum(spent.values())
        glue = total - passes - sum(parts.values())
        shares.append((total, parts | {"passes": passes, "glue": glue}))
        top = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]))
        rows.append([key[0], key[1], calls, f"{received:,}", reads, ms(total), ms(passes), ms(total - passes),
                     *(ms(parts[p]) for p in PARTS), ms(glue), ms(floor), top])
    table(["config", "path", "coll", "bytes", "reads", "total", "passes", "rest", *PARTS, "glue", "floor",
           "passes, slowest first"], rows,
          drop=["passes, slowest first", "compact", "rest", "floor"])
    c = per_rank[0]["select"][0]
    topk, radix = (max(r["select"][i] for r in per_rank) for i in (1, 2))
    show(f"round one's selection of c={c} candidates per row of the shard (peaked rows; no collectives), "
         f"slowest rank; ms: topk {ms(topk)}, radix select's passes (3 histogram rounds + members, "
         f"compiled) {ms(radix)} ({over(radix, topk, 2)})")
    compiled, eager = (max(r["checks"][i] for r in per_rank) for i in (0, 1))
    show(f"the engine's round-one checks of the shard (NaN, ties at the c-th candidate), slowest rank; "
         f"ms: one pass compiled {ms(compiled)}, the same ops eager {ms(eager)} ({over(eager, compiled, 2)})")
    for alternative, (*_, other, shipped, what) in ALTERNATIVES.items():
        show(f"functional sample(), {what}; one call each, slowest rank; ms")
        rows = []
        for name in NAMES:
            a, b = (max(r[name, alternative][i] for r in per_rank) for i in (0, 1))
            same = all(r[name, alternative][2] for r in per_rank)
            rows.append([name, ms(a), ms(b), over(a, b, 2), same])
        table(["config", other, shipped, "ratio", "same tokens"], rows)
    bottom_line(_share(shares))


if __name__ == "__main__":
    main()
