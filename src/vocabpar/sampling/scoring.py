"""Log-probabilities of given tokens on vocab-sharded logits, without a ``[T, V]`` row anywhere.

A log-softmax over shards is a merge of per-shard (max, sum-exp) pairs; the scored token's logit
lives on its owner; its rank needs one count per shard; the top-n merge per-shard candidates.
Two collectives per call, whatever V:

1. all-gather of :func:`vocabpar.wire.records.score`, per row: the shard's max (NaN when the
   row holds NaN or +inf), its ``sum(exp(x - max))`` (float64), the scored token's logit where
   this rank owns it (-inf elsewhere), and the shard's top-n (value, id) in descending order,
   lowest id first on ties;
2. all-reduce of :data:`vocabpar.wire.records.LARGER`, one int64 per row: how many of the
   shard's tokens have a strictly larger logit than the scored one.

Eager, rows are processed locally in blocks of ``ROW_BLOCK`` so the float64 temporaries stay
small; compiled, in one block (the program may not depend on the row count): an engine's
``max_rows`` then bounds the temporaries, ``[max_rows, columns]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vocabpar import comm
from vocabpar.kernels.fused import rank_keys
from vocabpar.layout import VocabLayout
from vocabpar.sampling.failures import EngineResult, Failures, Packed
from vocabpar.sampling.merged import side_by_side
from vocabpar.sampling.semantics import NEG_INF, rank_key
from vocabpar.wire.records import LARGER, Unpacked, score
from vocabpar.wire.scripts import Script

ROW_BLOCK = 16  # rows per local block: float64 temporaries of 16 x V/n stay small (~4 MB at V/n = 32k)


@dataclass(frozen=True)
class TokenLogprobs(EngineResult):
    """Per scored row: ``logprobs`` (float32 ``[T]``, log-softmax of the full row at the token),
    ``ranks`` (int64 ``[T]``, 1 + number of tokens with a strictly larger logit), ``top_ids``
    (int64 ``[T, top_n]``, descending, lowest id first on ties) and ``top_logprobs``
    (float32 ``[T, top_n]``). Identical on every rank. A row holding NaN or +inf logits gets
    NaN logprobs, as ``torch.log_softmax`` gives. ``script``: the collectives an engine call made,
    in order (:func:`vocabpar.wire.scripts.price` gives their bytes; empty otherwise).
    ``failures``: an engine call's flags; ``packed``: the int64 device tensor holding an engine
    call's results and flags (its ids are views of it; :meth:`to_host` copies it once)."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    script: Script = ()
    failures: Failures | None = None
    packed: Packed | None = field(default=None, repr=False, compare=False)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TokenLogprobs:
        """The same fields with ``fn`` applied to each (indexing, reshaping: dim 0 is the row), from
        the same collectives (``script``)."""
        return TokenLogprobs(*(fn(getattr(self, name)) for name in _TENSORS), script=self.script)

    @staticmethod
    def concat(parts: Sequence[TokenLogprobs]) -> TokenLogprobs:
        """Rows of ``parts`` one after the other (at least one part), from the collectives of every
        part in order (``script``)."""
        return TokenLogprobs(*(torch.cat([getattr(p, name) for p in parts]) for name in _TENSORS),
                             script=sum((p.script for p in parts), ()))


_TENSORS = ("logprobs", "ranks", "top_ids", "top_logprobs")


def token_logprobs(local_logits: torch.Tensor, layout: VocabLayout, token_ids: torch.Tensor, *,
                   top_n: int = 0, group: comm.ProcessGroup = None,
                   check: bool | None = None) -> TokenLogprobs:
    """Score ``token_ids`` (int64 ``[T]``, the same on every rank) under this rank's FP32 raw
    logits ``[T, rows]`` (storage order of ``layout``'s shard; padding columns ignored). Equals
    ``torch.log_softmax`` of the full rows to float64 rounding; ranks and top ids exactly; rows
    holding NaN or +inf get NaN logprobs (``log_softmax``'s answer). Bad input and disagreeing
    ranks raise ``ValueError`` on every rank."""
    replicated = layout.scheme == "replicated"
    me = 0 if replicated else comm.rank(group)
    n = 1 if replicated else comm.world_size(group)

    def facts() -> dict[str, comm.Fact]:
        if not replicated:
            comm.check_world(layout, group)
        width = layout.shard(me).rows
        if not isinstance(local_logits, torch.Tensor) or local_logits.dtype != torch.float32 \
                or local_logits.dim() != 2 or local_logits.shape[1] != width:
            raise ValueError(f"local logits must be float32 [T, {width}] on rank {me}, got "
                             f"{getattr(local_logits, 'dtype', type(local_logits).__name__)}"
                             f"{tuple(getattr(local_logits, 'shape', ()))}")
        T = local_logits.shape[0]
        if not isinstance(token_ids, torch.Tensor) or token_ids.dtype != torch.long \
                or token_ids.shape != (T,):
            raise ValueError(f"token_ids must be int64 [{T}] (one per logits row), got "
                             f"{getattr(token_ids, 'dtype', type(token_ids).__name__)}"
                             f"{tuple(getattr(token_ids, 'shape', ()))}")
        bad = ((token_ids < 0) | (token_ids >= layout.vocab_size)).nonzero().flatten()
        if bad.numel():
            raise ValueError(f"row {bad[0].item()}: token id {token_ids[bad[0]].item()} is outside "
                             f"[0, {layout.vocab_size})")
        if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= layout.vocab_size:
            raise ValueError(f"top_n must be an int in [0, vocab_size={layout.vocab_size}], got {top_n!r}")
        return {**layout.describe(), "rows": T, "top_n": top_n, "token ids": token_ids}

    if n == 1:
        facts()
    else:
        comm.agree("token_logprobs", group, facts, check=check)
    ids = layout.local_token_ids(me).to(local_logits.device)
    stats = local_scores(local_logits, ids, layout, me, token_ids, top_n)
    got = score(top_n).unpack(stats.unsqueeze(0) if n == 1 else comm.all_gather(stats, group))
    return merged_scores(local_logits, ids, got, lambda t: t if n == 1 else comm.all_reduce(t, group))


