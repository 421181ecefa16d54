"""Count the kernel launches and host reads of vocabpar's own code paths and write them as the
planner's data, src/vocabpar/plan/host_work.json (:mod:`vocabpar.plan.host` reads it):

    .venv/bin/python scripts/count_launches.py [--out PATH] [--compiled]

Runs ``tests/host_probe.py``'s measurement on two local gloo ranks (every sampler key, every
family of logit rows) and on three (scoring and collection, whose launches grow with the ranks),
then writes every measured table with a header: the torch version, the command, the date and how
launches and host reads were counted. About half a minute on two cores. Rerun it whenever a
sampler, verifier, scorer or collection path changes; ``tests/test_host_work.py`` re-counts a
sample of the entries and fails when the file has gone stale.

``--compiled`` also counts the kernels of the engine ``Sampler``'s ``sample`` and ``verify``
compiled whole (``torch.compile(fullgraph=True)``, Inductor), per sampler key on two ranks: the
tables graph mode prices; and of its greedy ``sample`` with top-5 logprobs and its
``token_logprobs`` with top 5. Inductor lowers each program and writes its source, which is counted;
nothing is built or run. About a minute per program on two cores (some seventy programs); without
``--compiled`` the file's compiled tables are kept (entries no key names any more dropped), and
only the keys they lack (a filter added since, :mod:`vocabpar.wire.filters`) and those named by
``--recount KEY ...`` (a change that touched their programs) are compiled and counted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path

# as in the test suite: the fused passes run eager (each still counts as one launch) and a rank's
# idle OpenMP threads sleep; set before torch loads, here and in every rank
os.environ.setdefault("VOCABPAR_COMPILE", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # before the first launch: the ranks unpickle host_probe's functions

import host_probe  # noqa: E402
import torch  # noqa: E402

from vocabpar.launch import run  # noqa: E402
from vocabpar.plan import host  # noqa: E402
from vocabpar.wire import filters  # noqa: E402

COUNTING = (
    "A launch is an ATen operation that does work, counted by a TorchDispatchMode: views, "
    "allocations, metadata queries and the collectives (priced apart) are left out; each fused "
    "pass of vocabpar.kernels.fused counts as one launch, its inner operations hidden. A host read "
    "is what vocabpar.host_reads.counting sees: a read of a device value, a copy to the host, or an "
    "op whose output size depends on the data. Measured on CPU gloo ranks with agreement checks "
    "off; counts are per call and do not depend on the batch size. Compiled (engine_graph tables): the "
    "kernels one call of the program Inductor generates runs -- its generated kernels plus the ATen "
    "operations left in it (extern kernels, fallbacks), the collectives and their waits left out -- "
    "vocabpar's own passes traced into the program; on two gloo ranks, the busiest rank.")
COMPILED = ("engine_graph", "engine_graph_verify", "engine_graph_score")


def compiled_tables(keys: tuple[str, ...], scores: bool = True) -> dict[str, dict[str, list[int]]]:
    """The compiled programs' kernels for each sampler key of ``keys`` (one launch per key) and,
    with ``scores``, of the scoring programs, measured now."""
    out: dict[str, dict[str, list[int]]] = {table: {} for table in COMPILED}
    for key in keys:
        ranks = run(host_probe.measure_compiled, 2, host_probe.B, (key,), timeout=900, run_timeout=3600)
        for entry in ranks[0]["engine"]:
            table, name = (COMPILED[1], host.verify_name(*entry)) if isinstance(entry, tuple) else \
                (COMPILED[0], entry)
            out[table][name] = [max(rank["engine"][entry] for rank in ranks)]
    if scores:
        ranks = run(host_probe.measure_compiled_scores, 2, host_probe.B, timeout=900, run_timeout=3600)
        out[COMPILED[2]] = {name: [max(rank[name] for rank in ranks)] for name in ranks[0]}
    return out


def kept_entries(compiled: dict[str, dict[str, list[int]]]) -> dict[str, dict[str, list[int]]]:
    """The compiled tables' entries whose names are still keys (a name no key takes any more is
    dropped)."""
    names = filters.keys()
    verify_names = {host.verify_name(key, draft) for key in names for draft in (False, True)}
    return {COMPILED[0]: {k: v for k, v in compiled[COMPILED[0]].items() if k in names},
            COMPILED[1]: {k: v for k, v in compiled[COMPILED[1]].items() if k in verify_names},
            COMPILED[2]: compiled[COMPILED[2]]}


def measure(compiled: dict[str, dict[str, list[int]]], compiled_date: str) -> dict:
    """The tables and their header, measured now (``compiled``: the compiled tables, measured or
    kept, and counted at ``compiled_date``)."""
    two = run(host_probe.measure, 2, host_probe.B, timeout=300, run_timeout=900)
    three = run(host_probe.measure, 3, host_probe.B, ("score", "collect"), timeout=300, run_timeout=900)
    script = Path(sys.argv[0]).resolve()
    command = " ".join(["python", str(script.relative_to(ROOT) if script.is_relative_to(ROOT) else script),
                        *sys.argv[1:]])
    header = {
        "torch": torch.__version__, "python": platform.python_version(), "command": command,
        "date": _now(), "compiled_date": compiled_date,
        "counting": COUNTING,
        "setup": (f"vocabulary {host_probe.V}, {host_probe.B} rows, {host_probe.K} drafts per row; "
                  f"samplers on 2 ranks (the busiest rank); families {', '.join(host_probe.families())} "
                  f"(typical: peaked); score and collect fitted from 2 and 3 ranks"),
        "tables": host.MEASURED,
        "not_here": "the dense sampler's tables (vLLM's own sampler, counted outside this repository) stay "
                    "typed in vocabpar/plan/host.py",
    }
    return {"header": header, **host_probe.tables(two, three), **compiled}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def dumps(data: dict) -> str:
    """``data`` as indented JSON with each list of numbers on one line."""
    text = json.dumps(data, indent=1)
    return re.sub(r"\[\s+([-\d,\s]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Count the kernel launches and host reads of vocabpar's "
                                                 "code paths and write the planner's data file.")
    parser.add_argument("--out", type=Path, default=host.DATA, help="where to write (default: %(default)s)")
    parser.add_argument("--compiled", action="store_true",
                        help="also count every compiled engine program (about 45 minutes); else keep the "
                             "file's and count only the keys it lacks")
    parser.add_argument("--recount", nargs="+", default=(), metavar="KEY",
                        help="without --compiled: also count these keys' compiled programs again (a "
                             "change that touched them), keeping the file's other entries")
    args = parser.parse_args(argv)
    unknown = [key for key in args.recount if key not in filters.keys()]
    if unknown or (args.recount and args.compiled):
        parser.error(f"--recount takes sampler keys ({', '.join(filters.keys())}) and not --compiled; "
                     f"got {', '.join(unknown) or '--compiled'}")
    if args.compiled:
        compiled, compiled_date = compiled_tables(filters.keys()), _now()
    else:
        kept = json.loads(args.out.read_text()) if args.out.exists() else {}
        if not all(isinstance(kept.get(table), dict) for table in COMPILED):
            parser.error(f"{args.out} holds no compiled tables to keep: run with --compiled")
        compiled = kept_entries({table: kept[table] for table in COMPILED})
        compiled_date = kept["header"].get("compiled_date", kept["header"]["date"])
        missing = lambda key: key not in compiled[COMPILED[0]] or any(  # noqa: E731
            host.verify_name(key, draft) not in compiled[COMPILED[1]] for draft in (False, True))
        lacking = tuple(key for key in filters.keys() if key in args.recount or missing(key))
        if lacking:  # a key the kept tables lack (a filter added since) or asked for: counted now
            print(f"compiling the {len(lacking)} keys asked for or lacking: {', '.join(lacking)}")
            for table, counted in compiled_tables(lacking, scores=False).items():
                compiled[table] |= counted
            compiled_date = f"{compiled_date}; {len(lacking)} keys at {_now()}"
    data = measure(compiled, compiled_date)
    args.out.write_text(dumps(data))
    entries = sum(len(t) for name, t in data.items() if name != "header")
    print(f"{entries} entries in {len(data) - 1} tables -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
