"""The ways vocabulary data crosses ranks, stated once as data: the logits collection strategies
and the embedding exchanges.

Pure facts, no ``torch.distributed``: :mod:`vocabpar.collect` runs each strategy (its name ->
function table covers exactly :data:`STRATEGIES`), :mod:`vocabpar.plan` prices them, the
Hugging Face integration asks which rows each rank samples, and the demo compares what they
send with what ``vocabpar.comm`` measured. Adding a strategy means an entry here, its run
function and tests.

Sizes follow the byte model of :mod:`vocabpar.wire.traffic`: what the busiest rank receives to
collect logits, to gather DP hidden rows, to sample greedily on shards and to exchange
embeddings, and its peak logits memory, are stated here as its ring formulas, and the planner
only calls them. ``c`` is the widest shard (:attr:`vocabpar.layout.VocabLayout.shard_width`):
collected shards travel padded to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vocabpar.wire.records import agreement_words
from vocabpar.wire.traffic import WORD, all_gather_bytes, all_reduce_bytes


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


# ---------------------------------------------------------------------- sizes on the busiest rank
def collection_bytes(name: str, rows: int, shard: int, ranks: int, elem_bytes: int) -> int:
    """Bytes the busiest rank receives to collect ``[rows, shard]`` logits shards with strategy
    ``name``, per step: ``(n-1)·g·c·b`` with ``c`` the largest shard and ``g`` the strategy's
    gathered rows (``all_gather``, ``gather`` on the destination, ``dp_gather_scatter``: ``B``;
    ``all_to_all``: ``ceil(B/n)``; ``none``, ``replicated``: 0), i.e. a ring all-gather of
    ``[g, c]`` chunks. Sampled ids sent back are not counted."""
    return round(all_gather_bytes(strategy(name).gathered_rows(rows, ranks) * shard * elem_bytes, ranks))


def collection_peak_bytes(name: str, rows: int, shard: int, vocab: int, ranks: int, elem_bytes: int,
                          dp: int = 1) -> int:
    """Peak logits memory on the busiest rank: the local logits it computes (``[B, c]``; a
    replicated head ``[ceil(B/dp), V]``) plus what strategy ``name`` collects -- its gathered
    rows of every shard, ``[g, n·c]``, and full rows kept apart (``dp_gather_scatter``:
    ``[ceil(B/dp), V]``). One rank collects nothing."""
    s = strategy(name)
    collected = (s.gathered_rows(rows, ranks) * ranks * shard + s.kept_rows(rows, dp) * vocab) * elem_bytes
    return s.local_rows(rows, dp) * shard * elem_bytes + (collected if ranks > 1 else 0)


def hidden_gather_bytes(rows: int, dp: int, row_bytes: int, checked: bool = False) -> int:
    """DP attention feeding a sharded head (a strategy's ``"own"`` inputs): an all-gather of the
    row counts (so ranks may bring different numbers of rows; a 3-word record per DP rank, or the
    whole 32-word agreement record when the per-call checks are on), then of each DP group's
    ``ceil(B/dp)`` hidden rows of ``row_bytes``: ``(dp-1)·(8·w + ceil(B/dp)·row)``; zero when
    attention is tensor-parallel (``dp=1``)."""
    return round(all_gather_bytes(WORD * agreement_words(checked, 1), dp)
                 + all_gather_bytes(_ceil(rows, dp) * row_bytes, dp))


# ---------------------------------------------------------------------- embedding exchanges
EMBEDDING_EXCHANGES = ("all_reduce", "owner_gather", "local")
"""How an embedding lookup assembles its rows: ``all_reduce`` (masked rows summed),
``owner_gather`` (each owner's rows all-gathered), ``local`` (a replicated table or one rank:
nothing crosses). ``auto`` picks ``all_reduce`` or ``owner_gather`` per forward, whichever
moves fewer bytes."""
EXCHANGE_CHOICES = ("auto", "all_reduce", "owner_gather")
"""What a sharded embedding may be built with (``local`` follows from the layout)."""


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
