"""One named record per message that crosses ranks: its fields, its size, how it is packed.

A record is a row of int64 words per batch row (float64 values travel as their bit patterns, so
sums and gathers are exact on gloo and NCCL alike). The sender builds its message with
:meth:`Record.pack`, the receiver reads the gathered ``[n, rows, words]`` tensor with
:meth:`Record.unpack`, and the planner prices :meth:`Record.nbytes` -- one definition for all
three. Sizes that depend on a setting (candidates per rank, top-n, whether a settle also draws)
are records built by a small function of that setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from vocabpar.wire.filters import BY_NAME
from vocabpar.wire.traffic import WORD


@dataclass(frozen=True)
class Field:
    """A field named ``name``: one word (``width`` None) or a vector of ``width`` words;
    ``real``: float64 values (as bit patterns)."""

    name: str
    width: int | None = None
    real: bool = False

    @property
    def words(self) -> int:
        return 1 if self.width is None else self.width


class Unpacked:
    """A record's fields by name, as :meth:`Record.unpack` returns them: a plain class, so that a
    caller's ``torch.compile(fullgraph=True)`` traces it (Dynamo cannot build a
    ``types.SimpleNamespace``)."""

    def __init__(self, **fields: torch.Tensor) -> None:
        self.__dict__.update(fields)


@dataclass(frozen=True)
class Record:
    """A message of :meth:`words` int64 words per row: ``fields`` one after the other."""

    name: str
    fields: tuple[Field, ...]

    def words(self) -> int:
        return sum(f.words for f in self.fields)

    def nbytes(self, rows: int) -> int:
        """Bytes of ``rows`` rows of this record on one rank."""
        return rows * self.words() * WORD

    def pack(self, **parts: torch.Tensor) -> torch.Tensor:
        """int64 ``[rows, words]``: each field from ``parts[name]`` (``[rows]`` for a one-word
        field, ``[rows, width]`` for a vector; float values for a real field, int64 otherwise)."""
        if set(parts) != {f.name for f in self.fields}:
            raise ValueError(f"{self.name} record takes {[f.name for f in self.fields]}, got {sorted(parts)}")
        columns = []
        for f in self.fields:
            part = parts[f.name]
            part = part.double().view(torch.long) if f.real else part.long()
            columns.append(part.reshape(part.shape[0], f.words))
        return torch.cat(columns, 1)

    def unpack(self, words: torch.Tensor) -> Unpacked:
        """The fields of ``words`` (``[..., words]``) by name: ``[...]`` for a one-word field,
        ``[..., width]`` for a vector; float64 for a real field, int64 otherwise."""
        if words.shape[-1] != self.words():
            raise ValueError(f"{self.name} record has {self.words()} words, got {words.shape[-1]}")
        out, start = {}, 0
        for f in self.fields:
            part = words[..., start: start + f.words]
            part = part.view(torch.float64) if f.real else part  # the same strides: no copy
            out[f.name] = part[..., 0] if f.width is None else part
            start += f.words
        return Unpacked(**out)


def _real(name: str, width: int | None = None) -> Field:
    return Field(name, width, real=True)


# ---------------------------------------------------------------------- agreement
AGREE_WIDTH = 32
"""int64 words per rank of a checked agreement exchange: valid flag, fact count, 30 facts."""


@cache
def agreement(facts: int) -> Record:
    """Each rank's agreement record: whether its input was valid, how many facts it compares,
    and one word per fact (an int, a string's CRC or a tensor's fingerprint)."""
    return Record("agreement", (Field("valid"), Field("count"), Field("facts", facts)))


INPUT_WORDS = 9
"""Words describing a rejected input tensor in an engine check: its dtype's code, whether it is
on the call's device, its number of dimensions, its first three sizes and the three sizes
expected (-1: no such dimension)."""


@cache
def check(facts: int, rows: int) -> Record:
    """The check an engine call folds into its first message: this rank's ``problem`` with its
    input (0: none; else a code the caller names, at ``row``) and, for a rejected tensor, what
    it was (``input``, :data:`INPUT_WORDS`); one word per fact that every rank must share; one
    fingerprint per batch row (of ``rows``) of that row's replicated inputs, which locates the
    first row where ranks differ."""
    return Record("check", (Field("problem"), Field("row"), Field("input", INPUT_WORDS),
                            Field("facts", facts), Field("row_facts", rows)))


@cache
def folded(record: Record, rows: int, facts: int) -> Record:
    """One message of a fixed ``rows`` rows of ``record`` followed by a :func:`check` of
    ``facts`` facts over those rows: an engine call's first collective carries its agreement
    check."""
    return Record(f"{record.name} + check", (Field("rows", rows * record.words()),
                                             *check(facts, rows).fields))


def agreement_words(checked: bool, varying: int) -> int:
    """int64 words per rank of one agreement exchange: the full record when the checks are on,
    else only the header and the ``varying`` per-rank values the caller needs (e.g. DP row
    counts); 0 when nothing needs sending."""
    if checked:
        return AGREE_WIDTH
    return agreement(varying).words() if varying else 0


# ---------------------------------------------------------------------- the sampler
SEARCH_BITS = 11
"""Key bits one histogram round of a threshold search resolves."""
SETTLE_BITS = 10
"""A bucket of at most ``2**SETTLE_BITS`` keys is settled by gathering its tokens."""
SETTLE_TOKENS = 16
"""Tokens of the final bucket each rank sends per row when settling a threshold search."""


@cache
def round_one(candidates: int, ties: bool = False, masks: tuple[str, ...] = ()) -> Record:
    """The sampler's first message per row: the shard's max (NaN when the row holds a NaN) and
    the lowest id holding it, then its top ``candidates`` values (descending) and ids (-1: none);
    with ``ties`` (the engine's), how many of the shard's tokens equal the last candidate's
    value, so the tied group a cut splits is counted exactly; then, per mask filter in
    ``masks``, the exact sums of the shard's logits its floor needs (the filter's ``words``)."""
    fields = (_real("max"), Field("max_id"), _real("values", candidates), Field("ids", candidates))
    sums = tuple(Field(name, BY_NAME[name].words) for name in masks)
    return Record("round one", fields + (Field("ties"),) * ties + sums)


@cache
def histogram(bits: int) -> Record:
    """A threshold search round, summed over ranks: per row the weight of each of the bucket's
    ``2**bits`` digits, then the weight above the bucket."""
    return Record("histogram", (Field("digits", 2**bits), Field("above")))


HISTOGRAM = histogram(SEARCH_BITS)
"""The adaptive search's round."""

