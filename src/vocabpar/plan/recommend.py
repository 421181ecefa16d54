"""Which design to use and why: :func:`recommend` over one workload's priced designs, and
:func:`winners` over a grid of latencies and bandwidths. Every choice is made on the numbers of
:func:`vocabpar.plan.cost.plan`; the reason states them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from vocabpar.plan.cost import DesignCost, plan
from vocabpar.plan.model import DESIGNS, Design, Workload, check_limit, count, human


@dataclass(frozen=True)
class Recommendation:
    """The design to use, the reason in words, and every eligible design, fastest first."""

    design: str
    reason: str
    ranking: tuple[str, ...]  # eligible designs, fastest decode step first (memory breaks ties)


def recommend(costs: list[DesignCost], headroom_bytes: float | None = None) -> Recommendation:
    """The fastest design per decode step among those using the full rank count whose memory
    above the leanest fits ``headroom_bytes`` (no limit when ``None``), with the reason.
    ``ValueError`` when none fits (the leanest design overall may use fewer ranks)."""
    if headroom_bytes is not None:
        check_limit("headroom", headroom_bytes)
    ranks = max(c.ranks for c in costs)
    ranked = sorted((c for c in costs if c.ranks == ranks), key=lambda c: (c.step_time_s, c.memory_bytes))
    fits = [c for c in ranked if headroom_bytes is None or c.extra_memory_bytes <= headroom_bytes]
    leanest = min(ranked, key=lambda c: c.memory_bytes)
    if not fits:
        raise ValueError(f"no {ranks}-rank design fits a headroom of {human(headroom_bytes, 'ibytes')}: the "
                         f"leanest, {leanest.name}, needs {human(leanest.extra_memory_bytes, 'ibytes')} more "
                         f"per rank than {min(costs, key=lambda c: c.memory_bytes).name}")
    best = fits[0]
    runner = next((c for c in fits[1:] if c.step_time_s > best.step_time_s), None)
    step = "verification" if best.step == "verify" else "decode"
    reason = (f"{best.name} has the shortest estimated {step} step"
              f"{' within the headroom' if best is not ranked[0] else ''}: "
              f"{human(best.step_time_s, 'seconds')} ({human(best.step_bytes, 'bytes')} received in "
              f"{count(best.collectives, 'collective')}, {count(best.launches, 'launch')}, "
              f"{count(best.host_reads, 'host read')}, head {human(best.head_time_s, 'seconds')})")
    reason += f" vs {human(runner.step_time_s, 'seconds')} for {runner.name}." if runner else "."
    if best is not ranked[0]:
        faster = ranked[0]
        reason += (f" {faster.name} would take {human(faster.step_time_s, 'seconds')} but needs "
                   f"{human(faster.extra_memory_bytes, 'ibytes')} more per rank than {leanest.name}, "
                   f"above the {human(headroom_bytes, 'ibytes')} headroom.")
    elif best.extra_memory_bytes:
        room = "" if best.kv_tokens is None else f", room for {human(best.kv_tokens, 'tokens')} of KV cache"
        reason += (f" It holds {human(best.extra_memory_bytes, 'ibytes')} more per rank than "
                   f"{leanest.name}{room}.")
    else:
        reason += f" It is also the leanest design ({human(best.memory_bytes, 'ibytes')} per rank)."
    return Recommendation(best.name, reason, tuple(c.name for c in ranked))


def winners(w: Workload, latencies: list[float], bandwidths: list[float],
            designs: tuple[Design, ...] = DESIGNS) -> list[list[str]]:
    """The recommended design (:func:`recommend`, no headroom limit) for ``w`` at every
    (latency, bandwidth) of a grid: one list per latency, one name per bandwidth."""
    return [[recommend(plan(replace(w, latency=a, bandwidth=b), designs)).design for b in bandwidths]
            for a in latencies]
