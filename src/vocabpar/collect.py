"""Logits collection: from per-rank vocab shards to full-vocabulary rows where they are needed.

The strategies' facts (inputs, chunking, rows each rank ends with, what they send) are
:data:`vocabpar.wire.strategies.STRATEGIES`; here each is one short run function (:data:`RUN`). They
share two helpers: ``padded_local`` (local FP32 logits padded to the layout's widest shard, so
every collective moves equal shapes) and ``to_token_order`` (stacked shards -> columns in
token-id order, padding dropped, using the layout's id ranges). Every strategy returns, for the
rows it hands to this rank, exactly the logits of ``head.local_logits`` arranged in token order,
so all strategies agree with each other bit for bit. Chunking (``chunk_rows``) changes how many
rows are computed and moved at once, never values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from vocabpar import comm
from vocabpar.head import ParallelLMHead
from vocabpar.layout import VocabLayout
from vocabpar.wire import strategies
from vocabpar.wire.strategies import STRATEGIES

ProcessGroup = comm.ProcessGroup


@dataclass(frozen=True)
class ShardedLogits:
    """Logits left sharded (strategy ``none``): this rank's FP32 ``[B, rows]`` block."""

    logits: torch.Tensor
    layout: VocabLayout
    rank: int


def padded_local(head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
    """This rank's FP32 logits ``[T, shard_width]`` of ``hidden`` ``[T, H]``: its shard padded to
    the widest, the block every collecting strategy sends."""
    out = torch.empty(hidden.shape[0], head.layout.shard_width, dtype=torch.float32, device=hidden.device)
    return head.logits_into(hidden, out)


def to_token_order(stacked: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    """``[n, B, shard_width]`` shards in rank order -> ``[B, vocab_size]`` in token order, padding
    dropped: one copy of each rank's org and added id range, so one pass over ``[B, V]``."""
    out = stacked.new_empty(stacked.shape[1], layout.vocab_size)
    for r, shard in enumerate(layout.shards):
        for start, end, local in shard.ranges:
            out[:, start:end] = stacked[r, :, local: local + end - start]
    return out


def _local_full(head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
    """Replicated head: every column is local, already in token order."""
    return padded_local(head, hidden)[:, : head.layout.vocab_size]


# --------------------------------------------------------------------------- strategies
# Each takes (head, hidden rows of one chunk, sizes, dst, scatter) and returns this rank's rows of
# the chunk; ``sizes``: the rows of the chunk that each rank ends with ("blocks" and "own" inputs).
def _all_gather(head, hidden, sizes, dst, scatter):
    if head.layout.scheme == "replicated":
        return _local_full(head, hidden)
    return to_token_order(comm.all_gather(padded_local(head, hidden), head.group), head.layout)


def _gather(head, hidden, sizes, dst, scatter):
    if head.layout.scheme == "replicated":
        return _local_full(head, hidden) if comm.rank(head.group) == dst else None
    stacked = comm.gather(padded_local(head, hidden), dst, head.group)
    return None if stacked is None else to_token_order(stacked, head.layout)


def _to_owners(head, hidden, sizes, dst, scatter):
    """Rows of ``hidden`` are grouped by destination (``sizes[r]`` rows for rank r); each rank
    computes its shard for all of them and receives the full-vocab rows of its own group."""
    n, me = comm.world_size(head.group), comm.rank(head.group)
    if head.layout.scheme == "replicated":
        start = sum(sizes[:me])
        return _local_full(head, hidden[start: start + sizes[me]])
    received = comm.all_to_all(padded_local(head, hidden), sizes, [sizes[me]] * n, head.group)
    return to_token_order(received.view(n, sizes[me], head.layout.shard_width), head.layout)


def _dp_gather_scatter(head, hidden, sizes, dst, scatter):
    """``hidden``: every rank's rows of this chunk (``sizes``), gathered. Each rank gets back its
    own rows' full-vocab logits by all-to-all, or SGLang's way (``scatter="all_gather"``): every
    rank collects every row and keeps its own."""
    if scatter == "all_to_all":
        return _to_owners(head, hidden, sizes, dst, scatter)
    me = comm.rank(head.group)
    first = sum(sizes[:me])
    return _all_gather(head, hidden, sizes, dst, scatter)[first: first + sizes[me]]


def _none(head, hidden, sizes, dst, scatter):
    return head.local_logits(hidden)


RUN: dict[str, Callable] = {
    "all_gather": _all_gather, "gather": _gather, "all_to_all": _to_owners,
    "dp_gather_scatter": _dp_gather_scatter, "none": _none,
    "replicated": _all_gather,  # a replicated layout never communicates (checked below)
}
SCATTERS = ("all_to_all", "all_gather")


# --------------------------------------------------------------------------- entry points
def _chunks(total: int, step: int) -> Iterator[slice]:
    """Row slices of at most ``step`` rows; always at least one (possibly empty) slice so every
    rank issues the same collectives even for an empty batch."""
    for start in range(0, max(total, 1), step):
        yield slice(start, min(start + step, total))


def iter_logits(head: ParallelLMHead, hidden: torch.Tensor, *, strategy: str,
                group: ProcessGroup = None, chunk_rows: int | None = None, dst: int = 0,
                scatter: str = "all_to_all", check: bool | None = None
                ) -> Iterator[tuple[slice, torch.Tensor | None]]:
    """Yield ``(rows, logits)`` chunk by chunk: ``logits`` are this rank's output rows ``rows``
    (``None`` off the destination for ``gather``; a ``[rows, shard]`` block for ``none``). At
    most ``chunk_rows`` rows of hidden state are computed and collected per chunk, over all
    ranks; every rank walks the same chunks.

    Before the first collective the ranks check (:func:`vocabpar.comm.agree`) that they agree on
    the strategy, chunking, row count and -- for the strategies whose hidden rows are replicated
    -- a fingerprint of ``hidden``; any disagreement or bad input is the same ``ValueError`` on
    every rank. ``check=False`` (or ``VOCABPAR_CHECK=0``) skips it; a strategy whose ranks bring
    their own rows (``dp_gather_scatter``) folds it into the row-count exchange it makes anyway."""
    n = comm.world_size(head.group)
    s = STRATEGIES.get(strategy)  # None: facts() rejects it on every rank
    own = s is not None and s.inputs == "own"

    def facts() -> dict[str, comm.Fact]:
        _check_arguments(head, hidden, strategy, group, chunk_rows, dst, scatter)
        agreed = {"strategy": strategy, "rows": hidden.shape[0], "chunk_rows": chunk_rows or 0}
        if own:
            return agreed | {"scatter": scatter}
        return agreed | {"dst": dst if strategy == "gather" else 0, "hidden": hidden}

    if (s is not None and s.on_shards) or head.layout.scheme == "replicated" or n == 1:
        facts()  # nothing crosses ranks: local validation only
        sizes = [hidden.shape[0]] * n
    else:
        sizes = comm.agree(f"compute_logits(strategy={strategy!r})", head.group, facts, check=check,
                           vary=("rows",) if own else ()).get("rows", [hidden.shape[0]] * n)
    run, inputs = RUN[strategy], s.inputs
    if inputs == "batch":
        for rows in _chunks(hidden.shape[0], chunk_rows or max(hidden.shape[0], 1)):
            yield rows, run(head, hidden[rows], None, dst, scatter)
        return
    if inputs == "own" and head.layout.scheme == "replicated":  # each rank computes its own rows
        for rows in _chunks(hidden.shape[0], chunk_rows or max(hidden.shape[0], 1)):
            yield rows, _local_full(head, hidden[rows])
        return
    if inputs == "blocks":  # the replicated rows are n equal blocks, one per rank
        sizes = [hidden.shape[0] // n] * n
        hidden = hidden.reshape(n, sizes[0], hidden.shape[1])
    # chunk k takes the k-th slice of every rank's block, so each chunk is again one block per rank;
    # unchunked, one chunk holds every block whole
    me = comm.rank(head.group)
    step = max(1, chunk_rows // n) if chunk_rows else max(max(sizes), 1)
    for start in range(0, max(max(sizes), 1), step):
        chunk = [max(0, min(step, size - start)) for size in sizes]
        rows = slice(min(start, sizes[me]), min(start, sizes[me]) + chunk[me])
        if inputs == "own":
            part = torch.cat(comm.all_gather_uneven(hidden[rows], chunk, head.group))
        else:
            part = hidden[:, start: start + chunk[0]].reshape(-1, hidden.shape[2])
        yield rows, run(head, part, chunk, dst, scatter)


def _check_arguments(head, hidden, strategy, group, chunk_rows, dst, scatter) -> None:
    """Local validation of :func:`iter_logits`' arguments (``ValueError`` naming the problem)."""
    n, me = comm.world_size(head.group), comm.rank(head.group)
    if group is not None and not comm.same_group(group, head.group):
        raise ValueError("group must be the process group the head was built on (or None)")
    s = strategies.strategy(strategy)  # ValueError for an unknown name
    if s.replicated_only and head.layout.scheme != "replicated":
        raise ValueError(f"strategy {strategy!r} needs a replicated layout, got {head.layout.scheme!r}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int)
                                   or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive int or None, got {chunk_rows!r}")
    if strategy == "gather" and not (isinstance(dst, int) and 0 <= dst < n):
        raise ValueError(f"dst must be a rank in [0, {n}), got {dst!r}")
    if scatter not in SCATTERS:
        raise ValueError(f"scatter must be 'all_to_all' or 'all_gather', got {scatter!r}")
    head.check_hidden(hidden)
    if s.inputs == "blocks" and hidden.shape[0] % n:
        raise ValueError(f"{strategy} splits rows into {n} equal blocks, but there are {hidden.shape[0]} "
                         f"rows (rank {me}); pad the batch or use dp_gather_scatter")


def compute_logits(head: ParallelLMHead, hidden: torch.Tensor, *, strategy: str,
                   group: ProcessGroup = None, chunk_rows: int | None = None, dst: int = 0,
                   scatter: str = "all_to_all", check: bool | None = None
                   ) -> torch.Tensor | ShardedLogits | None:
    """FP32 logits for the rows of ``hidden`` collected by ``strategy``:

    * ``all_gather`` / ``replicated``: ``[B, vocab_size]`` in token order on every rank;
    * ``gather``: the same on rank ``dst``, ``None`` elsewhere (see :func:`broadcast_tokens`);
    * ``all_to_all``: rank r gets rows ``[r*B/n, (r+1)*B/n)``, full vocab;
    * ``dp_gather_scatter``: each rank passes its own rows and gets exactly those back
      (``scatter``: ``all_to_all`` or SGLang's ``all_gather``);
    * ``none``: :class:`ShardedLogits`, this rank's ``[B, rows]`` shard for the sampler.

    ``check``: the agreement check of :func:`iter_logits`."""
    out = None
    for rows, logits in iter_logits(head, hidden, strategy=strategy, group=group, chunk_rows=chunk_rows,
                                    dst=dst, scatter=scatter, check=check):
        if logits is None:
            continue
        blocks = STRATEGIES[strategy].inputs == "blocks"
        own = hidden.shape[0] // comm.world_size(head.group) if blocks else hidden.shape[0]
        if out is None and rows.stop - rows.start == own:  # one chunk holds everything: no copy
            out = logits
            continue
        if out is None:
            out = logits.new_empty((own, logits.shape[1]))
        out[rows] = logits
    if STRATEGIES[strategy].on_shards:
        return ShardedLogits(out, head.layout, head.rank)
    return out


def broadcast_tokens(tokens: torch.Tensor | None, rows: int, src: int = 0,
                     group: ProcessGroup = None, check: bool | None = None) -> torch.Tensor:
    """After ``gather``: send the int64 ``[rows]`` ids sampled on ``src`` to every rank (after
    checking that the ranks agree on ``rows`` and ``src``)."""
    def facts() -> dict[str, comm.Fact]:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"broadcast_tokens: rows must be an int >= 0, got {rows!r}")
        if comm.rank(group) == src and (tokens is None or tuple(tokens.shape) != (rows,)):
            raise ValueError(f"broadcast_tokens: rank {src} must pass [{rows}] token ids, got "
                             f"{None if tokens is None else tuple(tokens.shape)}")
        return {"rows": rows, "src": src}

    comm.agree("broadcast_tokens", group, facts, check=check)
    if comm.rank(group) == src:
        buf = tokens.long().contiguous()
    else:
        buf = torch.empty(rows, dtype=torch.long, device=comm.device(group))
    return comm.broadcast(buf, src, group)
