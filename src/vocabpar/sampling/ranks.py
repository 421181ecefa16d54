"""This rank's view of its group, decided once per call: how many ranks share the logits, which
ids its columns hold, and the agreement every entry point runs before its first collective."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vocabpar import comm
from vocabpar.hashing import M32, MASK62, fmix32
from vocabpar.layout import VocabLayout
from vocabpar.sampling.params import ROW_FIELDS, Rows


@dataclass(frozen=True)
class Ranks:
    """This rank's view of the group; ``n == 1`` (no collective) for a replicated layout."""

    group: comm.ProcessGroup
    me: int  # rank used for layout lookups
    n: int
    ids: torch.Tensor  # int64 [columns]: global id of each local column, -1 = padding
    real_counts: tuple[int, ...]  # real columns on each rank

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` of every rank stacked on a new leading dim (``[1, ...]`` on one rank)."""
        return t.unsqueeze(0) if self.n == 1 else comm.all_gather(t, self.group)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.n == 1 else comm.all_reduce(t, self.group)


def group_ranks(layout: VocabLayout, group: comm.ProcessGroup) -> Ranks:
    """This rank's view of ``group`` for ``layout``; raises if the group does not fit it."""
    if layout.scheme == "replicated":
        return Ranks(group, 0, 1, layout.local_token_ids(0), (layout.vocab_size,))
    comm.check_world(layout, group)
    me = comm.rank(group)
    counts = tuple(s.num_org + s.num_added for s in layout.shards)
    return Ranks(group, me, layout.world_size, layout.local_token_ids(me), counts)


def agreed(where: str, layout: VocabLayout, group: comm.ProcessGroup,
           facts: Callable[[], dict[str, comm.Fact]], check: bool | None) -> bool:
    """Run ``facts`` (it validates this rank's input and returns what must be replicated) and,
    when a collective follows (sharded logits, several ranks), agree on them across the group.
    Returns whether the agreement exchange ran."""
    if layout.scheme == "replicated" or comm.world_size(group) == 1:
        facts()
        return False
    comm.agree(where, group, facts, check=check)
    return comm.checks_enabled(check)


def params_fact(rows: Rows) -> torch.Tensor:
    """The per-row sampling parameters as one int64 tensor, field after field, for the agreement
    check; a disagreement names the fields that differ (:func:`vocabpar.comm.with_parts`)."""
    return comm.with_parts(torch.cat(_param_fields(rows)), [*ROW_FIELDS, "logit_bias", "allowed ids"])


def param_words(rows: Rows) -> torch.Tensor:
    """int64 ``[B, fields]``: each row's sampling parameters (a float as its float64 bits)."""
    return torch.stack(_param_fields(rows), 1)


def _param_fields(rows: Rows) -> list[torch.Tensor]:
    """Each per-row field as int64 ``[B]`` (a float as its float64 bits), then per row the
    fingerprints of its ``logit_bias`` and of the ids it may sample (0 when unused)."""
    fields = [getattr(rows, name).double().view(torch.long) if dtype.is_floating_point
              else getattr(rows, name) for name, dtype in ROW_FIELDS.items()]
    unused = torch.zeros_like(rows.seed)
    bias = unused if rows.bias is None else row_fingerprints(rows.bias_ids, rows.bias)
    allowed = unused if rows.allowed is None else row_fingerprints(rows.allowed)
    return fields + [bias, allowed]


def row_fingerprints(*parts: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: per row, a hash of that row of every part (each ``[B, ...]``, any dtype;
    its 32-bit words mixed with their positions, as :func:`vocabpar.hashing.fingerprint` mixes a
    tensor's): rows that differ anywhere differ with probability ~1 - 2**-32. No host read."""
    words = torch.cat([_int32_words(p) for p in parts], 1).long() & M32
    where = fmix32(torch.arange(words.shape[1], device=words.device))
    return fmix32(words ^ where).sum(1) & MASK62


def _int32_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[B, ...]`` as int32 ``[B, words]``: its bytes where they make 32-bit words, else
    its values."""
    flat = t.reshape(t.shape[0], -1)
    if flat.dtype.itemsize in (4, 8) and flat.dtype != torch.bool:
        return flat.contiguous().view(torch.int32)
    return flat.int()
