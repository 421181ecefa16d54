"""The only place where bytes cross ranks.

Thin wrappers over ``torch.distributed`` that (1) work unchanged on gloo (CPU) and NCCL (GPU),
(2) skip the collective entirely for a group of one rank, and (3) count the bytes each rank sends
and receives, per collective kind, so measured traffic can be compared with the planner.

Byte model (per rank, per call; ``n`` = group size, ``m`` = bytes of this rank's input):

=====================  ==========================================  =========================
kind                   sent                                        received
=====================  ==========================================  =========================
all_reduce (ring)      2(n-1)/n * m                                2(n-1)/n * m
all_gather (ring)      (n-1) * c                                   (n-1) * c
gather                 c if rank != dst else 0                     (n-1) * c on dst, else 0
broadcast (flat)       (n-1) * m on src, else 0                    m if rank != src else 0
all_to_all             bytes of input splits for other ranks       bytes of output splits
                                                                   from other ranks
=====================  ==========================================  =========================

``c`` is the per-rank chunk actually put on the wire: for uneven all-gathers the chunks are
padded to the largest one, so ``c`` is the largest chunk. A group of size 1 counts nothing.

A backend failure inside a collective (a peer died, timed out, or called a different
collective) is re-raised as :class:`CollectiveError` naming the collective, its bytes, the group
and this rank. :func:`agree` is the check every entry point that exchanges data runs first: the
ranks compare what must be replicated (shapes, parameters, fingerprints of inputs) in one small
all-gather, so a disagreement becomes the same ``ValueError`` on every rank instead of a
mismatched collective (an abort inside gloo, garbage or a hang under NCCL).
"""

from __future__ import annotations

import json
import os
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vocabpar import launch
from vocabpar.hashing import fingerprint
from vocabpar.wire.records import agreement, agreement_words
from vocabpar.wire.traffic import all_gather_bytes, all_reduce_bytes

ProcessGroup = dist.ProcessGroup | None

OVERHEAD = ("handshake", "agreement")
"""Counter labels of the safety exchanges (construction handshake, per-call agreement check),
kept apart from the traffic a design is priced on."""


class CollectiveError(RuntimeError):
    """A collective failed in the backend; the message names it, its size, the group and rank."""


@dataclass
class Counter:
    calls: int = 0
    sent: int = 0
    received: int = 0


# one output buffer, no per-rank list: ``all_gather_single`` (torch >= 2.13) or its older name
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_counters: dict[str, Counter] = defaultdict(Counter)
_booking: list[str] = []  # innermost ``booked_as`` label, overriding the collective's kind
_recordings: list[list[tuple[str, int]]] = []  # open ``recording`` blocks


@contextmanager
def booked_as(label: str) -> Iterator[None]:
    """Book every collective issued inside the block under ``label`` instead of its kind."""
    _booking.append(label)
    try:
        yield
    finally:
        _booking.pop()


@contextmanager
def recording() -> Iterator[list[tuple[str, int]]]:
    """Yield a list that receives ``(kind, bytes received)`` for every collective this process
    issues inside the block, in order (whatever label it is booked under)."""
    calls: list[tuple[str, int]] = []
    _recordings.append(calls)
    try:
        yield calls
    finally:
        _recordings.remove(calls)


def traffic() -> dict[str, Counter]:
    """A snapshot of this process's byte counters, by collective kind."""
    return {k: Counter(v.calls, v.sent, v.received) for k, v in _counters.items()}


def total_bytes(kinds: Sequence[str] | None = None) -> tuple[int, int]:
    """``(sent, received)`` summed over ``kinds`` (all kinds but the :data:`OVERHEAD` ones by
    default)."""
    selected = [v for k, v in _counters.items() if (k in kinds if kinds else k not in OVERHEAD)]
    return sum(c.sent for c in selected), sum(c.received for c in selected)


def reset_traffic() -> None:
    _counters.clear()


