"""The ways vocabulary data crosses ranks, stated once as data: the logits collection strategies
and the embedding exchanges.

Pure facts, no ``torch.distributed``: :mod:`vocabpar.collect` runs each strategy (its name ->
function table covers exactly :data:`STRATEGIES`), :mod:`vocabpar.plan` prices them, the
Hugging Face integration asks which rows each rank samples, and the demo compares what they
send with what ``vocabpar.comm`` measured. Adding a strategy means an entry here, its run
function and tests.

Sizes follow the byte model of :mod:`vocabpar.wire.traffic`. ``c`` is the widest shard
(:attr:`vocabpar.layout.VocabLayout.max_rows`): collected shards travel padded to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vocabpar.wire.traffic import all_gather_bytes, all_reduce_bytes


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _block(rows: int, ranks: int, rank: int) -> range:
    """Rank ``rank``'s block when ``rows`` are cut into ``ranks`` blocks of ``ceil(rows/ranks)``."""
    per = _ceil(rows, ranks)
    return range(min(rank * per, rows), min((rank + 1) * per, rows))


def _balanced(rows: int, ranks: int, rank: int) -> range:
    """Rank ``rank``'s contiguous share when ``rows`` are split as evenly as possible."""
    start = rank * (rows // ranks) + min(rank, rows % ranks)
    return range(start, start + rows // ranks + (rank < rows % ranks))


@dataclass(frozen=True)
class Strategy:
    """One logits collection strategy; ``models``: the engine behaviour it stands for.

    ``inputs``: the hidden rows each rank passes -- ``"batch"`` (the same rows everywhere),
    ``"blocks"`` (the same rows everywhere, a multiple of n: n equal blocks, rank r gets block r)
    or ``"own"`` (each rank its own rows, as under DP attention: the row counts and then the
    hidden rows are all-gathered first). Chunking follows: ``"batch"`` moves ``chunk_rows`` rows
    per chunk, the others ``chunk_rows // n`` rows of every rank's block.
    ``collectives``: calls per chunk of the logits step itself (the agreement check, the DP
    hidden gather and sampling apart). ``gathered_rows(B, n)``: rows of all n shards a rank
    collects (it receives ``n-1`` of them, ``(n-1)·rows·c`` elements). ``kept_rows(B, dp)``:
    full-vocabulary rows kept apart from that. ``local_rows(B, dp)``: rows whose local logits a
    rank computes. ``owns(B, n, rank)``: the batch rows whose full logits the rank ends with,
    which it samples (``gather``: rank 0, the destination the integration and planner use; for
    ``none`` every rank holds its shard of every row). ``ids``: the collective that then shares
    the sampled ids so every rank knows every token (``None``: each rank already does).
    ``on_shards``: the logits stay sharded and the sharded sampler consumes them.
    ``replicated_only``: only for a replicated layout, where every rank computes full rows."""

    name: str
    models: str
    inputs: str
    collectives: int
    gathered_rows: Callable[[int, int], int]
    owns: Callable[[int, int, int], range]
    ids: str | None = None
    kept_rows: Callable[[int, int], int] = lambda rows, dp: 0
    local_rows: Callable[[int, int], int] = lambda rows, dp: rows
    on_shards: bool = False
    replicated_only: bool = False


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("all_gather", "vLLM, TensorRT-LLM (size-aware on uneven layouts): [B, V] on every rank",
             "batch", 1, lambda rows, n: rows, lambda rows, n, r: range(rows)),
    Strategy("gather", "vLLM gather-to-rank-0: [B, V] on the destination, which broadcasts the ids",
             "batch", 1, lambda rows, n: rows, lambda rows, n, r: range(rows if r == 0 else 0),
             ids="broadcast"),
    Strategy("all_to_all", "SGLang row-block exchange: full-vocab rows of the own block",
             "blocks", 1, lambda rows, n: _ceil(rows, n), _block, ids="all_gather"),
    Strategy("dp_gather_scatter", "SGLang DP attention: hidden rows gathered, logits all-gathered, own "
             "rows kept (priced so; the all-to-all return moves only the own rows)",
             "own", 1, lambda rows, n: rows, _balanced, ids="all_gather",
             kept_rows=lambda rows, dp: _ceil(rows, dp)),
    Strategy("none", "TensorRT-LLM gather_output=False: logits stay sharded for the sharded sampler",
             "batch", 0, lambda rows, n: 0, lambda rows, n, r: range(rows), on_shards=True),
    Strategy("replicated", "DeepInfer, llama.cpp: every rank computes full rows, no collective",
             "batch", 0, lambda rows, n: 0, lambda rows, n, r: range(rows),
             local_rows=lambda rows, dp: _ceil(rows, dp), replicated_only=True),
)}


def strategy(name: str) -> Strategy:
    """The strategy called ``name`` (``ValueError`` listing the known ones)."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown strategy {name!r}; expected one of {sorted(STRATEGIES)}") from None


# ---------------------------------------------------------------------- embedding exchanges
EMBEDDING_EXCHANGES = ("all_reduce", "owner_gather", "local")


def exchange_bytes(mode: str, tokens: int, row_bytes: int, ranks: int, owned: int | None = None) -> float:
    """Bytes a rank receives to assemble ``tokens`` looked-up rows of ``row_bytes`` each, once per
    forward: ``all_reduce`` sums masked rows, ``2(n-1)/n·T·row``; ``owner_gather`` is one ring
    all-gather of the owners' blocks padded to the largest owner's count ``owned`` (default an
    even share, ``ceil(T/n)``), ``(n-1)·owned·row``; ``local`` (a replicated table) nothing."""
    if mode == "all_reduce":
        return all_reduce_bytes(tokens * row_bytes, ranks)
    if mode == "owner_gather":
        owned = _ceil(tokens, ranks) if owned is None else owned
        if not 0 <= owned <= tokens:
            raise ValueError(f"owned must be in [0, tokens={tokens}], got {owned}")
        return all_gather_bytes(owned * row_bytes, ranks)
    if mode == "local":
        return 0.0
    raise ValueError(f"unknown embedding exchange {mode!r}; expected one of {EMBEDDING_EXCHANGES}")
