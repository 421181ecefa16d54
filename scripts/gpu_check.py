"""The engine step on one GPU, compiled whole and replayed as a CUDA graph: tokens, µs, kernels.

For each plan (greedy; T 0.8 / top-k 50 / top-p 0.95 / min-p 0.05; top-p 0.9; min-p 0.1; greedy
with top-5 logprobs) and batch size, at world size 1 on ``--device`` (default ``cuda``):

- ``Sampler.sample`` under ``torch.compile(fullgraph=True, mode="reduce-overhead")`` (a CUDA graph
  on a GPU), its tokens checked equal, bit for bit, to ``vocabpar.reference_sample`` run on the
  CPU on the same logits;
- µs per call of the compiled step, beside torch's plain sampler on the full row (temperature,
  top-k, top-p by sort and cumulative sum, min-p, an exponential race; compiled the same way),
  each the median of ``--iters`` calls timed with device events after warm-up, side by side in
  one run;
- the kernels one call launches, counted by ``torch.profiler`` (device kernels on a GPU, ATen
  operations on the CPU).

Five minutes at most on one GPU with the defaults (V = 128,256, B = 1, 64, 256)::

    python scripts/gpu_check.py --out gpu_check.json

On a machine without a GPU, ``--device cpu --backend eager`` checks the script itself in
seconds (the tests run it so); its timings then mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from vocabpar import Sampler, SamplingParams, VocabLayout, reference_sample

PLANS = {
    "greedy": SamplingParams(temperature=0.0),
    "T0.8 k50 p0.95 min-p 0.05": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
    "top-p 0.9": SamplingParams(top_p=0.9),
    "min-p 0.1": SamplingParams(min_p=0.1),
    "greedy, top-5 logprobs": SamplingParams(temperature=0.0, logprobs=5),
}


def plain_sampler(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Torch's ordinary sampler on full rows ``[B, V]``: temperature, top-k, min-p, top-p by a
    sort and a cumulative sum, then an exponential race (``noise``: Exp(1) draws ``[B, V]``);
    rows with temperature 0 take the argmax."""
    greedy = logits.argmax(-1)
    x = logits / temperature.clamp(min=1e-5)[:, None]
    values, order = x.sort(-1, descending=True)
    rank = torch.arange(x.shape[-1], device=x.device)[None]
    probs = values.softmax(-1)
    keep = (rank < torch.where(top_k > 0, top_k, x.shape[-1])[:, None])
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep &= (probs.cumsum(-1) - probs) < top_p[:, None]
    filtered = torch.where(keep, probs, 0.0)
    drawn = order.gather(-1, (filtered / noise.gather(-1, order)).argmax(-1, keepdim=True))[:, 0]
    return torch.where(temperature > 0, drawn, greedy)


def timed(fn, iters: int, device: torch.device) -> float:
    """Median µs of ``iters`` calls of ``fn`` after two warm-up calls."""
    for _ in range(2):
        fn()
    spans = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            spans.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            spans.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(spans)


def kernels(fn, device: torch.device) -> int:
    """Kernels (a GPU) or ATen operations (the CPU) one call of ``fn`` launches, by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if device.type == "cuda":
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def check(plan: str, B: int, V: int, args: argparse.Namespace, device: torch.device) -> dict:
    """One plan at batch ``B``: tokens against the reference, µs of both samplers, kernels."""
    g = torch.Generator().manual_seed(B)
    logits = torch.randn(B, V, generator=g) * 3
    params = PLANS[plan]
    positions = torch.arange(B) * 7
    params = SamplingParams(**{**vars(params), "seed": list(range(B))})
    sampler = Sampler(VocabLayout(V, 1), max_rows=B, max_top_n=5)
    batch = sampler.prepare(params, positions=positions, device=device)
    on_device = logits.to(device)
    compile_mode = "reduce-overhead" if device.type == "cuda" else None
    step = torch.compile(sampler.sample, fullgraph=True, backend=args.backend, mode=compile_mode)
    out = step(on_device, batch)
    expected = reference_sample(logits, params, positions=positions)
    same = torch.equal(out.tokens.cpu(), expected.tokens)
    rows = batch.rows
    noise = torch.empty(B, V, device=device).exponential_(generator=torch.Generator(device).manual_seed(1))
    plain_args = (on_device, rows.temperature.float(), rows.top_k, rows.top_p.float(), rows.min_p.float(),
                  noise)
    plain = torch.compile(plain_sampler, fullgraph=True, backend=args.backend, mode=compile_mode)
    return {"plan": plan, "batch": B, "tokens_equal_reference": same,
            "engine_us": timed(lambda: step(on_device, batch).tokens, args.iters, device),
            "plain_us": timed(lambda: plain(*plain_args), args.iters, device),
            "engine_kernels": kernels(lambda: step(on_device, batch).tokens, device),
            "plain_kernels": kernels(lambda: plain(*plain_args), device)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (eager: a dry run)")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS), metavar="PLAN")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --backend eager for a dry run", file=sys.stderr)
        return 2
    results = [check(plan, B, args.vocab, args, device) for B in args.batch for plan in args.plans]
    print(f"{'plan':28s} {'B':>5s} {'exact':>6s} {'engine µs':>10s} {'plain µs':>9s} {'ratio':>6s} "
          f"{'kernels':>8s} {'plain':>6s}")
    for r in results:
        print(f"{r['plan']:28s} {r['batch']:5d} {str(r['tokens_equal_reference']):>6s} "
              f"{r['engine_us']:10.1f} {r['plain_us']:9.1f} {r['engine_us'] / r['plain_us']:6.2f} "
              f"{r['engine_kernels']:8d} {r['plain_kernels']:6d}")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; V = {args.vocab}; kernels by torch.profiler, one call")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "vocab": args.vocab, "results": results}, f, indent=1)
    return 0 if all(r["tokens_equal_reference"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
