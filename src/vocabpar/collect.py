"""Logits collection: from per-rank vocab shards to full-vocabulary rows where they are needed.

Each strategy is one short function; they share two helpers: ``_padded_local`` (local FP32
logits padded to the layout's widest shard, so every collective moves equal shapes) and
``_to_token_order`` (stacked shards -> columns in token-id order, padding dropped, using the
layout's id ranges). Every
strategy returns, for the rows it hands to this rank, exactly the logits of
``head.local_logits`` arranged in token order, so all strategies agree with each other bit for
bit. Chunking (``max_rows``) changes how many rows are computed and moved at once, never values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from vocabpar import comm
from vocabpar.head import ParallelLMHead
from vocabpar.layout import VocabLayout

ProcessGroup = comm.ProcessGroup


@dataclass(frozen=True)
class ShardedLogits:
    """Logits left sharded (strategy ``none``): this rank's FP32 ``[B, rows]`` block."""

    logits: torch.Tensor
    layout: VocabLayout
    rank: int


def _padded_local(head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
    out = torch.empty(hidden.shape[0], head.layout.max_rows, dtype=torch.float32, device=hidden.device)
    return head.logits_into(hidden, out)


def _to_token_order(stacked: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    """``[n, B, max_rows]`` shards in rank order -> ``[B, vocab_size]`` in token order, padding
    dropped: one copy of each rank's base and added id range, so one pass over ``[B, V]``."""
    out = stacked.new_empty(stacked.shape[1], layout.vocab_size)
    for r, shard in enumerate(layout.shards):
        for start, end, local in shard.ranges:
            out[:, start:end] = stacked[r, :, local: local + end - start]
    return out


def _local_full(head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
    """Replicated head: every column is local, already in token order."""
    return _padded_local(head, hidden)[:, : head.layout.vocab_size]


# --------------------------------------------------------------------------- strategies
# Each takes (head, hidden chunk, group, dst) and returns this rank's rows of the chunk.
def _all_gather(head, hidden, group, dst):
    if head.layout.scheme == "replicated":
        return _local_full(head, hidden)
    return _to_token_order(comm.all_gather(_padded_local(head, hidden), group), head.layout)


def _gather(head, hidden, group, dst):
    if head.layout.scheme == "replicated":
        return _local_full(head, hidden) if comm.rank(group) == dst else None
    stacked = comm.gather(_padded_local(head, hidden), dst, group)
    return None if stacked is None else _to_token_order(stacked, head.layout)


def _to_owners(head, hidden, splits, group):
    """Rows of ``hidden`` are grouped by destination (``splits[r]`` rows for rank r); each rank
    computes its shard for all of them and receives the full-vocab rows of its own group."""
    n, me = comm.world_size(group), comm.rank(group)
    if head.layout.scheme == "replicated":
        start = sum(splits[:me])
        return _local_full(head, hidden[start: start + splits[me]])
    received = comm.all_to_all(_padded_local(head, hidden), splits, [splits[me]] * n, group)
    return _to_token_order(received.view(n, splits[me], head.layout.max_rows), head.layout)


def _all_to_all(head, hidden, group, dst):
    """``hidden`` (the same on every rank) is n equal row blocks; rank r gets block r."""
    n = comm.world_size(group)
    return _to_owners(head, hidden, [hidden.shape[0] // n] * n, group)


def _none(head, hidden, group, dst):
    return head.local_logits(hidden)


STRATEGIES: dict[str, Callable] = {
    "all_gather": _all_gather, "gather": _gather, "all_to_all": _all_to_all, "none": _none,
    "replicated": _all_gather,  # a replicated layout never communicates (checked below)
}


# --------------------------------------------------------------------------- entry points
def _chunks(total: int, step: int) -> Iterator[slice]:
    """Row slices of at most ``step`` rows; always at least one (possibly empty) slice so every
    rank issues the same collectives even for an empty batch."""
    for start in range(0, max(total, 1), step):
        yield slice(start, min(start + step, total))


def iter_logits(head: ParallelLMHead, hidden: torch.Tensor, *, strategy: str,
                group: ProcessGroup = None, max_rows: int | None = None, dst: int = 0,
                scatter: str = "all_to_all", check: bool | None = None
                ) -> Iterator[tuple[slice, torch.Tensor | None]]:
    """Yield ``(rows, logits)`` chunk by chunk: ``logits`` are this rank's output rows ``rows``
    (``None`` off the destination for ``gather``; a ``[rows, shard]`` block for ``none``). At
    most ``max_rows`` rows of hidden state are computed and collected per chunk, over all ranks;
    every rank walks the same chunks.

    Before the first collective the ranks check (:func:`vocabpar.comm.agree`) that they agree on
    the strategy, chunking, row count and -- for the strategies whose hidden rows are replicated
    -- a fingerprint of ``hidden``; any disagreement or bad input is the same ``ValueError`` on
    every rank. ``check=False`` (or ``VOCABPAR_CHECK=0``) skips it; ``dp_gather_scatter`` folds
    it into the row-count exchange it makes anyway."""
    n = comm.world_size(head.group)
    dp = strategy == "dp_gather_scatter"

    def facts() -> dict[str, comm.Fact]:
        _check_arguments(head, hidden, strategy, group, max_rows, dst, scatter)
        agreed = {"strategy": strategy, "rows": hidden.shape[0], "max_rows": max_rows or 0}
        if dp:
            return agreed | {"scatter": scatter}
        return agreed | {"dst": dst if strategy == "gather" else 0, "hidden": hidden}

    if strategy == "none" or head.layout.scheme == "replicated" or n == 1:
        facts()  # nothing crosses ranks: local validation only
        sizes = [hidden.shape[0]] * n
    else:
        sizes = comm.agree(f"compute_logits(strategy={strategy!r})", head.group, facts, check=check,
                           vary=("rows",) if dp else ()).get("rows", [hidden.shape[0]] * n)
    if dp:
        yield from _iter_dp(head, hidden, sizes, max_rows, scatter)
        return
    total = hidden.shape[0]
    if strategy != "all_to_all":
        for rows in _chunks(total, max_rows or max(total, 1)):
            yield rows, STRATEGIES[strategy](head, hidden[rows], head.group, dst)
        return
    # chunk k takes the k-th slice of every rank's block, so each chunk is again n equal blocks
    block = total // n
    blocks = hidden.reshape(n, block, hidden.shape[1])
    for rows in _chunks(block, max(1, (max_rows or total) // n)):
        yield rows, _all_to_all(head, blocks[:, rows].reshape(-1, hidden.shape[1]), head.group, dst)


def _check_arguments(head, hidden, strategy, group, max_rows, dst, scatter) -> None:
    """Local validation of :func:`iter_logits`' arguments (``ValueError`` naming the problem)."""
    n, me = comm.world_size(head.group), comm.rank(head.group)
    if group is not None and not comm.same_group(group, head.group):
        raise ValueError("group must be the process group the head was built on (or None)")
    names = sorted([*STRATEGIES, "dp_gather_scatter"])
    if strategy not in names:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {names}")
    if strategy == "replicated" and head.layout.scheme != "replicated":
        raise ValueError(f"strategy 'replicated' needs a replicated layout, got {head.layout.scheme!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        raise ValueError(f"max_rows must be a positive int or None, got {max_rows!r}")
    if strategy == "gather" and not (isinstance(dst, int) and 0 <= dst < n):
        raise ValueError(f"dst must be a rank in [0, {n}), got {dst!r}")
    if scatter not in ("all_to_all", "all_gather"):
        raise ValueError(f"scatter must be 'all_to_all' or 'all_gather', got {scatter!r}")
    head.check_hidden(hidden)
    if strategy == "all_to_all" and hidden.shape[0] % n:
        raise ValueError(f"all_to_all splits rows into {n} equal blocks, but there are {hidden.shape[0]} "
                         f"rows (rank {me}); pad the batch or use dp_gather_scatter")


def _iter_dp(head, hidden, sizes, max_rows, scatter):
    """DP attention: each rank brings its own rows (``sizes``: every rank's row count, from the
    agreement exchange); per chunk the hidden rows are all-gathered and each rank gets back
    full-vocab logits for exactly its rows -- by all-to-all (each rank receives only its rows),
    or, with ``scatter="all_gather"``, SGLang's way (every rank collects every row, keeps its
    own). A replicated head needs none of this: each rank computes its own rows."""
    if head.layout.scheme == "replicated":
        for rows in _chunks(hidden.shape[0], max_rows or max(hidden.shape[0], 1)):
            yield rows, _local_full(head, hidden[rows])
        return
    group = head.group
    n, me = comm.world_size(group), comm.rank(group)
    step = max(1, (max_rows or max(sum(sizes), 1)) // n)
    for start in range(0, max(max(sizes), 1), step):
        chunk = [max(0, min(step, s - start)) for s in sizes]
        rows = slice(min(start, sizes[me]), min(start, sizes[me]) + chunk[me])
        gathered = torch.cat(comm.all_gather_uneven(hidden[rows], chunk, group))
        if scatter == "all_to_all":
            yield rows, _to_owners(head, gathered, chunk, group)
        else:
            first = sum(chunk[:me])
            yield rows, _all_gather(head, gathered, group, 0)[first: first + chunk[me]]


def compute_logits(head: ParallelLMHead, hidden: torch.Tensor, *, strategy: str,
                   group: ProcessGroup = None, max_rows: int | None = None, dst: int = 0,
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
    for rows, logits in iter_logits(head, hidden, strategy=strategy, group=group, max_rows=max_rows,
                                    dst=dst, scatter=scatter, check=check):
        if logits is None:
            continue
        own = hidden.shape[0] // comm.world_size(head.group) if strategy == "all_to_all" else hidden.shape[0]
        if out is None and rows.stop - rows.start == own:  # one chunk holds everything: no copy
            out = logits
            continue
        if out is None:
            out = logits.new_empty((own, logits.shape[1]))
        out[rows] = logits
    if strategy == "none":
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