def local_scores(logits: torch.Tensor, ids: torch.Tensor, layout: VocabLayout, me: int,
                 token_ids: torch.Tensor, top_n: int) -> torch.Tensor:
    """This shard's :func:`~vocabpar.wire.records.score` record ``[T, words]`` for scoring
    ``token_ids`` ``[T]`` under ``logits`` ``[T, columns]`` (rank ``me``'s storage order)."""
    col, owned = layout.local_ids(token_ids, me)
    return _local_stats(logits, ids, col.to(logits.device), owned.to(logits.device), top_n)


def merged_scores(logits: torch.Tensor, ids: torch.Tensor, got: Unpacked,
                  sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> TokenLogprobs:
    """The scores from every rank's gathered record (``got``: fields ``[n, T, ...]``): the
    log-softmax ``(x - M) - log(S)`` merged in rank order (the same bits on every rank; NaN for
    rows holding NaN or +inf), then one ``sum_over_ranks`` of :data:`LARGER` for the ranks. No
    host read."""
    n, T, top_n = got.values.shape
    shard_max, shard_sum, chosen = got.max, got.sum_exp, got.chosen.max(0).values
    M = shard_max.max(0).values
    S = torch.zeros_like(M)
    for r in range(n):  # fixed rank order: the same sum on every rank
        S = S + torch.where(shard_max[r] == NEG_INF, 0.0, shard_sum[r] * torch.exp(shard_max[r] - M))
    log_s = torch.log(S)
    larger = LARGER.unpack(sum_over_ranks(LARGER.pack(count=_count_larger(logits, ids, chosen)))).count
    vals, cand = side_by_side(got.values), side_by_side(got.ids)  # ranks x candidates (T may be 0)
    top = rank_key(vals.float(), cand).topk(top_n, 1).indices
    return TokenLogprobs(((chosen - M) - log_s).float(), larger + 1, cand.gather(1, top),
                         ((vals.gather(1, top) - M[:, None]) - log_s[:, None]).float())


def _local_stats(logits: torch.Tensor, ids: torch.Tensor, col: torch.Tensor, owned: torch.Tensor,
                 top_n: int) -> torch.Tensor:
    """This shard's :func:`~vocabpar.wire.records.score` record per row: max (NaN if a NaN or
    +inf is present), sum of exp(x - max), the owned scored logit (else -inf), top-n values then
    their ids (-1 = none). ``logits``: ``[T, columns]``; ``ids``: ``[columns]``; ``col``,
    ``owned``: ``[T]``."""
    real = ids >= 0
    blocks = [_block_stats(torch.where(real, logits[rows], NEG_INF), ids, col[rows], owned[rows], top_n)
              for rows in _blocks(logits.shape[0])]
    return torch.cat(blocks)


def _block_stats(x: torch.Tensor, ids: torch.Tensor, col: torch.Tensor, owned: torch.Tensor,
                 top_n: int) -> torch.Tensor:
    """:func:`_local_stats` of one block of rows, ``x`` ``[rows, columns]`` with -inf at padding."""
    rows, R = x.shape
    f64, device = torch.float64, x.device
    invalid = (x.isnan() | (x == float("inf"))).any(1)
    top = x.max(1).values.double() if R else torch.full((rows,), NEG_INF, dtype=f64, device=device)
    total = torch.exp(x.double() - top[:, None]).nan_to_num(0.0).sum(1)  # -inf rows: 0
    chosen = torch.full((rows,), NEG_INF, dtype=f64, device=device)
    if R:
        chosen = torch.where(owned, x.gather(1, col.clamp(max=R - 1)[:, None])[:, 0].double(), NEG_INF)
    m = min(top_n, R)
    best = rank_keys(x, ids).topk(m, 1).indices if m else x.new_zeros((rows, 0), dtype=torch.long)
    short = (rows, top_n - m)  # fewer columns than top_n: -inf values, id -1
    values = torch.cat([x.gather(1, best).double(), torch.full(short, NEG_INF, dtype=f64, device=device)], 1)
    top_ids = torch.cat([ids[best], torch.full(short, -1, dtype=torch.long, device=device)], 1)
    return score(top_n).pack(max=torch.where(invalid, float("nan"), top), sum_exp=total, chosen=chosen,
                             values=values, ids=top_ids)


def _count_larger(logits: torch.Tensor, ids: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Per row, how many of this shard's tokens have a logit strictly larger than ``chosen``."""
    real = ids >= 0
    return torch.cat([((logits[rows].double() > chosen[rows, None]) & real).sum(1)
                      for rows in _blocks(logits.shape[0])])


def _blocks(T: int) -> list[slice]:
    """The row blocks of a ``T``-row pass: ``ROW_BLOCK`` rows each, or one block when compiled
    (Inductor fuses the float64 temporaries into the reductions, and a program must not depend
    on the number of rows) or when ``T <= ROW_BLOCK`` (``T = 0`` included)."""
    if torch.compiler.is_compiling() or T <= ROW_BLOCK:
        return [slice(None)]
    return [slice(start, min(start + ROW_BLOCK, T)) for start in range(0, T, ROW_BLOCK)]
