"""scripts/gpu_check.py, the GPU check a session with a GPU runs, works as a script here: a dry
run on the CPU (Dynamo's eager backend) compiles the engine step whole for a top-p plan (round
one, a threshold search, the draw), finds its tokens equal to the reference and reports µs and
kernels for both samplers."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_dry_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu",
                           "--backend", "eager", "--vocab", "1024", "--batch", "3", "--iters", "1",
                           "--plans", "top-p 0.9", "--out", str(out)],
                          env=os.environ | {"VOCABPAR_COMPILE": "0"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())["results"]
    assert [(r["plan"], r["batch"]) for r in results] == [("top-p 0.9", 3)]
    r = results[0]
    assert r["tokens_equal_reference"] and r["engine_us"] > 0 and r["plain_us"] > 0
    assert r["engine_kernels"] > 0 and r["plain_kernels"] > 0
    assert "V = 1024; kernels by torch.profiler" in done.stdout
    refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cuda"],
                             env=os.environ | {"CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "no CUDA device" in refused.stderr
