"""Resident memory of this process (Linux ``/proc``), for the demo and the benchmarks."""

from __future__ import annotations

import resource


def reset_peak() -> bool:
    """Reset the peak resident set to the current one (``clear_refs``); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size field in bytes: ``VmRSS`` (now) or ``VmHWM`` (peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def peak_bytes(was_reset: bool) -> int:
    """Peak resident set since the last successful :func:`reset_peak`, or over the process's
    lifetime where the peak could not be reset."""
    if was_reset:
        return status_bytes("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
