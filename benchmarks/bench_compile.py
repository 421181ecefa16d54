"""What compiling the sampler's local passes costs a process: the first calls, cold and with
the programs kept on disk, and whether later batches recompile.

Run: ``.venv/bin/python benchmarks/bench_compile.py [--quick]``. Each compiled case runs in a
fresh process (one rank, V=129280, a [B, V/4] shard as one of four ranks would hold): the first
``sample()`` call with every filter that compiles a pass (top-k 1000, then top-p 0.9 on flat rows,
then speculative verification with draft logits), the first engine ``Sampler`` call, then the same
calls at other batch sizes (B = 1, 7, 64: any recompilation would show here and in the program
count). ``cold``: an empty Inductor cache directory (the store of compiled programs inside it);
``warm``: the same directory again, as a restarted server finds it (programs loaded); ``traced``:
Inductor's kernels cached but an empty store, so each pass is traced again (what a restart cost
before programs were kept); ``warmed``: an empty directory filled by ``vocabpar warm`` alone
(timed too); ``eager``: every pass eager, in this script's own process (which has made no call
before). Times are wall seconds on this machine.

``--quick``: a [B, 4096] shard, B = 16, 1, 7, one greedy call of the engine ``Sampler`` per batch
size (one pass: its round-one checks, ``nan_and_ties``), and the runs ``cold``, ``warm`` and
``eager`` only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import QUICK, bottom_line, factor, show, sized, table  # noqa: E402

V, SHARD = sized((129280, 129280 // 4), (8192, 4096))
BATCHES = sized((256, 1, 7, 64), (16, 1, 7))


def _first_calls() -> dict:
    """Seconds of the calls at each batch size, in order (the first ones include compiling or
    loading the passes), and the passes' first-call seconds, programs and loads in this process."""
    import torch

    from vocabpar import SamplingParams, VocabLayout, sample, verify
    from vocabpar.kernels import fused
    from vocabpar.sampling import Sampler

    layout = VocabLayout(SHARD, 1)
    out: dict = {}

    def calls(B: int) -> None:
        g = torch.Generator().manual_seed(B)
        flat = torch.randn(B, SHARD, generator=g) * 0.5
        pos = torch.arange(B)
        if QUICK:
            sampler = Sampler(layout, max_rows=B)
            sampler.sample(flat, sampler.prepare(SamplingParams(temperature=0), positions=pos))
            return
        for params in (SamplingParams(top_k=1000, seed=1), SamplingParams(top_p=0.9, seed=1)):
            sample(flat, layout, params, positions=pos)
            sampler = Sampler(layout, max_rows=3 * B)
            sampler.sample(flat, sampler.prepare(params, positions=pos))
        target = torch.randn(B, 2, SHARD, generator=g) * 0.5
        verify(target, layout, SamplingParams(top_p=0.9, seed=1), torch.zeros(B, 1, dtype=torch.long),
               positions=pos, draft_logits=target[:, :1] + 0.1)

    for B in BATCHES:
        start = time.perf_counter()
        calls(B)
        out[f"B={B}"] = time.perf_counter() - start
    out["passes"] = dict(fused.COMPILE_SECONDS)
    passes = {name: f for name, f in vars(fused).items() if isinstance(f, fused.Fused)}
    out["programs"] = {name: sum(map(len, f.programs.values())) for name, f in passes.items()}
    out["loaded"] = sum(f.loaded for f in passes.values())
    return out


def _env(cache: str, store: str | None = None) -> dict:
    """This environment with Inductor's cache in ``cache`` and the store of compiled passes in
    ``store`` (by default inside ``cache``)."""
    env = {k: v for k, v in os.environ.items() if k != "VOCABPAR_PASS_STORE"}
    return env | {"TORCHINDUCTOR_CACHE_DIR": cache} | ({"VOCABPAR_PASS_STORE": store} if store else {})


def _eager() -> dict:
    """:func:`_first_calls` in this process (no tensor work done here yet), every pass eager."""
    from vocabpar.kernels import fused

    with fused.compiling(False):
        return _first_calls()


def _run(cache: str, store: str | None = None) -> dict:
    """:func:`_first_calls` in a fresh process, passes compiled, with ``cache`` and ``store``."""
    env = _env(cache, store) | {"VOCABPAR_COMPILE": "1"}
    done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as empty:
        rows = {"cold": _run(cache), "warm": _run(cache)}
        if not QUICK:
            rows["traced"] = _run(cache, empty)
        rows["eager"] = _eager()
    warming = None
    if not QUICK:
        with tempfile.TemporaryDirectory() as cache:  # an empty cache filled by `vocabpar warm` alone
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "vocabpar", "warm"], check=True, capture_output=True,
                           env=_env(cache))
            warming = time.perf_counter() - start
            rows["warmed"] = _run(cache)
    what = ("greedy through the engine Sampler" if QUICK else
            "top-k 1000 and top-p 0.9 through sample() and the engine Sampler, then verify with draft logits")
    show(f"one process, [B, {SHARD}] FP32 shard of V={V}; per batch size: {what} (seconds, wall)")
    first, *later = (f"B={B}" for B in BATCHES)
    table(["run", f"{first} (first)", *later, "loaded", "programs per pass"],
          [[name, f"{r[first]:.2f}", *(f"{r[b]:.2f}" for b in later), r["loaded"],
            ", ".join(f"{k} {v}" for k, v in sorted(r["programs"].items()) if v) or "-"]
           for name, r in rows.items()], drop=["programs per pass"])
    if warming is not None:
        show(f"warmed: a process after `vocabpar warm` on an empty cache, which took {warming:.0f} s "
             "(every pass in every calling convention, one process per core)")
    for name in [n for n in rows if n != "eager"]:
        passes = rows[name]["passes"]
        show(f"{name} first call per pass (s, {sum(passes.values()):.1f} in all): "
             + ", ".join(f"{k} {v:.1f}" for k, v in sorted(passes.items())))
    cold, warm, eager = (rows[n][first] for n in ("cold", "warm", "eager"))
    call = "Sampler call" if QUICK else "calls"
    bottom_line(f"a new process's first {call} ({first}) with its passes loaded from the store "
                f"{factor(warm, cold)} than compiling them cold ({warm:.1f} s vs {cold:.1f} s); eager "
                f"{eager:.2f} s")

if __name__ == "__main__":
    print(json.dumps(_first_calls())) if "--child" in sys.argv else main()
