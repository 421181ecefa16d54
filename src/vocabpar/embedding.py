"""Vocab-parallel embedding: each rank looks up the ids it owns, the exchange assembles rows.

Invariant: the output on every rank is bit-identical to ``F.embedding(ids, full_table)`` (for a
quantized table: to dequantizing the full table, then looking up). Nothing ever adds floats:
rows move as raw bytes, and the all-reduce sums integer bit patterns where only the owner
contributes non-zero bytes.
"""

from __future__ import annotations

import torch

from vocabpar import comm
from vocabpar.layout import VocabLayout
from vocabpar.weights import VocabShardedMatrix, dequantize_rows
from vocabpar.wire.strategies import EXCHANGE_CHOICES, exchange_bytes

OOB_MODES = ("error", "zero")


def exchange_costs(counts: list[int], total: int) -> dict[str, float]:
    """Rows a rank receives under each exchange, given how many of ``total`` looked-up rows each
    rank owns (:func:`vocabpar.wire.strategies.exchange_bytes`, the planner's formula, for one-byte
    rows): the ring all-reduce ``2(n-1)/n·T``, the owner gather ``(n-1)·max(counts)``."""
    n = len(counts)
    return {mode: exchange_bytes(mode, total, 1, n, max(counts)) for mode in ("all_reduce", "owner_gather")}


class VocabParallelEmbedding(VocabShardedMatrix):
    """Embedding whose rows are split over ``group`` as ``layout`` says.

    ``ids`` must be the same on every rank (replicated, as after tokenisation); any leading
    shape. ``exchange``: ``all_reduce`` (masked rows summed bit-exactly), ``owner_gather`` (each
    owner contributes only its rows to one all-gather) or ``auto`` (whichever moves fewer
    bytes for these ids: owner gather wins when ownership is balanced, the all-reduce when
    one rank owns most of them). ``oob``: ``error`` rejects ids outside ``[0, vocab_size)``;
    ``zero`` returns zero rows for them (multimodal placeholders). ``check``: before exchanging,
    the ranks compare the id count and a fingerprint of the ids (:func:`vocabpar.comm.agree`:
    one all-gather of 256 bytes per rank, one pass over the ids); ``None`` follows
    ``VOCABPAR_CHECK``."""

    def __init__(self, layout: VocabLayout, embedding_dim: int, *, group: comm.ProcessGroup = None,
                 dtype: torch.dtype = torch.float32, exchange: str = "auto", oob: str = "error",
                 quantized: bool = False, compute_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, check: bool | None = None) -> None:
        if exchange not in EXCHANGE_CHOICES:
            raise ValueError(f"exchange must be one of {EXCHANGE_CHOICES}, got {exchange!r}")
        if oob not in OOB_MODES:
            raise ValueError(f"oob must be one of {OOB_MODES}, got {oob!r}")
        super().__init__(layout, embedding_dim, group=group, dtype=dtype, quantized=quantized,
                         compute_dtype=compute_dtype, device=device, exchange=exchange, oob=oob)
        self.embedding_dim, self.exchange, self.oob, self.check = embedding_dim, exchange, oob, check
        self.last_exchange: str | None = None  # the EMBEDDING_EXCHANGES word the latest forward used

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = comm.world_size(self.group)
        if self.layout.scheme == "replicated" or n == 1:
            flat = self._checked_ids(ids).reshape(-1)
            mode, packed = "local", self.local_rows(flat)
        else:
            comm.agree("VocabParallelEmbedding", self.group,
                       lambda: {"ids": self._checked_ids(ids).numel(), "token ids": ids}, check=self.check)
            flat = ids.reshape(-1)
            mode, packed = self.exchange, None
            if mode != "all_reduce":  # ownership counts decide auto and shape the owner gather
                owner = self.layout.owner(flat)
                counts = torch.bincount(owner + 1, minlength=n + 1).tolist()  # [out of range, r0..]
                if mode == "auto":
                    costs = exchange_costs(counts[1:], flat.numel())
                    mode = min(costs, key=costs.get)  # ties -> all_reduce (listed first)
                if mode == "owner_gather":
                    packed = self._owner_gather(flat, owner, counts)
        if mode == "all_reduce":
            packed = comm.all_reduce_exact(self.local_rows(flat), self.group)
        self.last_exchange = mode
        return self.unpack_rows(packed).reshape(*ids.shape, self.embedding_dim)

    # ------------------------------------------------------------------ steps
    def local_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """One gather: owned ids -> their local row, everything else -> the zero sentinel row.
        Rows travel as integer words; quantized rows carry their 4 scale bytes at the end."""
        local, owned = self.layout.local_ids(ids, self.rank)
        rows = torch.where(owned, local, torch.full_like(local, self.sentinel))
        found = comm.as_words(self.table).index_select(0, rows)
        if not self.quantized:
            return found
        scale_bytes = self.scale.index_select(0, rows).view(torch.uint8).view(-1, 4)
        return comm.as_words(torch.cat([found.view(torch.uint8), scale_bytes], dim=1))

    def _owner_gather(self, ids: torch.Tensor, owner: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each owner gathers its rows (in position order); one all-gather (sizes known to all,
        since ids are replicated) hands every rank every block, and a single row gather puts
        each position's row in place. Out-of-range ids (owner -1) get zero rows."""
        me, skipped = self.rank, counts[0]
        order = torch.argsort(owner, stable=True)  # out-of-range first, then by owner
        starts = torch.tensor(counts, device=ids.device).cumsum(0)
        block = self.local_rows(ids.index_select(0, order[starts[me]: starts[me + 1]]))
        stacked, _ = comm.all_gather_padded(block, counts[1:], self.group)
        # row of stacked.flatten(0, 1) holding each owned position: owner * width + rank in block
        owners = owner.index_select(0, order[skipped:])
        within = torch.arange(owners.numel(), device=ids.device) - \
            (starts[:-1] - skipped).repeat_interleave(starts.diff())
        source = owners * stacked.shape[1] + within
        rows = stacked.flatten(0, 1)
        if not skipped:
            return rows.index_select(0, torch.empty_like(source).index_copy_(0, order, source))
        out = rows.new_zeros((ids.numel(), rows.shape[1]))
        return out.index_copy_(0, order[skipped:], rows.index_select(0, source))

    def unpack_rows(self, packed: torch.Tensor) -> torch.Tensor:
        """Rows in the compute dtype ``[T, dim]`` from :meth:`local_rows`' integer words
        (quantized rows dequantized with their scales)."""
        if packed.shape[0] == 0:
            return torch.empty(0, self.embedding_dim, dtype=self.compute_dtype, device=packed.device)
        raw = packed.view(torch.uint8)
        if not self.quantized:
            return raw.view(self.table.dtype)
        row_bytes = self.embedding_dim * self.table.element_size()
        q = raw[:, :row_bytes].view(self.table.dtype)  # one-byte elements: any offset will do
        scale = raw[:, row_bytes:].clone(memory_format=torch.contiguous_format)  # fresh, aligned
        scale = scale.view(torch.float32).reshape(-1)
        return dequantize_rows(q, scale, self.compute_dtype)

    def _checked_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")
        bad = (ids < 0) | (ids >= self.layout.vocab_size)
        if self.oob == "error" and bool(bad.any()):
            where = bad.nonzero()[:5]
            shown = ", ".join(f"{tuple(p.tolist())}={ids[tuple(p)].item()}" for p in where)
            raise ValueError(f"{int(bad.sum())} token id(s) outside [0, {self.layout.vocab_size}) "
                             f"(rank {self.rank}); first at position=value: {shown}")
        return ids
