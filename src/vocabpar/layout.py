"""Who owns which token id: the vocabulary split over the ranks of one process group.

Pure integer arithmetic plus index tensors; nothing here talks to other ranks.

Per-rank storage order is always ``[org rows | org padding | added rows | added padding]``.
Schemes:

* ``padded`` -- vLLM semantics: the org (original) vocab and the added (LoRA) vocab are each padded to a
  multiple of ``lcm(pad_to, world_size)`` and sharded equally, separately, and every rank
  stores its org slice followed by its added slice. Using the lcm (vLLM uses ``pad_to`` and
  then asserts divisibility) makes every world size valid.
* ``uneven`` -- TensorRT-LLM semantics: rank r owns ``[r*c, min((r+1)*c, V))`` with
  ``c = ceil(V/n)``; no padding, trailing ranks may own fewer rows or none.
* ``replicated`` -- every rank stores the whole vocabulary.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import cached_property

import torch

SCHEMES = ("padded", "uneven", "replicated")


@dataclass(frozen=True)
class Shard:
    """The slice of the vocabulary stored on one rank (ranges are half-open, global ids)."""

    rank: int
    org_start: int
    org_end: int
    added_start: int
    added_end: int
    num_org_padding: int
    num_added_padding: int

    @property
    def num_org(self) -> int:
        return self.org_end - self.org_start

    @property
    def num_added(self) -> int:
        return self.added_end - self.added_start

    @property
    def org_rows(self) -> int:
        """Local rows before the added block: org rows plus org padding."""
        return self.num_org + self.num_org_padding

    @property
    def rows(self) -> int:
        return self.org_rows + self.num_added + self.num_added_padding

    @property
    def ranges(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """``(global_start, global_end, local_start)`` of the org and the added ids stored."""
        return (self.org_start, self.org_end, 0), (self.added_start, self.added_end, self.org_rows)


def _round_up(x: int, quantum: int) -> int:
    return -(-x // quantum) * quantum


@dataclass(frozen=True)
class VocabLayout:
    """How ``vocab_size`` token ids (the first ``org_vocab_size`` of them the org (original) vocab, the rest
    added vocab) are stored over ``world_size`` ranks. Immutable and hashable."""

    vocab_size: int
    world_size: int
    org_vocab_size: int | None = None
    pad_to: int = 64
    scheme: str = "padded"

    def __init__(self, vocab_size: int, world_size: int, *, org_vocab_size: int | None = None,
                 pad_to: int = 64, scheme: str = "padded") -> None:
        for name, value in (("vocab_size", vocab_size), ("world_size", world_size), ("pad_to", pad_to)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if org_vocab_size is None:
            org_vocab_size = vocab_size
        if isinstance(org_vocab_size, bool) or not isinstance(org_vocab_size, int):
            raise TypeError(f"org_vocab_size must be an int, got {type(org_vocab_size).__name__}")
        if not 0 < org_vocab_size <= vocab_size:
            raise ValueError(
                f"org_vocab_size must be in [1, vocab_size={vocab_size}], got {org_vocab_size}")
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
        object.__setattr__(self, "vocab_size", vocab_size)
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "org_vocab_size", org_vocab_size)
        object.__setattr__(self, "pad_to", pad_to)
        object.__setattr__(self, "scheme", scheme)

    # ------------------------------------------------------------------ shard facts
    @property
    def num_added(self) -> int:
        return self.vocab_size - self.org_vocab_size

    @property
    def quantum(self) -> int:
        """Padding quantum of the padded scheme: every padded size is a multiple of it."""
        return math.lcm(self.pad_to, self.world_size)

    @property
    def org_vocab_size_padded(self) -> int:
        if self.scheme != "padded":
            return self.org_vocab_size
        return _round_up(self.org_vocab_size, self.quantum)

    @property
    def padded_vocab_size(self) -> int:
        """Rows over all ranks (padding included) for the sharded schemes; ``vocab_size`` when
        replicated (each rank holds exactly the vocabulary)."""
        if self.scheme != "padded":
            return self.vocab_size
        return _round_up(self.org_vocab_size_padded + self.num_added, self.quantum)

    @cached_property
    def shards(self) -> tuple[Shard, ...]:
        return tuple(self._make_shard(r) for r in range(self.world_size))

    def shard(self, rank: int) -> Shard:
        self.check_rank(rank)
        return self.shards[rank]

    def check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")

    def _make_shard(self, rank: int) -> Shard:
        V, org, n = self.vocab_size, self.org_vocab_size, self.world_size
        if self.scheme == "replicated":
            return Shard(rank, 0, org, org, V, 0, 0)
        if self.scheme == "uneven":
            per = -(-V // n)
            start, end = min(rank * per, V), min((rank + 1) * per, V)
            return Shard(rank, min(start, org), min(end, org), max(start, org), max(end, org), 0, 0)
        org_per = self.org_vocab_size_padded // n
        added_per = (self.padded_vocab_size - self.org_vocab_size_padded) // n
        org_start, org_end = min(rank * org_per, org), min((rank + 1) * org_per, org)
        added_start = min(org + rank * added_per, V)
        added_end = min(org + (rank + 1) * added_per, V)
        return Shard(rank, org_start, org_end, added_start, added_end,
                     org_per - (org_end - org_start), added_per - (added_end - added_start))

    @property
    def shard_width(self) -> int:
        """Vocabulary entries of the widest shard (rank 0's), padding included, without building
        every shard: the width of each rank's logits ``[B, shard_width]``."""
        if self.scheme == "padded":
            return self.padded_vocab_size // self.world_size
        if self.scheme == "uneven":
            return -(-self.vocab_size // self.world_size)
        return self.vocab_size

    @property
    def max_rows(self) -> int:
        """Deprecated name of :attr:`shard_width` (``max_rows`` is the engine ``Sampler``'s batch
        bound)."""
        warnings.warn("VocabLayout.max_rows is deprecated: use VocabLayout.shard_width (the vocabulary "
                      "entries per rank); max_rows now means batch rows only",
                      DeprecationWarning, stacklevel=2)
        return self.shard_width

    # ------------------------------------------------------------------ id arithmetic
    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """Owning rank of each id (same shape, int64); -1 for ids outside ``[0, vocab_size)``.
        For the replicated scheme every rank owns every id and rank 0 is reported."""
        ids = _as_ids(ids)
        valid = (ids >= 0) & (ids < self.vocab_size)
        if self.scheme == "replicated":
            owner = torch.zeros_like(ids)
        elif self.scheme == "uneven":
            owner = ids.clamp(min=0) // -(-self.vocab_size // self.world_size)
        else:
            org_per = self.org_vocab_size_padded // self.world_size
            added_per = max(1, (self.padded_vocab_size - self.org_vocab_size_padded) // self.world_size)
            is_org = ids < self.org_vocab_size
            owner = torch.where(is_org, ids.clamp(min=0) // org_per,
                                (ids - self.org_vocab_size).clamp(min=0) // added_per)
        return torch.where(valid, owner, torch.full_like(owner, -1))

    def local_ids(self, ids: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(local_rows, owned)``: the row of each id in ``rank``'s storage and whether that rank
        owns it; not-owned ids (including out-of-range ones) map to row 0."""
        s = self.shard(rank)
        ids = _as_ids(ids)
        in_org = (ids >= s.org_start) & (ids < s.org_end)
        in_added = (ids >= s.added_start) & (ids < s.added_end)
        rows = torch.where(in_org, ids - s.org_start, ids - s.added_start + s.org_rows)
        owned = in_org | in_added
        return torch.where(owned, rows, torch.zeros_like(rows)), owned

    def local_token_ids(self, rank: int) -> torch.Tensor:
        """Global token id stored at each local row of ``rank`` (-1 for padding rows)."""
        s = self.shard(rank)
        pad = torch.full((s.num_org_padding,), -1, dtype=torch.long)
        added_pad = torch.full((s.num_added_padding,), -1, dtype=torch.long)
        return torch.cat([torch.arange(s.org_start, s.org_end), pad,
                          torch.arange(s.added_start, s.added_end), added_pad])

    def sharded_to_full(self) -> torch.Tensor:
        """Permutation ``perm`` (length ``padded_vocab_size``) with ``cat(shards)[..., perm]`` =
        columns of token ids ``0..vocab_size-1`` in order, then every padding column."""
        if self.scheme == "replicated":
            return torch.arange(self.vocab_size)
        ids = torch.cat([self.local_token_ids(r) for r in range(self.world_size)])
        key = torch.where(ids >= 0, ids, self.vocab_size + torch.arange(ids.numel()))
        return torch.argsort(key)

    def describe(self) -> dict:
        """Plain-data summary (used by the consistency handshake and the CLI)."""
        return {"vocab_size": self.vocab_size, "org_vocab_size": self.org_vocab_size,
                "world_size": self.world_size, "pad_to": self.pad_to, "scheme": self.scheme}


def _as_ids(ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"token ids must be an integer tensor, got dtype {ids.dtype}")
    return ids.long()
