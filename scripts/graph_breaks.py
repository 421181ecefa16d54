"""How far each call of the engine sampler (:class:`vocabpar.Sampler`) is from tracing as one graph
under ``torch.compile(fullgraph=True)``. For ``sample`` on each plan (greedy; T 0.8 / top-k 50 /
top-p 0.95 / min-p 0.05; top-p 0.9; top-k 1000; min-p 0.1; greedy with logprobs=5), ``verify``
with and without draft logits, and ``token_logprobs`` with top_n=5, it runs
``torch._dynamo.explain`` and prints per call

- graphs captured, graph breaks (explain's count: graphs - 1), the ops captured (FX nodes with
  ``op == "call_function"`` summed over the graphs: a rough proxy for the kernels a compiled step
  would hold) and how many of them are collectives, and the frames Dynamo gave up on and ran
  eager whole (their ops are in no graph);
- each distinct break reason, counted, at the innermost vocabpar ``file:line``, then ``via`` its
  vocabpar callers (innermost first; "its own frame": Dynamo traced that function on its own,
  after its caller fell back to eager); then, marked "no graph of its own", reasons from Dynamo's
  ``unimplemented`` counter that no graph records (chained breaks, frames skipped whole);
- ``fullgraph=True``: whether ``torch.compile(fn, fullgraph=True, backend="eager")`` traces; if
  it does, whether its output (``packed.words``) equals the eager call's, and whether two more
  calls on the same inputs reuse the graph (else the first guard that failed);
- last, the break reasons ranked by how many calls they affect.

Run it in a plain process (world size 1: no collective) or on two gloo ranks (the collectives of
:mod:`vocabpar.comm` then run inside the traced code; rank 0 prints)::

    .venv/bin/python scripts/graph_breaks.py
    .venv/bin/torchrun --nproc-per-node 2 scripts/graph_breaks.py

Half a minute each on two cores. Options: ``--compiled`` runs vocabpar's own passes
(:mod:`vocabpar.kernels.fused`) compiled, as they run by default, instead of eager (this
script's default, as ``VOCABPAR_COMPILE=0``): each call runs once outside Dynamo first, so that
its passes are compiled or loaded from the pass store (minutes when the store is cold: point
``VOCABPAR_PASS_STORE`` somewhere to keep them). ``--only TEXT`` (repeatable) measures the calls
whose name contains TEXT.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

# before vocabpar loads: its passes run eager unless --compiled
os.environ.setdefault("VOCABPAR_COMPILE", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters, guard_failures  # noqa: E402

import vocabpar  # noqa: E402
from vocabpar import Sampler, SamplingParams, VocabLayout, comm  # noqa: E402
from vocabpar.kernels import fused  # noqa: E402

V, B, K, TOP_N = 8192, 8, 3, 5
"""Vocabulary, batch rows, drafts per row, top logprobs: a vocabulary wide enough that top-p and
top-k 1000 take their threshold searches at one and two ranks."""
PACKAGE = str(Path(vocabpar.__file__).resolve().parent)
CERTIFIED = dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05)
SAMPLE_PLANS = {
    "greedy": dict(temperature=0.0),
    "T0.8/k50/p0.95/minp0.05": CERTIFIED,
    "top-p 0.9": dict(top_p=0.9),
    "top-k 1000": dict(top_k=1000),
    "min-p 0.1": dict(min_p=0.1),
    "greedy + logprobs=5": dict(temperature=0.0, logprobs=TOP_N),
}


def calls(sampler: Sampler) -> dict[str, tuple]:
    """Each measured call as ``(function, args)``, on this rank's logits (every rank different)."""
    g = torch.Generator().manual_seed(comm.rank())
    width = sampler.layout.shard_width
    local = torch.randn(B, width, generator=g)
    positions = torch.arange(B)
    out = {}
    for name, params in SAMPLE_PLANS.items():
        batch = sampler.prepare(SamplingParams(seed=list(range(B)), **params), positions=positions)
        out[f"sample: {name}"] = (sampler.sample, (local, batch))
    batch = sampler.prepare(SamplingParams(seed=list(range(B)), **CERTIFIED), positions=positions)
    target = torch.randn(B, K + 1, width, generator=g)
    draft = target[:, :K] + torch.randn(B, K, width, generator=g)
    drafts = torch.randint(0, V, (B, K), generator=torch.Generator().manual_seed(0))  # the same on every rank
    out["verify: no draft logits"] = (sampler.verify, (target, batch, drafts))
    out["verify: draft logits"] = (sampler.verify, (target, batch, drafts, draft))
    ids = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(1))
    out["token_logprobs: top_n=5"] = (lambda logits, ids: sampler.token_logprobs(logits, ids, top_n=TOP_N),
                                      (local, ids))
    return out