def _count(kind: str, sent: float, received: float) -> None:
    """Book a collective's bytes. Not while a caller's ``torch.compile`` traces the call: a counter
    read or written in the graph makes Dynamo guard on its value and compile again on every call
    (a compiled step's traffic is its script's, :mod:`vocabpar.wire.scripts`)."""
    if torch.compiler.is_compiling():
        return
    c = _counters[_booking[-1] if _booking else kind]
    c.calls += 1
    c.sent += round(sent)
    c.received += round(received)
    for calls in _recordings:
        calls.append((kind, round(received)))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def describe_group(group: ProcessGroup) -> str:
    if group is None or not dist.is_initialized() or same_group(group, None):
        return "the world group"
    return f"the group of global ranks {dist.get_process_group_ranks(group)}"


@contextmanager
def _named_failure(kind: str, nbytes: int, group: ProcessGroup) -> Iterator[None]:
    """Re-raise a backend error as :class:`CollectiveError` saying which collective failed."""
    try:
        yield
    except RuntimeError as e:  # gloo and NCCL errors (DistBackendError is a RuntimeError)
        raise CollectiveError(
            f"{kind} of {nbytes} bytes on {describe_group(group)} failed at rank {rank(group)} of "
            f"{world_size(group)}: a peer probably failed or called a different collective "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e


# ---------------------------------------------------------------------- group facts
def _group_up() -> bool:
    """Whether a process group exists. Under torchrun the first question sets the default group
    up (:func:`vocabpar.launch.init`), so a script never runs unsharded without noticing."""
    if dist.is_initialized():
        return True
    if launch.under_torchrun():
        launch.init()
        return True
    return False


def world_size(group: ProcessGroup = None) -> int:
    """Ranks in ``group`` (the world by default); 1 without a process group."""
    return dist.get_world_size(group) if _group_up() else 1


def rank(group: ProcessGroup = None) -> int:
    """This process's rank in ``group``; 0 without a process group."""
    return dist.get_rank(group) if _group_up() else 0


def same_group(a: ProcessGroup, b: ProcessGroup) -> bool:
    """Whether two group handles name the same group (``None`` is the world)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    return (world if a is None else a) is (world if b is None else b)


def global_rank(group: ProcessGroup, group_rank: int) -> int:
    """Global rank of ``group_rank`` within ``group`` (collectives take global src/dst)."""
    if group is None or not dist.is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def check_world(layout: object, group: ProcessGroup = None) -> None:
    """Raise ``ValueError`` unless ``group`` has as many ranks as ``layout`` (anything with a
    ``world_size``) was built for."""
    n = world_size(group)
    if layout.world_size != n:
        raise ValueError(f"layout is for {layout.world_size} ranks but {describe_group(group)} has {n} "
                         f"(rank {rank(group)}): build the layout with world_size={n}")


def device(group: ProcessGroup = None) -> torch.device:
    """Device for tensors the comm layer creates itself (CUDA under NCCL, else CPU)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------- collectives
def all_reduce(t: torch.Tensor, group: ProcessGroup = None) -> torch.Tensor:
    """Sum ``t`` over the group, in place; returns ``t``."""
    n = world_size(group)
    if n > 1:
        with _named_failure("all_reduce", _nbytes(t), group):
            dist.all_reduce(t, group=group)
        _count("all_reduce", all_reduce_bytes(_nbytes(t), n), all_reduce_bytes(_nbytes(t), n))
    return t


def as_words(t: torch.Tensor) -> torch.Tensor:
    """Bit-level view of a tensor (last dim contiguous) as rows of the widest integer type among
    int64, int32 and uint8 that tiles its last dim -- the types both gloo and NCCL can sum.
    Row gathers and exact sums work on these words."""
    row_bytes = t.shape[-1] * t.element_size() if t.dim() else t.element_size()
    for word in (torch.int64, torch.int32):
        if row_bytes % word.itemsize == 0:
            return t.view(torch.uint8).view(word) if t.dtype != word else t
    return t.view(torch.uint8)


def all_reduce_exact(t: torch.Tensor, group: ProcessGroup = None) -> torch.Tensor:
    """Sum ``t`` over the group by adding bit patterns as integers, in place: exact for any dtype
    (fp8 and -0.0 included) when at most one rank holds non-zero bytes in each element."""
    all_reduce(as_words(t), group)
    return t


def all_reduce_max(t: torch.Tensor, group: ProcessGroup = None) -> torch.Tensor:
    """Element-wise max of ``t`` over the group, in place."""
    n = world_size(group)
    if n > 1:
        with _named_failure("all_reduce (max)", _nbytes(t), group):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        _count("all_reduce", all_reduce_bytes(_nbytes(t), n), all_reduce_bytes(_nbytes(t), n))
    return t


def all_gather(t: torch.Tensor, group: ProcessGroup = None) -> torch.Tensor:
    """Stack every rank's equally shaped ``t`` along a new leading dim (rank order)."""
    n = world_size(group)
    if n == 1:
        return t.unsqueeze(0)
    out = torch.empty((n, *t.shape), dtype=t.dtype, device=t.device)
    flat = t.reshape(1, -1) if t.dim() == 0 else t.contiguous()
    with _named_failure("all_gather", _nbytes(t), group):
        _all_gather_into(out.view(n * flat.shape[0], *flat.shape[1:]), flat, group=group)
    _count("all_gather", all_gather_bytes(_nbytes(t), n), all_gather_bytes(_nbytes(t), n))
    return out


def all_gather_padded(t: torch.Tensor, sizes: Sequence[int] | None = None,
                      group: ProcessGroup = None) -> tuple[torch.Tensor, list[int]]:
    """Every rank's ``t`` (same trailing shape, dim 0 may differ) stacked as ``[n, max(sizes),
    ...]`` -- rank r's rows first in slot r, zeros after them -- and the sizes.

    ``sizes`` (dim 0 of every rank's tensor) saves a round trip when the caller knows them
    (e.g. from the layout); otherwise they are exchanged first. Chunks travel padded to the
    largest one."""
    n = world_size(group)
    if sizes is None:
        sizes = all_gather(torch.tensor([t.shape[0]], device=t.device), group).flatten().tolist()
    sizes = list(sizes)
    if len(sizes) != n or sizes[rank(group)] != t.shape[0]:
        raise ValueError(f"all_gather: sizes {sizes} do not match this rank's "
                         f"dim 0 = {t.shape[0]} at rank {rank(group)} of {n}")
    biggest = max(sizes)
    if t.shape[0] < biggest:
        padded = t.new_zeros((biggest, *t.shape[1:]))
        padded[: t.shape[0]] = t
        t = padded
    return all_gather(t, group), sizes


def all_gather_uneven(t: torch.Tensor, sizes: Sequence[int] | None = None,
                      group: ProcessGroup = None) -> list[torch.Tensor]:
    """Every rank's ``t`` as a list in rank order (see :func:`all_gather_padded`)."""
    stacked, sizes = all_gather_padded(t, sizes, group)
    return [stacked[r, :s] for r, s in enumerate(sizes)]


def gather(t: torch.Tensor, dst: int = 0, group: ProcessGroup = None) -> torch.Tensor | None:
    """Stack every rank's equally shaped ``t`` on group rank ``dst``; ``None`` elsewhere."""
    n, me = world_size(group), rank(group)
    if n == 1:
        return t.unsqueeze(0)
    t = t.contiguous()
    if me == dst:
        out = torch.empty((n, *t.shape), dtype=t.dtype, device=t.device)
        with _named_failure("gather", _nbytes(t), group):
            dist.gather(t, list(out.unbind(0)), dst=global_rank(group, dst), group=group)
        _count("gather", 0, all_gather_bytes(_nbytes(t), n))
        return out
    with _named_failure("gather", _nbytes(t), group):
        dist.gather(t, None, dst=global_rank(group, dst), group=group)
    _count("gather", _nbytes(t), 0)
    return None


def broadcast(t: torch.Tensor, src: int = 0, group: ProcessGroup = None) -> torch.Tensor:
    """Overwrite ``t`` on every rank with group rank ``src``'s ``t``; returns ``t``."""
    n = world_size(group)
    if n > 1:
        with _named_failure("broadcast", _nbytes(t), group):
            dist.broadcast(t, src=global_rank(group, src), group=group)
        me = rank(group)
        _count("broadcast", (n - 1) * _nbytes(t) if me == src else 0, 0 if me == src else _nbytes(t))
    return t


def all_to_all(t: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int],
               group: ProcessGroup = None) -> torch.Tensor:
    """Send ``t[sum(in_splits[:r]) : ...+in_splits[r]]`` to rank r; receive rank r's block
    into rows ``sum(out_splits[:r]) : ...``. Splits are along dim 0."""
    n, me = world_size(group), rank(group)
    in_splits, out_splits = list(in_splits), list(out_splits)
    if len(in_splits) != n or len(out_splits) != n or sum(in_splits) != t.shape[0]:
        raise ValueError(f"all_to_all: splits {in_splits}/{out_splits} do not fit dim 0 = "
                         f"{t.shape[0]} over {n} ranks (rank {me})")
    if n == 1:
        return t
    out = torch.empty((sum(out_splits), *t.shape[1:]), dtype=t.dtype, device=t.device)
    with _named_failure("all_to_all", _nbytes(t), group):
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
    row = _nbytes(t[:1]) if t.shape[0] else _nbytes(out[:1])
    _count("all_to_all", row * (sum(in_splits) - in_splits[me]),
           row * (sum(out_splits) - out_splits[me]))
    return out


