"""The steps both samplers share, so that the reference and the sharded path cannot drift apart.

Conventions: ``x`` are processed float32 logits (penalties and bitmask applied, padding -inf);
``z = x.double() / temperature``. For temperatures in
``[GREEDY_BELOW, MAX_TEMPERATURE]`` the division is strictly monotone and maps equal values to
equal values, so thresholds on ``x`` and on ``z`` select the same tokens.

Top-p masses are exact integers: token weight ``q = floor(exp(z - zmax) * 2**s)`` with
``s = 62 - bit_length(vocab_size)``, so any sum over the vocabulary fits in int64 and no result
depends on summation order (each rank sums its part, an integer all-reduce merges them).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vocabpar import exactmath
from vocabpar.sampling.failures import EngineResult, Failures, Packed
from vocabpar.sampling.noise import gumbel, row_keys, uniform
from vocabpar.sampling.params import Rows, TokenCounts
from vocabpar.wire.filters import Z_FLOORS
from vocabpar.wire.scripts import Script

NEG_INF = float("-inf")
PAD_KEY = -(2**31)  # below the key of -inf: padding sorts after every real token


@dataclass(frozen=True)
class SampleOutput(EngineResult):
    """``tokens`` (int64 ``[B]``), identical on every rank. With ``logprobs`` asked: the chosen
    token's log-probability (``logprobs``, float32 ``[B]``) and rank (``ranks``, int64 ``[B]``,
    1 + tokens with a strictly larger logit), and the top-n ids / logprobs (``[B, n]``, n the
    largest count asked, sorted by value, ties by lowest id), from the log-softmax of the raw or
    processed logits (``logprobs_of``). Rows that asked fewer have id -1 and logprob NaN past their
    count; rows that asked none have NaN / rank -1 too. ``script``: the collectives the call made,
    in order (:func:`vocabpar.wire.scripts.price` gives their bytes; empty from the reference).
    ``failures``: an engine call's flags (:meth:`raise_if_failed`); ``packed``: the one int64
    device tensor an engine call wrote its ids and flags into (``tokens`` is a view of it;
    :meth:`to_host` copies it once)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    script: Script = ()
    failures: Failures | None = None
    packed: Packed | None = field(default=None, repr=False, compare=False)

    @property
    def logprob(self) -> torch.Tensor | None:
        """Deprecated name of :attr:`logprobs`."""
        warnings.warn("SampleOutput.logprob is deprecated: use SampleOutput.logprobs", DeprecationWarning,
                      stacklevel=2)
        return self.logprobs

    @property
    def rank(self) -> torch.Tensor | None:
        """Deprecated name of :attr:`ranks`."""
        warnings.warn("SampleOutput.rank is deprecated: use SampleOutput.ranks", DeprecationWarning,
                      stacklevel=2)
        return self.ranks

    def top(self, row: int) -> list[tuple[int, float]]:
        """Row ``row``'s top list as (id, logprob) pairs, as long as the row asked."""
        pairs = zip(self.top_ids[row].tolist(), self.top_logprobs[row].tolist())
        return [(i, lp) for i, lp in pairs if i >= 0]


@dataclass(frozen=True)
class VerifyOutput(EngineResult):
    """``accepted`` (int64 ``[B]``, 0..k): how many leading drafts each row kept; ``tokens`` (int64
    ``[B, k+1]``): those drafts, then the correction or the bonus token, then -1. ``script``:
    the collectives the call made, in order (empty from the reference). ``failures``: an engine
    call's flags; ``packed``: the int64 device tensor holding an engine call's ids and flags
    (``accepted`` and ``tokens`` are views of it; :meth:`to_host` copies it once)."""

    accepted: torch.Tensor
    tokens: torch.Tensor
    script: Script = ()
    failures: Failures | None = None
    packed: Packed | None = field(default=None, repr=False, compare=False)

    def emitted(self, row: int) -> list[int]:
        """The tokens row ``row`` emits this step (``accepted + 1`` of them)."""
        return self.tokens[row, : int(self.accepted[row]) + 1].tolist()