TOTAL = Record("total", (Field("mass"),))
"""A top-p row's pool mass on this shard (integer units), summed over ranks."""


@cache
def settle(draw: bool) -> Record:
    """The settling all-gather of a threshold search, per row: how many of the final bucket's
    tokens this rank holds, the ``SETTLE_TOKENS`` largest keys with their weights and -- to draw
    -- their ids and Gumbel scores, then this rank's best (score, id) above the bucket."""
    fields = (Field("count"), Field("keys", SETTLE_TOKENS), Field("weights", SETTLE_TOKENS))
    if draw:
        fields += (Field("ids", SETTLE_TOKENS), _real("scores", SETTLE_TOKENS), _real("best"),
                   Field("best_id"))
    return Record("settle and draw" if draw else "settle", fields)


DRAW = Record("draw", (_real("score"), Field("id")))
"""A rank's best (score, id) among the row's kept tokens: the draw's all-gather, and the
speculative correction's."""


# ---------------------------------------------------------------------- verification
MASSES = Record("masses", (Field("target_total"), Field("target_token"), Field("draft_total"),
                           Field("draft_token")))
"""Per verified (row, draft position), summed over ranks: the target's and the draft's kept
mass and each one's mass of the draft token (integer units)."""


# ---------------------------------------------------------------------- scoring
@cache
def score(top_n: int) -> Record:
    """Per scored row: the shard's max (NaN when it holds NaN or +inf), ``sum(exp(x - max))``,
    the scored token's logit where this rank owns it (-inf elsewhere), and the shard's top-n
    values and ids (descending, lowest id first on ties)."""
    return Record("score", (_real("max"), _real("sum_exp"), _real("chosen"), _real("values", top_n),
                            Field("ids", top_n)))


LARGER = Record("larger", (Field("count"),))
"""Per scored row, summed over ranks: tokens with a strictly larger logit than the scored one."""