# ---------------------------------------------------------------------- consistency handshake
class ConsistencyError(ValueError):
    """Ranks of one group were built with different facts (layout, dtype, sizes, ...)."""


def verify_consistent(group: ProcessGroup = None, **facts: object) -> None:
    """Exchange ``facts`` (JSON-able values) over the group; if any field differs, every rank
    raises the same :class:`ConsistencyError` naming the field and which ranks hold what."""
    n = world_size(group)
    if n == 1:
        return
    blob = json.dumps(facts, sort_keys=True, default=str).encode()
    payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device(group))
    with booked_as("handshake"):  # kept apart so it never pollutes per-step counters
        chunks = all_gather_uneven(payload, group=group)
    seen = [json.loads(bytes(c.cpu().tolist()).decode()) for c in chunks]
    problems = []
    for key in sorted(set().union(*seen)):
        by_value: dict[str, list[int]] = defaultdict(list)
        for r, f in enumerate(seen):
            by_value[json.dumps(f.get(key, "<missing>"), sort_keys=True)].append(r)
        if len(by_value) > 1:
            parts = "; ".join(f"rank {','.join(map(str, rs))} has {v}" for v, rs in by_value.items())
            problems.append(f"{key}: {parts}")
    if problems:
        raise ConsistencyError("ranks disagree on " + " | ".join(problems))


