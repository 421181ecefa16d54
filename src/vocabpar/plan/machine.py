"""How a step executes, as the three prices of its fixed costs: ``latency`` (alpha, seconds per
collective), ``launch`` (lambda, seconds per kernel launch) and ``sync`` (seconds per host read of
a device value). An execution mode sets all three from measured figures, each with its source;
``--latency-us``, ``--launch-us`` and ``--sync-us`` override them one by one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    """An execution mode: its three prices (seconds) and where each figure comes from."""

    name: str
    summary: str
    latency: float
    launch: float
    sync: float
    latency_source: str
    launch_source: str
    sync_source: str = ("assumed: a host read waits for the stream to drain and copies a few bytes back, "
                        "~10-30 us on current GPUs (not measured here: no GPU)")
    compiled: bool = False
    """The engine Sampler's calls run compiled whole (``torch.compile(fullgraph=True)``): their
    launches are the kernels of the compiled program rather than its eager operations."""


EAGER_LAUNCH = "a PyTorch op launched eagerly from Python: ~7 us on a tiny tensor (flagos-ai/FlagGems#4812)"
MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("graph", "the step compiled, captured in a CUDA graph, collectives as one-shot kernels, one node",
         8e-6, 1.5e-6, 20e-6,
         "small NCCL all-reduce in CUDA graphs: 0.5-6 us on 2-8 H100/H800 over NVLink (NVIDIA/nccl#1984, "
         "#1259); FlashInfer one-shot all-reduce ~8 us (sgl-project/sglang#32461)",
         "a kernel node of a replayed graph; a raw cuLaunchKernel takes ~1.3 us "
         "(meta-pytorch/tritonbench#1016)", compiled=True),
    Mode("eager", "collectives issued eagerly from Python on one node, as engines' samplers run today",
         25e-6, 5e-6, 20e-6,
         "torch.distributed NCCL all-reduce of 128 B-512 KB: 19-25 us on 8 H100 (ByteDance-Seed/"
         "Triton-distributed#57); NCCL RING_LL 23-33 us (sgl-project/sglang#32461); a packed all-gather "
         "~45-48 us fixed cost on H20 (sgl-project/sglang#37106)", EAGER_LAUNCH),
    Mode("multinode", "collectives crossing nodes (RoCE/InfiniBand), issued eagerly", 60e-6, 5e-6, 20e-6,
         "NCCL spends 54-64 us per 48 KB all-reduce across DGX Spark nodes over RoCE "
         "(local-inference-lab/vllm#295); 8 B all-reduce ~20 us in nccl-tests across 2 A100 nodes on "
         "HDR InfiniBand (NVIDIA/nccl-tests#150)", EAGER_LAUNCH),
)}
DEFAULT_MODE = "eager"


def mode(name: str) -> Mode:
    """The mode called ``name`` (``ValueError`` listing the known ones)."""
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown mode {name!r}; known: {', '.join(MODES)}") from None

GLOO_LATENCY = 1e-3
"""Seconds per gloo all-reduce of one int64 between two processes of one 2-core machine: 0.85-1.3
ms measured here (200 calls after 20 warm-up ones, 2026-12-06)."""
GLOO_BANDWIDTH = 0.65e9
"""Bytes/s of a gloo all-reduce of 8 MB between the same two processes, its latency taken off:
0.64-0.65 GB/s measured here."""
LINKS = {"cuda": (MODES["graph"].latency, 300e9), "cpu": (GLOO_LATENCY, GLOO_BANDWIDTH)}
"""A link's (latency s, bandwidth B/s) by device type: on GPUs a collective captured in a CUDA
graph (graph mode) over NVLink-class bandwidth, the planner's defaults; on the CPU gloo between
processes of one machine."""


def link(device_type: str, latency: float | None = None,
         bandwidth: float | None = None) -> tuple[float, float]:
    """``(latency, bandwidth)``: the given ones, else :data:`LINKS`' for ``device_type`` (a CUDA
    GPU's for a device type it does not list); ``ValueError`` for a value that is not positive."""
    for name, value in (("latency", latency), ("bandwidth", bandwidth)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < float("inf")):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    default_latency, default_bandwidth = LINKS.get(device_type, LINKS["cuda"])
    return latency or default_latency, bandwidth or default_bandwidth

