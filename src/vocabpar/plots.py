"""Pictures: the planner's (bytes per step, memory per rank, which design wins over latency and
bandwidth) and the demo's measurements, written as PNG files. The only module that imports
matplotlib (the ``plot`` extra), and only when a picture is drawn."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from vocabpar.plan import DESIGNS, Design, GiB, Workload, crossover
from vocabpar.plan.cost import design_cost
from vocabpar.plan.recommend import winners

if TYPE_CHECKING:
    from vocabpar.demo import DemoResult


def png_path(path: str) -> str:
    """The file a plot named ``path`` is written to: ``path`` itself when it ends in ``.png``,
    ``path + '.png'`` when it has no extension; any other extension, or a name that is no file
    name (empty, ending in a separator or a dot), is a ``ValueError``."""
    suffix = Path(path).suffix
    if suffix.lower() not in ("", ".png") or not Path(path).name or path.endswith(("/", os.sep, ".")):
        raise ValueError(f"{path!r} is not a .png file name")
    return path if suffix else path + ".png"


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (``ValueError`` when missing)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("plotting needs matplotlib: pip install 'vocabpar[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str) -> str:
    """Write ``fig`` as a PNG to ``png_path(path)``, close it, and return that path."""
    target = png_path(path)
    fig.savefig(target, dpi=100, format="png")
    pyplot().close(fig)
    return target


def plot_plan(w: Workload, path: str, designs: tuple[Design, ...] = DESIGNS) -> str:
    """Write a PNG: the step's typical time vs batch size (gathering vs sampling on shards: the
    crossover marked), the bytes received per rank per step vs batch size, memory per rank vs
    ranks, one line per design, and the map of which design wins
    (:func:`vocabpar.plan.recommend.winners`) over latency per collective and bandwidth, with ``w``'s own
    point marked (needs the ``plot`` extra, matplotlib). Returns the path written (see
    ``png_path``)."""
    png_path(path)  # a bad name fails before any work
    plt = pyplot()
    from matplotlib.colors import ListedColormap

    batches = [2**k for k in range(15)]
    ranks = [2**k for k in range(7)]
    fig, ((timed, left), (middle, right)) = plt.subplots(2, 2, figsize=(15, 11))
    step = "verify" if w.spec_tokens else "decode"
    for i, d in enumerate(designs):
        style = {"marker": ".", "label": d.name, "linestyle": ("-", "--", ":", "-.")[i % 4]}
        costs = [design_cost(d, replace(w, batch=b)) for b in batches]
        timed.plot(batches, [c.step_time_s * 1e6 for c in costs], **style)
        left.plot(batches, [c.step_bytes for c in costs], **style)
        middle.plot(ranks, [design_cost(d, replace(w, ranks=r, dp=math.gcd(w.dp, r), skew=None if w.skew
                                                   is None else max(w.skew, 1 / r))).memory_bytes / GiB
                            for r in ranks], **style)
    at = crossover(w, step) if w.ranks > 1 else None
    if at is not None and at > 1:
        timed.axvline(at, color="black", linestyle=":", linewidth=1)
        timed.annotate(f"crossover: gathering wins below B={at}", (at, 0.97),
                       xycoords=("data", "axes fraction"), ha="right", va="top", fontsize=8, rotation=90)
    timed.set(xscale="log", yscale="log", xlabel="batch (rows needing logits)",
              ylabel=f"{'verification' if w.spec_tokens else 'decode'} step time per rank (µs, typical)",
              title=f"{w.sampling.describe()}: {w.latency * 1e6:g} µs/collective, "
                    f"{w.launch * 1e6:g} µs/launch, {w.sync * 1e6:g} µs/host read")
    timed.legend(fontsize=7)
    timed.grid(True, which="both", alpha=0.3)
    left.set(xscale="log", xlabel="batch (rows needing logits)",
             ylabel="bytes received per rank per step",
             title=f"V={w.vocab}, H={w.hidden}, {w.ranks} ranks, dp {w.dp}")
    left.set_yscale("symlog", linthresh=1e3)
    left.set_ylim(bottom=0)
    middle.set(xlabel="ranks", ylabel="weights + logits per rank (GiB)", title=f"B={w.batch}")
    middle.set_xscale("log", base=2)
    left.legend(fontsize=7)
    for ax in (left, middle):
        ax.grid(True, which="both", alpha=0.3)
    latencies = [10 ** (-7 + k / 6) for k in range(25)]  # 0.1 us .. 1 ms per collective
    bandwidths = [10 ** (9 + k / 6) for k in range(25)]  # 1 GB/s .. 10 TB/s
    names = [d.name for d in designs]
    won = [[names.index(x) for x in row] for row in winners(w, latencies, bandwidths, designs)]
    colors = ListedColormap(plt.get_cmap("tab10").colors[: len(names)])
    right.pcolormesh(bandwidths, latencies, won, cmap=colors, vmin=-0.5, vmax=len(names) - 0.5,
                     shading="nearest")
    present = sorted({i for row in won for i in row})
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(i)) for i in present]
    right.scatter([w.bandwidth], [max(w.latency, latencies[0])], marker="*", s=200, color="black", zorder=3)
    right.legend(handles, [names[i] for i in present], fontsize=7, title_fontsize=7,
                 title="fastest decode step (★ this workload)")
    right.set(xscale="log", yscale="log", xlabel="bandwidth (bytes/s)", ylabel="latency per collective (s)",
              title=f"winner by alpha and beta: B={w.batch}, {w.sampling.describe()}")
    fig.tight_layout()
    return save_png(fig, path)


def plot_demo(result: DemoResult, path: str) -> str:
    """Write a PNG of the demo's measurements: bytes received per rank per decode step (with the
    planner's prediction) and milliseconds per step, one bar per design and mode. Returns the
    path written (see ``png_path``)."""
    png_path(path)  # a bad name fails before any work
    plt = pyplot()
    labels = [f"{r.design} ({r.mode})" for r in result.rows]
    where = list(range(len(labels)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.4 * len(labels) + 1.5), sharey=True)
    left.barh(where, [max(r.measured, 1) for r in result.rows], label="measured (vocabpar.comm)")
    for i, r in enumerate(result.rows):
        if r.measured == 0:  # log axis: a zero-byte design gets a label instead of a bar
            left.text(1.2, i, "0 B: no collective", va="center", fontsize=8)
    predicted = [(i, r) for i, r in enumerate(result.rows) if r.predicted_worst]
    left.scatter([r.predicted for _, r in predicted], [i for i, _ in predicted], color="black", marker="|",
                 s=200, label="planner (typical..worst)", zorder=3)
    left.hlines([i for i, _ in predicted], [r.predicted for _, r in predicted],
                [r.predicted_worst for _, r in predicted], color="black", zorder=3)
    left.set(xscale="log", xlabel="bytes received per rank per decode step", yticks=where, yticklabels=labels)
    left.legend(fontsize=8)
    right.barh(where, [r.ms_per_step for r in result.rows], color="tab:orange")
    right.set(xlabel="ms per decode step")
    fig.suptitle(f"{result.model}: vocab {result.vocab}, {result.ranks} gloo ranks, batch {result.batch}")
    for ax in (left, right):
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return save_png(fig, path)