# ---------------------------------------------------------------------- per-call agreement
CHECK_ENV = "VOCABPAR_CHECK"

Fact = int | str | torch.Tensor
"""An int or str compared as is; a tensor compared by :func:`vocabpar.hashing.fingerprint`."""

_PARTS = "_vocabpar_parts"


def with_parts(t: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """Mark tensor fact ``t`` as ``len(names)`` equal consecutive parts so named: it is still
    compared as one fingerprint, and when it differs every rank fingerprints the parts in one
    more small all-gather (on the error path only) and the message names those that differ."""
    setattr(t, _PARTS, tuple(names))
    return t


def checks_enabled(check: bool | None = None) -> bool:
    """``check`` if given, else the ``VOCABPAR_CHECK`` environment variable (on unless ``0``).
    It must be the same on every rank."""
    return os.environ.get(CHECK_ENV, "1") != "0" if check is None else bool(check)


def agree(where: str, group: ProcessGroup, collect: Callable[[], Mapping[str, Fact]], *,
          check: bool | None = None, vary: Sequence[str] = ()) -> dict[str, list[int]]:
    """Validate this rank's input and check that every rank holds the same facts.

    ``collect()`` validates the local input (raising ``ValueError``/``TypeError``) and returns the
    facts that must be replicated, by name: a count named by a plain plural ("rows": 4), a
    setting ("chunk_rows": 8, "strategy": "gather") or a tensor ("hidden": its fingerprint).
    One all-gather of ``AGREE_WIDTH`` int64 per rank (booked as ``"agreement"``; a tensor fact
    costs one local pass to fingerprint) then makes every rank raise the same ``ValueError`` --
    naming the facts that differ and which rank holds what, or the ranks whose input was
    invalid -- before the caller issues a collective whose sizes could disagree. Facts named in
    ``vary`` may differ: their values on every rank are returned; the exchange then always
    happens (with checks off it carries only them) and, being traffic the caller needs anyway,
    is booked as an ``"all_gather"``. With checks off (:func:`checks_enabled`) and nothing in
    ``vary`` nothing is sent."""
    try:
        facts, problem = dict(collect()), None
    except (ValueError, TypeError) as e:
        facts, problem = {}, e
    checking = checks_enabled(check) and world_size(group) > 1
    if not checking and not vary:
        if problem is not None:
            raise problem
        return {}
    names = [k for k in facts if checking or k in vary]
    width = agreement_words(checking, len(vary))
    if len(names) > width - 2:
        raise ValueError(f"{where}: at most {width - 2} facts can be compared, got {len(names)}")
    record = agreement(width - 2)
    words = [_fact_word(facts[k]) for k in names] + [torch.tensor(0)] * (width - 2 - len(names))
    message = record.pack(valid=torch.tensor([int(problem is None)]), count=torch.tensor([len(names)]),
                          facts=torch.stack(words)[None])
    with booked_as("all_gather" if vary else "agreement"):
        table = record.unpack(all_gather(message.to(device(group)), group)[:, 0].cpu())  # one host sync
    if problem is not None:
        raise problem
    invalid = [r for r, valid in enumerate(table.valid.tolist()) if not valid]
    if invalid:
        raise ValueError(f"{where}: rank(s) {invalid} rejected their input (see their error); "
                         f"rank {rank(group)} stops too")
    counts = table.count.tolist()
    if len(set(counts)) > 1:
        raise ConsistencyError(f"{where}: ranks compare different facts ({counts}); "
                               f"is {CHECK_ENV} the same on every rank?")
    column = {k: table.facts[:, i].tolist() for i, k in enumerate(names)}
    problems = [_disagreement(k, facts[k], column[k]) + _differing_parts(facts[k], group)
                for k in names if k not in vary and len(set(column[k])) > 1]
    if problems:
        raise ConsistencyError(f"{where}: ranks disagree on what must be the same everywhere: "
                         + "; ".join(problems))
    return {k: column[k] for k in vary}


def _differing_parts(value: Fact, group: ProcessGroup) -> str:
    """For a fact marked by :func:`with_parts`: ": a, b differ", the parts whose content is not
    the same on every rank (every rank calls this for the same facts, so the exchange matches)."""
    names = getattr(value, _PARTS, None)
    if not names:
        return ""
    flat = value.detach().reshape(-1)
    parts = flat.reshape(len(names), -1) if flat.numel() % len(names) == 0 else flat.new_zeros(len(names), 0)
    words = torch.stack([fingerprint(p) for p in parts]).to(device(group))
    with booked_as("agreement"):
        seen = all_gather(words, group).cpu()
    differ = [n for i, n in enumerate(names) if len(set(seen[:, i].tolist())) > 1]
    return f": {', '.join(differ)} differ" if differ else ""


def _fact_word(value: Fact) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return fingerprint(value)
    if isinstance(value, str):
        return torch.tensor(zlib.crc32(value.encode()))
    return torch.tensor(int(value))


def _disagreement(name: str, mine: Fact, values: list[int]) -> str:
    """"rank 0 has 4 rows, ranks 1, 2 have 5 rows" (values by rank); a tensor's or a string's
    words are hashes, so only the grouping of ranks is shown (with this rank's string)."""
    by_value: dict[int, list[int]] = defaultdict(list)
    for r, v in enumerate(values):
        by_value[v].append(r)

    def who(ranks: list[int]) -> str:
        return f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} have"
    if isinstance(mine, torch.Tensor):
        groups = " and ".join("{" + ", ".join(map(str, rs)) + "}" for rs in by_value.values())
        return f"the content of {name} differs between ranks {groups}"
    if isinstance(mine, str):
        mine_word = zlib.crc32(mine.encode())
        return f"{name}: " + ", ".join(f"{who(rs)} {mine!r}" if v == mine_word else f"{who(rs)} another value"
                                       for v, rs in by_value.items())
    plural = name.endswith("s") and "_" not in name  # a count reads "4 rows", a setting "chunk_rows=8"
    return ", ".join(f"{who(rs)} {v} {name}" if plural else f"{who(rs)} {name}={v}"
                     for v, rs in by_value.items())