def with_logprobs(tokens: torch.Tensor, counts: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor,
                  top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> SampleOutput:
    """The :class:`SampleOutput` of full-width logprob results, each row cut to its ``counts``
    (int64 ``[B]``, -1 = none)."""
    wanted = counts >= 0
    past = torch.arange(top_ids.shape[1], device=counts.device) >= counts[:, None]
    return SampleOutput(tokens, torch.where(wanted, logprobs, float("nan")), top_ids.masked_fill(past, -1),
                        top_logprobs.masked_fill(past, float("nan")), torch.where(wanted, ranks, -1))


def drawn_logits(x: torch.Tensor, t: torch.Tensor, keep: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """The float32 logits each row was drawn from (``logprobs_of="processed"``): for sampled rows
    ``x / t`` on the kept tokens and -inf elsewhere, for the others ``x`` itself (penalties and
    bitmask applied). ``t``, ``sampled``: ``[B]``; ``keep``: ``[B, columns]``."""
    z = (x.double() / t[:, None]).float()
    return torch.where(sampled[:, None], torch.where(keep, z, NEG_INF), x)


# ---------------------------------------------------------------------- logits processing
def penalise(x: torch.Tensor, cols: torch.Tensor, owned: torch.Tensor, counts: TokenCounts,
             rows: Rows) -> torch.Tensor:
    """Apply, to ``x[b, cols[b, k]]`` where ``owned[b, k]``: repetition (divide positive, multiply
    negative logits) to tokens in the prompt or generated, as HF and vLLM; then frequency and
    presence penalties from the generated counts only, as vLLM and OpenAI. ``x``: ``[B, R]``;
    ``cols``, ``owned``: ``[B, K]``. No host read."""
    n = counts.counts
    generated = n > 0
    seen = generated if counts.in_prompt is None else generated | counts.in_prompt
    rep = rows.repetition_penalty[:, None]

    def penalised(v: torch.Tensor) -> torch.Tensor:
        v = torch.where(seen, torch.where(v > 0, v / rep, v * rep), v)
        v = v - rows.frequency_penalty[:, None] * n.float()
        return v - rows.presence_penalty[:, None] * generated.float()

    return _listed(x, cols, owned, penalised)


def _listed(x: torch.Tensor, cols: torch.Tensor, owned: torch.Tensor,
            change: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``x`` ``[B, R]`` with ``x[b, cols[b, k]]`` replaced by ``change`` of those values where
    ``owned[b, k]`` (a row's listed columns are distinct). No host read: the slots this rank does
    not own write into a spare column."""
    B, R = x.shape
    if not R:
        return x
    v = change(x.gather(1, cols))
    out = torch.cat([x, x.new_zeros(B, 1)], 1)
    out.scatter_(1, torch.where(owned, cols, R), torch.where(owned, v, 0.0))
    return out[:, :R]


def allowed(bitmask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, len(ids)]``: bit ``id & 31`` of word ``id >> 5`` (xgrammar format); padding
    ids (-1) are never allowed."""
    safe = ids.clamp(min=0)
    words = bitmask[:, safe >> 5]
    return ((words >> (safe & 31)) & 1).bool() & (ids >= 0)


Columns = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""Maps global token ids ``[B, K]`` to this rank's ``(columns, owned)`` (as
:meth:`~vocabpar.layout.VocabLayout.local_ids`)."""


def processed_logits(raw: torch.Tensor, ids: torch.Tensor, rows: Rows, columns: Columns,
                     token_counts: TokenCounts | None, bitmask: torch.Tensor | None,
                     padded: bool | None = None) -> torch.Tensor:
    """``x``, in vLLM's order: padding -> -inf, the rows' ``logit_bias``, penalties, then every id a
    row may not sample (its ``allowed_token_ids`` and ``min_tokens`` exclusions, the grammar's
    ``bitmask``) -> -inf. Returns ``raw`` itself when there is nothing to change. ``padded``:
    whether ``ids`` hold padding (``None``: read it from ``ids``, one host read)."""
    padded = not bool((ids >= 0).all()) if padded is None else padded
    x = torch.where(ids >= 0, raw, NEG_INF) if padded else raw
    if rows.bias is not None:
        cols, owned = columns(rows.bias_ids)
        x = _listed(x, cols, owned & (rows.bias_ids >= 0), lambda v: v + rows.bias)
    if token_counts is not None:
        cols, owned = columns(token_counts.ids)
        x = penalise(x, cols, owned & (token_counts.ids >= 0), token_counts, rows)
    mask = bitmask if rows.allowed is None else rows.allowed if bitmask is None else rows.allowed & bitmask
    if mask is not None:
        x = torch.where(allowed(mask, ids), x, NEG_INF)
    return x


def check_rows(nan_rows: torch.Tensor, empty_rows: torch.Tensor,
               row_name: Callable[[int], str] | None = None) -> None:
    """Raise the ``ValueError`` every rank raises for NaN rows / rows with nothing allowed, each
    row named by ``row_name`` (default: its index)."""
    problems = []
    for what, bad in (("contain NaN logits", nan_rows), ("have no allowed token (all -inf)", empty_rows)):
        idx = bad.nonzero().flatten().tolist()
        if idx:
            names = idx if row_name is None else "[" + ", ".join(row_name(i) for i in idx) + "]"
            problems.append(f"rows {names} {what}")
    if problems:
        raise ValueError("cannot sample: " + "; ".join(problems))


# ---------------------------------------------------------------------- order keys
def order_key(x: torch.Tensor) -> torch.Tensor:
    """int64 key in [-2**31, 2**31) whose order is the float order of float32 ``x`` (no NaN;
    -0.0 is folded into +0.0). Integer operations only: compilers may not fold ``-0.0 + 0.0``."""
    b = x.view(torch.int32)
    b = torch.where(b == -(2**31), 0, b)  # the bits of -0.0
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b).long()


def key_value(key: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`order_key`: the float32 value of each key."""
    b = key.int()
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b).view(torch.float32)


def rank_key(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Unique int64 key ordering tokens by value descending, then id ascending (padding last):
    ``order_key * 2**32 + (2**32 - 1 - id)``."""
    key = torch.where(ids >= 0, order_key(x), PAD_KEY)
    return key * 2**32 + (2**32 - 1 - ids.clamp(min=0))


# ---------------------------------------------------------------------- thresholds and masses
def mass_shift(vocab_size: int) -> int:
    return 62 - vocab_size.bit_length()


def mass_bits(vocab_size: int) -> int:
    """Bits of the largest :func:`mass`, ``2**mass_shift`` (the row's maximum)."""
    return mass_shift(vocab_size) + 1


def mass(z: torch.Tensor, zmax: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exact fixed-point weight (int64) of each token: ``floor(exp(z - zmax) * 2**s)`` with
    ``s = mass_shift(vocab_size)`` (:func:`scaled_mass`)."""
    return scaled_mass(z, zmax, mass_shift(vocab_size))


def scaled_mass(z: torch.Tensor, zmax: torch.Tensor, scale: int) -> torch.Tensor:
    """``floor(exp(z - zmax) * 2**scale)`` (int64, :func:`vocabpar.exactmath.exp_fixed`: the same
    integers eager or compiled). Compiled code takes ``scale`` as a symbol: one graph serves every
    vocabulary size, where ``vocab_size.bit_length()`` would compile one per size."""
    return exactmath.exp_fixed(z - zmax, scale)


def threshold_digit(digits: torch.Tensor, above: torch.Tensor,
                    need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the highest digit ``d`` (int64 ``[B]``, 0 when none) whose weight at or above it,
    plus ``above``, reaches ``need``, and the suffix sums it compared (``[B, D]``: the weight of
    digits ``>= d``): ``digits`` int64 ``[B, D]``, the weight of each digit of a bucket;
    ``above``, ``need``: ``[B]``. Exact integer sums."""
    suffix = digits.flip(1).cumsum(1).flip(1)
    return ((above[:, None] + suffix) >= need[:, None]).sum(1).clamp(min=1) - 1, suffix


def kept(x: torch.Tensor, lower: torch.Tensor, temperature: torch.Tensor,
         min_z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``z = x / t`` (float64 ``[F, R]``) and which tokens a row keeps (bool ``[F, R]``): ``x >=
    lower`` and ``z >= min_z``, the bounds per row ``[F]``. Every filter's threshold ends in
    this rule."""
    z = x.double() / temperature[:, None]
    return z, (x >= lower[:, None]) & (z >= min_z[:, None])


def top_p_target(total: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Integer mass the kept prefix must reach: ``ceil(top_p * total)`` clamped to [1, total]."""
    t = torch.ceil(total.double() * top_p).long()
    return torch.minimum(t.clamp(min=1), total)


def z_floor(z_max: torch.Tensor, rows: Rows, row: int | None = None) -> torch.Tensor:
    """The least ``z`` a kept token may have: the largest floor of the filters that state one
    from each row's max ``z_max`` (:data:`vocabpar.wire.filters.Z_FLOORS`, at least min-p's
    ``z_max + ln(min_p)``, the rule ``p >= min_p * p_max``), -inf where all are off; for every
    row, or for the one row ``row`` (``z_max`` then that row's)."""
    return largest([f.z_floor(z_max, getattr(rows, f.name) if row is None else getattr(rows, f.name)[row])
                    for f in Z_FLOORS])


def largest(bounds: list[torch.Tensor]) -> torch.Tensor:
    """The elementwise max of one or more same-shaped ``bounds`` (a plain loop: it compiles)."""
    out = bounds[0]
    for bound in bounds[1:]:
        out = torch.maximum(out, bound)
    return out


def top_p_pool(x: torch.Tensor, z: torch.Tensor, kappa: torch.Tensor, m: torch.Tensor,
               filter_order: str) -> torch.Tensor:
    """The tokens whose mass top-p counts: the top-k set ``x >= kappa``; with ``filter_order``
    ``"vllm"`` only those of it that also pass min-p (``z >= m``). Either way a prefix of the
    tokens in value order."""
    pool = x >= kappa
    return pool & (z >= m) if filter_order == "vllm" else pool


def gumbel_argmax(row: torch.Tensor, ids: torch.Tensor, z: torch.Tensor, rows: Rows,
                  positions: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, max of ``z + G`` over the listed (row, id, z) entries and the lowest id reaching
    it: float64 ``[batch]`` (-inf if none) and int64 ``[batch]`` (-1 if none)."""
    return row_argmax(row, ids, z + gumbel(row_keys(rows.seed, positions)[row], ids), batch)


def row_argmax(row: torch.Tensor, ids: torch.Tensor, score: torch.Tensor,
               batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the max ``score`` of the listed (row, id, score) entries and the lowest id reaching
    it: float64 ``[batch]`` (-inf if none) and int64 ``[batch]`` (-1 if none)."""
    best = torch.full((batch,), NEG_INF, dtype=torch.float64).scatter_reduce(0, row, score, "amax")
    hit = score == best[row]
    big = torch.iinfo(torch.long).max
    arg = torch.full((batch,), big).scatter_reduce(0, row[hit], ids[hit], "amin")
    return best, torch.where(arg == big, -1, arg)


def merge_argmax(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-rank ``[n, B]`` (value, id) maxima: max value, ties -> lowest id (ids < 0 lose)."""
    best = values.max(0).values
    big = torch.iinfo(torch.long).max
    cand = torch.where((values == best) & (ids >= 0), ids, big)
    arg = cand.min(0).values
    return best, torch.where(arg == big, -1, arg)


# ---------------------------------------------------------------------- speculative verification
def accept_uniform(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The uniform that accepts or rejects a draft token, per (seed, position): float64."""
    return uniform(row_keys(seed, positions, "accept"), torch.zeros_like(seed))


def accepts(u: torch.Tensor, p_token: torch.Tensor, p_total: torch.Tensor, q_token: torch.Tensor,
            q_total: torch.Tensor) -> torch.Tensor:
    """Whether a draft token is accepted, with probability ``min(1, p / q)``: ``u * q < p`` for
    ``p = p_token / p_total`` and ``q = q_token / q_total`` (exact integer masses, divided in
    float64; a token the draft could not give, ``q = 0``, is accepted iff ``p > 0``)."""
    return u * (q_token.double() / q_total.double()) < p_token.double() / p_total.double()


def residual_scores(p: torch.Tensor, p_total: torch.Tensor, q: torch.Tensor, q_total: torch.Tensor,
                    seed: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel-max scores of the correction after a rejection, drawn from ``(p - q)+``: per row
    (``[F]`` totals, seeds and positions) and token (``[F, columns]`` masses, ``ids``), float64
    ``log(p - q) + G`` where ``p > q``, else -inf. The noise is its own stream, independent of the
    sampler's and of the draft's."""
    return keyed_residual_scores(p, p_total, q, q_total, row_keys(seed, positions, "residual"), ids)


def keyed_residual_scores(p: torch.Tensor, p_total: torch.Tensor, q: torch.Tensor, q_total: torch.Tensor,
                          keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """:func:`residual_scores` given the rows' noise ``keys`` ``[F, 2]`` (residual stream)."""
    r = p.double() / p_total.double()[:, None] - q.double() / q_total.double()[:, None]
    noise = gumbel(keys[:, None, :], ids.clamp(min=0))
    return torch.where(r > 0, exactmath.log(r.clamp(min=1e-300)) + noise, NEG_INF)
