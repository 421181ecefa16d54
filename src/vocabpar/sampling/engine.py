"""The engine-facing sampler: zero host reads per call and one fixed collective script.

A GPU engine samples a persistent batch whose size is bounded at start-up, and pays for every
host read of a device value (a synchronisation that also rules out CUDA graphs) and for every
collective whose count depends on the data. :class:`Sampler` is built for that:

1. ``Sampler(layout, max_rows=..., max_top_n=...)`` agrees with the other ranks once, at
   construction (one handshake).
2. ``prepare(params, positions=...)`` validates on the host and decides the call's
   :class:`~vocabpar.wire.scripts.EnginePlan` from the parameters alone: which filters are
   active, how many candidates round one carries. It computes the fingerprints the check compares.
3. ``sample`` / ``verify`` / ``token_logprobs`` make no host read. Every message holds
   ``max_rows`` rows whatever the batch, so the same plan sends the same collectives with the
   same bytes for any logits (peaked, flat, tied, -inf or +inf rows). The agreement check rides
   in the first collective.
4. Failures (NaN rows, rows with nothing allowed, bad input on a rank, ranks that disagree) are
   flags in the output; ``out.raise_if_failed()`` is the one host read, and raises the same
   ``ValueError`` on every rank. The other rows are exact; the next call works.

Collectives per ``sample`` call: greedy 1; sampled rows whose kept set lies in each rank's top-c
candidates (top-k <= c, or nothing unsent) 2 (round one, the draw); a top-p or large top-k search
adds 3 histogram all-reduces each; logprobs add 2. Tokens equal
:func:`~vocabpar.sampling.reference.reference_sample` bit for bit at any world size.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch

from vocabpar import comm
from vocabpar.hashing import fingerprint
from vocabpar.layout import VocabLayout
from vocabpar.sampling.candidates import shard_top
from vocabpar.sampling.failures import Failures
from vocabpar.sampling.fixed import Choice, DraftPairs, padded
from vocabpar.sampling.fused import nan_and_ties
from vocabpar.sampling.params import (
    ROW_FIELDS,
    Rows,
    SamplingParams,
    TokenCounts,
    check_bitmask,
    check_positions,
)
from vocabpar.sampling.ranks import group_ranks, params_fact
from vocabpar.sampling.scoring import TokenLogprobs, local_scores, merged_scores
from vocabpar.sampling.semantics import (
    NEG_INF,
    SampleOutput,
    VerifyOutput,
    merge_argmax,
    processed_logits,
    with_logprobs,
)
from vocabpar.wire.records import folded, round_one, score
from vocabpar.wire.scripts import ENGINE_FACTS as FACTS
from vocabpar.wire.scripts import EnginePlan, engine_plan, engine_sample_script

SAMPLE_FACTS = ("rows", "plan", "sampling parameters", "logprobs", "positions", "token counts", "bitmask",
                "draft tokens", "draft logits")
SCORE_FACTS = ("rows", "top_n", "token ids")


@dataclass(frozen=True)
class Batch:
    """A prepared batch of ``B`` rows: its parameters on the device (``rows``), per-row inputs,
    the :class:`EnginePlan` of a ``sample`` call, the fingerprints its check compares (int64
    ``[FACTS]``), and what calls need from the host: which rows are ``greedy`` and the most top
    logprobs a row asks (``top_n``)."""

    rows: Rows
    greedy: tuple[bool, ...]
    top_n: int
    positions: torch.Tensor
    token_counts: TokenCounts | None
    bitmask: torch.Tensor | None
    plan: EnginePlan
    facts: torch.Tensor

    @property
    def size(self) -> int:
        return self.positions.shape[0]


class Sampler:
    """Samples, verifies and scores this rank's shard of logits for a batch of at most
    ``max_rows`` rows (``max_top_n``: the most top logprobs a call may ask), with the fixed
    scripts of :mod:`vocabpar.wire.scripts`. ``check``: fold the agreement check into each
    call's first collective (it costs words, not collectives)."""

    def __init__(self, layout: VocabLayout, *, max_rows: int, max_top_n: int = 0,
                 group: comm.ProcessGroup = None, check: bool = True) -> None:
        for name, value, low in (("max_rows", max_rows, 1), ("max_top_n", max_top_n, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 2**24:
                raise ValueError(f"{name} must be an int in [{low}, 2**24], got {value!r}")
        if max_top_n > layout.vocab_size:
            raise ValueError(f"max_top_n must be at most vocab_size={layout.vocab_size}, got {max_top_n}")
        self.layout, self.group, self.max_rows, self.max_top_n = layout, group, max_rows, max_top_n
        self.check = bool(check)
        self.ranks = group_ranks(layout, group)
        if self.ranks.n > 1:
            comm.verify_consistent(group, sampler="vocabpar.Sampler", layout=layout.describe(),
                                   max_rows=max_rows, max_top_n=max_top_n, check=self.check)
        self.padded = bool((self.ranks.ids < 0).any())
        self.widest = min(max(self.ranks.real_counts), layout.vocab_size)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ host side
    def prepare(self, params: SamplingParams, *, positions: torch.Tensor,
                token_counts: TokenCounts | None = None, bitmask: torch.Tensor | None = None,
                device: torch.device | str | None = None) -> Batch:
        """Validate a batch (raises ``ValueError`` here, on the host) and plan its calls. The
        rows' tensors go to ``device`` (default: the group's device)."""
        device = torch.device(device) if device is not None else comm.device(self.group)
        V = self.layout.vocab_size
        pos = torch.as_tensor(positions)
        if pos.dim() != 1:
            raise ValueError(f"positions must be one integer per row (1-D), got shape {tuple(pos.shape)}")
        B = pos.shape[0]
        pos = check_positions(pos, B)
        if B > self.max_rows:
            raise ValueError(f"batch of {B} rows exceeds max_rows={self.max_rows}")
        host = params.resolve(B, V)
        if host.top_n > self.max_top_n:
            raise ValueError(f"logprobs asks for {host.top_n} top tokens but max_top_n={self.max_top_n}")
        if token_counts is not None:
            token_counts.check(B, V)
        if bitmask is not None:
            check_bitmask(bitmask, B, V)
        rows = replace(host, **{name: getattr(host, name).to(device) for name in ROW_FIELDS},
                       logprobs=None if host.logprobs is None else host.logprobs.to(device))
        counts = None if token_counts is None else token_counts.to(device)
        mask = None if bitmask is None else bitmask.to(device)
        pos = pos.to(device)
        plan = self._plan(host)
        seen = [] if counts is None else [counts.ids, counts.counts] + (
            [] if counts.in_prompt is None else [counts.in_prompt.long()])
        facts = [B, _crc(repr(plan)), params_fact(rows),
                 rows.logprobs if rows.logprobs is not None else -1, pos,
                 torch.cat([t.flatten() for t in seen] + [torch.zeros(0, dtype=torch.long, device=device)]),
                 mask if mask is not None else 0]
        return Batch(rows, tuple(host.greedy.tolist()), host.top_n, pos, counts, mask, plan,
                     self._facts(facts, device))

    def _plan(self, host: Rows) -> EnginePlan:
        """The script of a ``sample`` call on these (host) parameters."""
        return engine_plan(self.max_rows, self.ranks.n, self.widest, self.layout.vocab_size,
                           greedy=host.greedy.tolist(), top_k=host.top_k.tolist(), top_p=host.top_p.tolist(),
                           min_p=host.min_p.tolist(), top_n=None if host.logprobs is None else self.max_top_n)

    def _facts(self, facts: list[int | torch.Tensor], device: torch.device) -> torch.Tensor:
        """int64 ``[FACTS]``: ints as they are, tensors by :func:`vocabpar.hashing.fingerprint`
        (one pass each); zeros when the check is off (the message keeps its size)."""
        if not self.check:
            return torch.zeros(FACTS, dtype=torch.long, device=device)
        words = [fingerprint(f).to(device) if isinstance(f, torch.Tensor)
                 else torch.tensor(int(f), device=device) for f in facts]
        return torch.stack(words + [torch.tensor(0, device=device)] * (FACTS - len(words)))

    def _columns(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's column ids and realness on ``device`` (cached)."""
        if device not in self._on_device:
            ids = self.ranks.ids.to(device)
            self._on_device[device] = ids, ids >= 0
        return self._on_device[device]

    # ------------------------------------------------------------------ device side
    def sample(self, local_logits: torch.Tensor, batch: Batch) -> SampleOutput:
        """One token per row of this rank's FP32 shard ``[B, columns]``; every rank returns the
        same :class:`SampleOutput` (failed rows hold -1), with ``script`` the plan's script and
        ``failures`` the flags. No host read."""
        fine = _fine(batch.positions.device)
        choice = self._choose(local_logits, batch.rows, batch.positions, batch.plan, batch.facts, fine,
                              batch.token_counts, batch.bitmask)
        tokens, failures = choice.tokens, choice.failures("Sampler.sample", SAMPLE_FACTS)
        result = SampleOutput(tokens)
        if batch.plan.top_n is not None:
            source = choice.raw if batch.rows.logprobs_of == "raw" else choice.drawn_from()
            scores = self._score(source, tokens.clamp(min=0), batch.plan.top_n)
            n = batch.top_n
            result = with_logprobs(tokens, batch.rows.logprobs, scores.logprobs, scores.ranks,
                                   scores.top_ids[:, :n], scores.top_logprobs[:, :n])
        return replace(result, script=engine_sample_script(batch.plan), failures=failures)

    def verify(self, target_logits: torch.Tensor, batch: Batch, draft_tokens: torch.Tensor,
               draft_logits: torch.Tensor | None = None) -> VerifyOutput:
        """:func:`~vocabpar.sampling.verify.verify` for a prepared batch: ``draft_tokens`` int64
        ``[B, k]``, this rank's target logits ``[B, k+1, columns]`` and optionally the draft's
        ``[B, k, columns]``. The stacked rows (``B·(k+1)``, plus ``k`` per sampled row with draft
        logits) must fit ``max_rows``. No host read; failures are flags."""
        B, k, device = batch.size, draft_tokens.shape[1], batch.positions.device
        R = self.ranks.ids.numel()
        weigh = draft_logits is not None and k > 0
        drafted = [b for b in range(B) if weigh and not batch.greedy[b]]
        stacked = B * (k + 1) + len(drafted) * k
        if stacked > self.max_rows:
            raise ValueError(f"verify stacks {stacked} rows (B={B}, k={k}) but max_rows={self.max_rows}")
        index = [b for b in range(B) for _ in range(k + 1)] + [b for b in drafted for _ in range(k)]
        offset = [i for _ in range(B) for i in range(k + 1)] + [i for _ in drafted for i in range(k)]
        at = torch.tensor(index, dtype=torch.long, device=device)
        target, problem = self._checked_logits(target_logits, device, (B, k + 1, R))
        raw = target.reshape(B * (k + 1), R)
        if drafted:
            draft, draft_problem = self._checked_logits(draft_logits, device, (B, k, R))
            problem = _problem(_problem(problem, draft_problem[:1] != 0, 1), draft.isposinf().any(-1), 4)
            raw = torch.cat([raw, draft[torch.tensor(drafted, device=device)].reshape(len(drafted) * k, R)])
        problem = _problem(problem, (draft_tokens < 0) | (draft_tokens >= self.layout.vocab_size), 2)
        drafts = draft_tokens.clamp(0, self.layout.vocab_size - 1)
        rows = batch.rows.take(at)
        positions = batch.positions[at] + torch.tensor(offset, dtype=torch.long, device=device)
        plan = replace(batch.plan, top_n=None, drafts=bool(drafted))  # the stacked rows repeat the batch's
        facts = self._facts([stacked, _crc(repr(plan)), params_fact(rows), -1, positions, 0, 0, draft_tokens,
                             int(bool(drafted))], device)
        choice = self._choose(raw, rows, positions, plan, facts, problem)
        drawn = choice.tokens[: B * (k + 1)].view(B, k + 1)
        accept = drafts == drawn[:, :k]
        pairs = None
        if drafted:
            pairs = DraftPairs(self.ranks, self.layout, self.max_rows, choice, batch.rows, batch.positions,
                               drafts, drafted)
            accept = torch.where(pairs.weighed, pairs.accept, accept)
        accepted = accept.long().cumprod(1).sum(1)
        last = drawn.gather(1, accepted[:, None])[:, 0]
        if pairs is not None:
            last = pairs.correct(last, accepted)
        codes = torch.zeros(B, dtype=torch.long, device=device).scatter_reduce(0, at, choice.codes, "amax")
        failures = replace(choice.failures("Sampler.verify", SAMPLE_FACTS), rows=codes)
        failed = failures.failed()
        accepted = torch.where(failed, 0, accepted)
        keep = torch.arange(k + 1, device=device) < accepted[:, None]
        tokens = torch.where(keep[:, :k], drafts, -1)
        tokens = torch.cat([tokens, torch.full((B, 1), -1, dtype=torch.long, device=device)], 1)
        tokens.scatter_(1, accepted[:, None], torch.where(failed, -1, last)[:, None])
        return VerifyOutput(accepted, tokens, engine_sample_script(plan), failures)

    def token_logprobs(self, local_logits: torch.Tensor, token_ids: torch.Tensor, *,
                       top_n: int = 0) -> TokenLogprobs:
        """Logprobs, ranks and top-``top_n`` of ``token_ids`` (int64 ``[T]``, ``T <= max_rows``)
        under this rank's FP32 raw logits ``[T, columns]``: :func:`token_logprobs` with the check
        folded into its first collective (so two collectives) and failures as flags. No host read."""
        if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= self.max_top_n:
            raise ValueError(f"top_n must be an int in [0, max_top_n={self.max_top_n}], got {top_n!r}")
        T, device, V = token_ids.shape[0], token_ids.device, self.layout.vocab_size
        if T > self.max_rows:
            raise ValueError(f"{T} rows exceed max_rows={self.max_rows}")
        logits, problem = self._checked_logits(local_logits, device, (T, self.ranks.ids.numel()))
        problem = _problem(problem, (token_ids < 0) | (token_ids >= V), 3)
        facts = self._facts([T, top_n, token_ids], device)
        ids, _ = self._columns(device)
        record, per_row = folded(score(top_n), self.max_rows, FACTS), score(top_n)
        stats = local_scores(logits, ids, self.layout, self.ranks.me, token_ids.clamp(0, V - 1), top_n)
        stats = padded(stats, self.max_rows).reshape(1, -1)
        message = record.pack(rows=stats, problem=problem[:1], row=problem[1:], facts=facts[None])
        got = record.unpack(self.ranks.gather(message)[:, 0])
        scores = per_row.unpack(got.rows.view(self.ranks.n, self.max_rows, -1)[:, :T])
        out = merged_scores(logits, ids, scores, self._sum_rows)
        disagree = (got.facts != got.facts[:1]).any(0)[: len(SCORE_FACTS)]
        fine_rows = torch.zeros(T, dtype=torch.long, device=device)
        failures = Failures("Sampler.token_logprobs", fine_rows, got.problem, got.row, disagree, SCORE_FACTS)
        return replace(out, failures=failures)

    # ------------------------------------------------------------------ steps
    def _checked_logits(self, logits: object, device: torch.device,
                        shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` and a fine (code, row) when they are float32 of ``shape`` on ``device``;
        else zeros in their place and problem code 1 (the call still sends its collectives, so
        no rank waits forever). Shapes, dtypes and devices are host metadata: no read."""
        ok = isinstance(logits, torch.Tensor) and logits.dtype == torch.float32 \
            and tuple(logits.shape) == shape and logits.device == device
        if ok:
            return logits, _fine(device)
        return torch.zeros(shape, device=device), torch.tensor([1, -1], device=device)

    def _sum_rows(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce ``t`` ``[T, words]`` as ``max_rows`` rows (the fixed size), back to ``[T, words]``."""
        return self.ranks.sum(padded(t, self.max_rows))[: t.shape[0]]

    def _score(self, source: torch.Tensor, tokens: torch.Tensor, top_n: int) -> TokenLogprobs:
        """Logprobs of ``tokens`` under ``source`` ``[B, columns]`` in two fixed collectives."""
        ids, _ = self._columns(source.device)
        B = tokens.shape[0]
        stats = padded(local_scores(source, ids, self.layout, self.ranks.me, tokens, top_n), self.max_rows)
        got = score(top_n).unpack(self.ranks.gather(stats)[:, :B])
        return merged_scores(source, ids, got, self._sum_rows)

    def _choose(self, local_logits: torch.Tensor, rows: Rows, positions: torch.Tensor, plan: EnginePlan,
                facts: torch.Tensor, problem: torch.Tensor, token_counts: TokenCounts | None = None,
                bitmask: torch.Tensor | None = None) -> Choice:
        """Round one (carrying the check), thresholds and the draw on ``B`` rows, with the
        collectives of ``plan`` and no host read. ``problem``: this rank's (code, row) so far."""
        device, B, V = positions.device, positions.shape[0], self.layout.vocab_size
        n, M = self.ranks.n, plan.rows
        ids, real = self._columns(device)
        raw, logits_problem = self._checked_logits(local_logits, device, (B, ids.numel()))
        problem = torch.where(problem[0] != 0, problem, logits_problem)
        penalty = None
        if token_counts is not None:
            cols, owned = self.layout.local_ids(token_counts.ids, self.ranks.me)
            penalty = cols.to(device), owned.to(device), token_counts
        x = processed_logits(raw, ids, rows, penalty, bitmask, padded=self.padded)
        c = plan.candidates
        # 1. round one, with the check folded in
        if x.shape[1]:
            xmax, col = x.max(1)  # first maximum: storage order is id order
            xmax_id = ids[col]
        else:
            xmax = torch.full((B,), NEG_INF, device=device)
            xmax_id = torch.full((B,), -1, device=device)
        cand, cand_id = shard_top(x, ids, c)
        # the c-th value, where the cut may split a tied group; none where the shard sends it all
        cut = cand[:, c - 1] if 0 < c <= x.shape[1] else None
        has_nan, ties = nan_and_ties(raw, x, real, cut)
        record = round_one(c, ties=True)
        local = padded(record.pack(max=torch.where(has_nan, float("nan"), xmax.double()), max_id=xmax_id,
                                    values=cand, ids=cand_id, ties=ties), M)
        first_message = folded(record, M, FACTS)
        message = first_message.pack(rows=local.reshape(1, -1), problem=problem[:1], row=problem[1:],
                                     facts=facts[None])
        got = first_message.unpack(self.ranks.gather(message)[:, 0])
        first = record.unpack(got.rows.view(n, M, -1)[:, :B])
        check = (got.problem, got.row, (got.facts != got.facts[:1]).any(0))
        best, tokens = merge_argmax(torch.where(first.max.isnan(), NEG_INF, first.max), first.max_id)
        nan_rows = first.max.isnan().any(0)
        codes = torch.where(nan_rows, 1, torch.where(best == NEG_INF, 2, 0))
        sampled = ~rows.greedy & (best < float("inf")) & (codes == 0)
        choice = Choice(raw, x, ids, real, tokens, sampled, codes, check, V)
        if c == 0:
            return choice.settle(tokens)
        return choice.sample(self.ranks, rows, positions, plan, first, best)


def _fine(device: torch.device) -> torch.Tensor:
    """A rank's (problem code, row) when its input is fine."""
    return torch.tensor([0, -1], device=device)


def _problem(problem: torch.Tensor, bad: torch.Tensor, code: int) -> torch.Tensor:
    """This rank's (code, row) ``problem`` with a bad-input mask ``[B, ...]`` folded in: the
    first problem wins; its row is the first bad one. No host read."""
    per_row = bad.reshape(bad.shape[0], -1).any(1)
    any_bad = per_row.any()
    first = per_row.long().argmax() if per_row.numel() else torch.tensor(0, device=bad.device)
    new = torch.stack([torch.where(any_bad, code, 0), torch.where(any_bad, first, -1)])
    return torch.where(problem[0] != 0, problem, new)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())