def where(frame: object) -> str:
    """``file:line`` of a frame summary, relative to the package (or to its own folder)."""
    path = Path(frame.filename).resolve()
    name = str(path.relative_to(PACKAGE)) if str(path).startswith(PACKAGE) else path.name
    return f"{name}:{frame.lineno}"


FOLLOW_ON = "step_unsupported"
"""The reason Dynamo records when it compiles a partial graph of a frame whose nested call broke
and resumes after it: a follow-on of the break before it, not a cause of its own."""


def short(explanation: str) -> str:
    """Dynamo's ``Explanation:`` line without the label and its boilerplate tail."""
    return explanation.removeprefix("Explanation:").strip().split(" This function is")[0]


def reason_key(reason: object) -> tuple[str, str, str]:
    """A break reason as (what, where, via): the reason's first line, with its explanation when
    it has one; the innermost vocabpar frame; its vocabpar callers, innermost first."""
    lines = [line.strip() for line in reason.reason.splitlines() if line.strip()]
    what = lines[0] if lines else "?"
    explanation = next((line for line in lines if line.startswith("Explanation:")), None)
    if explanation:
        what += " -- " + short(explanation)
    if what == FOLLOW_ON:
        what += " (follow-on: a partial graph of a frame whose nested call broke)"
    ours = [f for f in reason.user_stack if str(Path(f.filename).resolve()).startswith(PACKAGE)]
    stack = list(reversed(ours or list(reason.user_stack)[-1:]))
    at = where(stack[0]) if stack else "?"
    via = " <- ".join(where(f) for f in stack[1:3])
    return what[:200], at, via


def ops(graphs: list) -> tuple[int, int]:
    """call_function nodes summed over the captured FX graphs, and how many of them are
    collectives (functional collectives, their waits left out)."""
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    return len(targets), sum("c10d_functional" in t and "wait" not in t for t in targets)


def measure(fn: object, args: tuple) -> tuple[object, float, dict[str, int], int]:
    """``torch._dynamo.explain`` of ``fn(*args)`` from a clean Dynamo cache, its seconds, Dynamo's
    ``unimplemented`` counter (every reason it gave up tracing, with those no graph records) and
    the frames it ran eager whole."""
    torch._dynamo.reset()
    counters.clear()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's notes on the functools.cache'd record builders
        explained = torch._dynamo.explain(fn)(*args)
    seconds = time.perf_counter() - start
    frames = counters["frames"]
    return explained, seconds, dict(counters["unimplemented"]), frames["total"] - frames["ok"]


def fullgraph(fn: object, args: tuple, repeats: int = 2) -> str:
    """Whether ``torch.compile(fn, fullgraph=True)`` (the eager backend: Dynamo's capture only)
    traces, whether it then gives the eager call's ``packed.words`` bit for bit, and whether
    ``repeats`` more calls on the same inputs reuse its graph (with the first guard that failed
    when they do not)."""
    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(fn, fullgraph=True, backend="eager")
            out = compiled(*args)
            graphs = counters["stats"]["unique_graphs"]
            for _ in range(repeats):
                compiled(*args)
    except Exception as error:  # noqa: BLE001 -- Dynamo's Unsupported and friends
        return f"fails ({type(error).__name__}: {str(error).splitlines()[0][:80]})"
    same = "equal to" if torch.equal(out.packed.words, fn(*args).packed.words) else "DIFFERS from"
    again = counters["stats"]["unique_graphs"] - graphs
    line = f"traces, packed output {same} eager; {again} recompiles in {repeats} more calls, same inputs"
    failed = [r.splitlines()[0] for reasons in guard_failures.values() for r in reasons]
    if failed:
        line += f"\n      first failing guard: {re.sub(r'^[0-9/]+: ', '', failed[0])[:160]}"
    return line


