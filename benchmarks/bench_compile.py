"""What compiling the sampler's local passes costs a process: the first calls, cold and with
the programs kept on disk, and whether later batches recompile.

Run: ``.venv/bin/python benchmarks/bench_compile.py``. Each case runs in a fresh Python process
(one rank, V=129280, a [B, V/4] shard as one of four ranks would hold): the first ``sample()``
call with every filter that compiles a pass (top-k 1000, then top-p 0.9 on flat rows, then
speculative verification with draft logits), the first engine ``Sampler`` call, then the same
calls at other batch sizes (B = 1, 7, 64: any recompilation would show here and in the program
count). ``cold``: an empty Inductor cache directory (the store of compiled programs inside it);
``warm``: the same directory again, as a restarted server finds it (programs loaded);
``traced``: Inductor's kernels cached but an empty store, so each pass is traced again (what a
restart cost before programs were kept); ``warmed``: an empty directory filled by ``vocabpar
warm`` alone (timed too). Times are wall seconds on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

V, SHARD = 129280, 129280 // 4


def _child() -> None:
    import torch

    from vocabpar import SamplingParams, VocabLayout, sample, verify
    from vocabpar.sampling import Sampler, fused

    layout = VocabLayout(SHARD, 1)
    out: dict = {}

    def calls(B: int) -> None:
        g = torch.Generator().manual_seed(B)
        flat = torch.randn(B, SHARD, generator=g) * 0.5
        pos = torch.arange(B)
        for params in (SamplingParams(top_k=1000, seed=1), SamplingParams(top_p=0.9, seed=1)):
            sample(flat, layout, params, positions=pos)
            sampler = Sampler(layout, max_rows=3 * B)
            sampler.sample(flat, sampler.prepare(params, positions=pos))
        target = torch.randn(B, 2, SHARD, generator=g) * 0.5
        verify(target, layout, SamplingParams(top_p=0.9, seed=1), torch.zeros(B, 1, dtype=torch.long),
               positions=pos, draft_logits=target[:, :1] + 0.1)

    for B in (256, 1, 7, 64):
        start = time.perf_counter()
        calls(B)
        out[f"B={B}"] = time.perf_counter() - start
    out["passes"] = dict(fused.COMPILE_SECONDS)
    passes = {name: f for name, f in vars(fused).items() if isinstance(f, fused.Fused)}
    out["programs"] = {name: sum(map(len, f.programs.values())) for name, f in passes.items()}
    out["loaded"] = sum(f.loaded for f in passes.values())
    print(json.dumps(out))


def _env(cache: str, store: str | None = None) -> dict:
    """This environment with Inductor's cache in ``cache`` and the store of compiled passes in
    ``store`` (by default inside ``cache``)."""
    env = {k: v for k, v in os.environ.items() if k != "VOCABPAR_PASS_STORE"}
    return env | {"TORCHINDUCTOR_CACHE_DIR": cache} | ({"VOCABPAR_PASS_STORE": store} if store else {})


def _run(cache: str, compile_on: bool, store: str | None = None) -> dict:
    env = _env(cache, store) | {"VOCABPAR_COMPILE": "1" if compile_on else "0"}
    done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as empty:
        rows = {"cold": _run(cache, True), "warm": _run(cache, True), "traced": _run(cache, True, empty),
                "eager": _run(cache, False)}
    with tempfile.TemporaryDirectory() as cache:  # an empty cache filled by `vocabpar warm` alone
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "vocabpar", "warm"], check=True, capture_output=True,
                       env=_env(cache))
        warming = time.perf_counter() - start
        rows["warmed"] = _run(cache, True)
    print(f"one process, [B, {SHARD}] FP32 shard of V={V}; per batch size: top-k 1000 and top-p 0.9 through "
          "sample() and the engine Sampler, then verify with draft logits (seconds, wall)")
    print(f"{'run':<7}{'B=256 (first)':>14}{'B=1':>8}{'B=7':>8}{'B=64':>8}{'loaded':>7}  programs per pass")
    for name, r in rows.items():
        programs = ", ".join(f"{k} {v}" for k, v in sorted(r["programs"].items()) if v) or "-"
        times = f"{r['B=256']:>14.1f}{r['B=1']:>8.2f}{r['B=7']:>8.2f}{r['B=64']:>8.2f}"
        print(f"{name:<7}{times}{r['loaded']:>7}  {programs}")
    print(f"warmed: a process after `vocabpar warm` on an empty cache, which took {warming:.0f} s "
          "(every pass in every calling convention, one process per core)")
    for name in ("cold", "warm", "traced", "warmed"):
        passes = rows[name]["passes"]
        print(f"{name} first call per pass (s, {sum(passes.values()):.1f} in all): "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(passes.items())))


if __name__ == "__main__":
    _child() if "--child" in sys.argv else main()
