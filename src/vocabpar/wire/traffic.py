"""The byte model, stated once: what one rank receives in each kind of collective.

``vocabpar.comm`` books measured traffic with these formulas and the planner prices predicted
traffic with them, so the two can be compared number for number. Per rank and call, with ``n``
ranks in the group:

=====================  ==========================================================
kind                   received
=====================  ==========================================================
all_reduce (ring)      ``2(n-1)/n · m`` (``m``: bytes of the buffer); sent alike
all_gather (ring)      ``(n-1) · c`` (``c``: the per-rank chunk, padded to the largest)
gather                 ``(n-1) · c`` on the destination, nothing elsewhere
broadcast (flat)       ``m`` on every rank but the source
all_to_all             the bytes of the splits other ranks send to this one
=====================  ==========================================================

A group of one rank sends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

WORD = 8
"""Bytes of one message word: the sampler's, scorer's and agreement's messages are int64 words
(float64 values travel as their bit patterns)."""


def all_reduce_bytes(nbytes: float, ranks: int) -> float:
    """Ring all-reduce of an ``nbytes`` buffer: ``2(n-1)/n · nbytes`` sent and received per rank."""
    return 2 * (ranks - 1) / ranks * nbytes


def all_gather_bytes(chunk_bytes: float, ranks: int) -> float:
    """Ring all-gather of ``chunk_bytes`` per rank: ``(n-1) · chunk`` sent and received per rank."""
    return (ranks - 1) * chunk_bytes


@dataclass(frozen=True)
class Traffic:
    """What one rank takes part in: ``collectives`` calls in which it receives ``bytes`` in the
    typical case, and at most ``collectives_worst`` calls and ``bytes_worst`` bytes (equal to
    the typical ones where the traffic does not depend on the data). Traffic adds up."""

    collectives: int = 0
    bytes: int = 0
    collectives_worst: int = 0
    bytes_worst: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.collectives + other.collectives, self.bytes + other.bytes,
                       self.collectives_worst + other.collectives_worst, self.bytes_worst + other.bytes_worst)


def exact(collectives: int, nbytes: int) -> Traffic:
    """Traffic that does not depend on the data."""
    return Traffic(collectives, nbytes, collectives, nbytes)


def maybe(t: Traffic) -> Traffic:
    """``t`` in the worst case only: the typical case does without it."""
    return Traffic(0, 0, t.collectives_worst, t.bytes_worst)


def between(typical: Traffic, worst: Traffic) -> Traffic:
    """``typical`` in the typical case, ``worst`` at most."""
    return Traffic(typical.collectives, typical.bytes, worst.collectives_worst, worst.bytes_worst)


def all_reduce(nbytes: int, ranks: int) -> Traffic:
    """One ring all-reduce of ``nbytes`` (none on one rank)."""
    return exact(int(ranks > 1), round(all_reduce_bytes(nbytes, ranks)))


def all_gather(chunk_bytes: int, ranks: int) -> Traffic:
    """One ring all-gather of ``chunk_bytes`` per rank (none on one rank)."""
    return exact(int(ranks > 1), round(all_gather_bytes(chunk_bytes, ranks)))