CHAINED = "*** While handling this graph break, another graph break occurred: ***"


def unimplemented(text: str) -> str:
    """One line of an ``unimplemented`` counter entry: each chained reason's first line and
    the frame Dynamo skipped, if it says so."""
    parts = []
    for block in text.split(CHAINED):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        part = lines[0] if lines else "?"
        explanation = next((line for line in lines if line.startswith("Explanation:")), "")
        skipped = re.search(r"frame skipped: (\S+) \((.+) line (\d+)\)", block)
        if skipped:
            path = Path(skipped.group(2)).resolve()
            name = str(path.relative_to(PACKAGE)) if str(path).startswith(PACKAGE) else path.name
            part += f" [frame {skipped.group(1)} at {name}:{skipped.group(3)} runs eager]"
        elif explanation:
            part += " -- " + short(explanation)[:110]
        parts.append(part)
    return "; then ".join(parts)


def grouped(reasons: list) -> list[tuple[str, str, int, Counter]]:
    """Break reasons grouped by (what, where), most frequent first, each with its callers counted."""
    groups: dict[tuple[str, str], Counter] = {}
    for r in reasons:
        what, at, via = reason_key(r)
        groups.setdefault((what, at), Counter())[via] += 1
    return sorted(((what, at, sum(c.values()), c) for (what, at), c in groups.items()),
                  key=lambda g: (-g[2], g[0], g[1]))


def report(name: str, explained: object, seconds: float, gave_up: dict[str, int], eager_frames: int,
           whole: str) -> list[str]:
    """The lines printed for one call."""
    count, collectives = ops(explained.graphs)
    lines = [f"{name}: {explained.graph_count} graphs, {explained.graph_break_count} breaks, {count} ops "
             f"({collectives} collectives) captured; {eager_frames} frames run eager whole; "
             f"explain {seconds:.1f} s",
             f"    fullgraph=True: {whole}"]
    for what, at, n, callers in grouped(explained.break_reasons):
        via = ", ".join((v or "(its own frame)") + (f" x{c}" if c > 1 else "")
                        for v, c in sorted(callers.items()))
        lines += [f"  {n:3d} x {at}: {what}", f"          via {via}"]
    recorded, chained = {r.reason.split("\n")[0] for r in explained.break_reasons}, Counter()
    for text, n in gave_up.items():
        if CHAINED in text or text.split("\n")[0] not in recorded:
            chained[unimplemented(text)] += n
    for text, n in sorted(chained.items()):
        lines.append(f"  {n:3d} x (no graph of its own) {text}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compiled", action="store_true", help="run vocabpar's passes compiled")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="measure the calls whose name contains TEXT")
    args = parser.parse_args(argv)
    n = vocabpar.init()
    sampler = Sampler(VocabLayout(V, n), max_rows=B, max_top_n=TOP_N, max_drafts=K)
    say = print if comm.rank() == 0 else (lambda *a, **k: None)
    say(f"torch {torch.__version__}, world size {n}, V={V}, B={B}, k={K}; vocabpar passes "
        f"{'compiled' if args.compiled else 'eager'}")
    totals, breaks = Counter(), Counter()
    with fused.compiling(args.compiled):
        for name, (fn, call_args) in calls(sampler).items():
            if args.only and not any(part in name for part in args.only):
                continue
            if args.compiled:  # warm: each pass compiled (or loaded from the store) outside Dynamo first
                fn(*call_args)
            explained, seconds, gave_up, eager_frames = measure(fn, call_args)
            whole = fullgraph(fn, call_args)
            say("\n".join(report(name, explained, seconds, gave_up, eager_frames, whole)), flush=True)
            for what, at, count, _ in grouped(explained.break_reasons):
                totals[what, at] += 1
                breaks[what, at] += count
    say("\nbreak reasons by the number of calls they affect (calls, breaks in all):")
    for (what, at), count in sorted(totals.items(), key=lambda item: (-item[1], item[0])):
        say(f"  {count:2d} calls, {breaks[what, at]:3d} breaks: {at}: {what}")
    torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
