"""The engine-facing sampler: zero host reads per call and one fixed collective script.

A GPU engine samples a persistent batch whose size is bounded at start-up, and pays for every
host read of a device value (a synchronisation that also rules out CUDA graphs) and for every
collective whose count depends on the data. :class:`Sampler` is built for that:

1. ``Sampler(layout, max_rows=..., max_top_n=...)`` agrees with the other ranks once (a handshake).
2. ``prepare(params, positions=...)`` validates on the host and decides the call's
   :class:`~vocabpar.wire.scripts.EnginePlan` from the parameters alone: which filters are
   active, how many candidates round one carries. It computes the fingerprints the check compares.
3. ``sample`` / ``verify`` / ``token_logprobs`` take this rank's logits in float32, bfloat16 or
   float16 (upcast inside the call) and make no host read. Every message holds a fixed number
   of rows whatever the batch, so the same plan sends the same collectives with the same bytes
   for any logits (peaked, flat, tied, -inf or +inf rows). The agreement check rides in the
   first collective.
4. Failures (NaN rows, rows with nothing allowed, bad input on a rank, ranks that disagree) are
   flags, written with the ids into one int64 device tensor. ``out.to_host()`` copies it to the
   host once (the copy an engine makes of its sampled ids anyway); the copy's
   ``raise_if_failed()`` raises the same ``ValueError`` on every rank and reads nothing more.
   ``out.raise_if_failed()`` on the device output reads the flags alone. The other rows are
   exact; the next call works.

Collectives per ``sample`` call: greedy 1; sampled rows whose kept set lies in each rank's top-c
candidates (top-k <= c, or nothing unsent) 2 (round one, the draw); a top-p or large top-k search
adds one histogram all-reduce per round of ``search_bits`` each; logprobs add 2. Tokens equal
:func:`~vocabpar.sampling.reference.reference_sample` (upcast logits) bit for bit at any world size.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch

from vocabpar import comm
from vocabpar.hashing import MASK62, fingerprint
from vocabpar.kernels.fused import KEY_OPTIONS
from vocabpar.layout import VocabLayout
from vocabpar.plan.machine import link
from vocabpar.sampling.acceptance import emitted
from vocabpar.sampling.candidates import round_one_fields
from vocabpar.sampling.constraints import HeldStops, held_stops
from vocabpar.sampling.dense import padded
from vocabpar.sampling.failures import Check, Failures, Packed, fold_problem, rejected_input
from vocabpar.sampling.fixed import Flagged, fixed_draft_masses
from vocabpar.sampling.params import (
    ROW_CONSTRAINTS,
    ROW_FIELDS,
    Rows,
    SamplingParams,
    TokenCounts,
    check_bitmask,
    check_positions,
    check_row_counts,
    describe,
)
from vocabpar.sampling.ranks import group_ranks, param_words, params_fact, row_fingerprints
from vocabpar.sampling.schedules import Fixed
from vocabpar.sampling.scoring import TokenLogprobs, local_scores, merged_scores
from vocabpar.sampling.semantics import (
    SampleOutput,
    VerifyOutput,
    processed_logits,
    with_logprobs,
)
from vocabpar.sampling.stacked import every_row_index
from vocabpar.sampling.steps import draw_from_round_one
from vocabpar.wire.filters import FILTERS
from vocabpar.wire.records import INPUT_WORDS, folded, round_one, score
from vocabpar.wire.scripts import ENGINE_FACTS as FACTS
from vocabpar.wire.scripts import (
    EnginePlan,
    checked_search_bits,
    choose_search_bits,
    engine_plan,
    engine_sample_script,
    engine_score_script,
)

SAMPLE_FACTS = ("rows", "plan", "sampling parameters", "logprobs", "positions", "token counts", "bitmask",
                "draft tokens", "draft logits")
SCORE_FACTS = ("rows", "top_n", "token ids")
SCORED = ("tokens", "logprobs", "top_ids", "top_logprobs", "ranks")
"""The fields of a ``sample`` call's output with logprobs."""
LIMIT = 2**24
"""The largest ``max_rows``, ``max_top_n`` and ``max_drafts``."""
STEP_OPTIONS = dict(KEY_OPTIONS)
"""Inductor options for an engine that compiles a whole call (``torch.compile(sampler.sample,
fullgraph=True, options=STEP_OPTIONS)``): the per-token noise hashes stay short expressions, which
cuts the compile of a sampled plan by about half (two ranks on two CPU cores: ~55 s instead of
~130 s per program)."""


@dataclass(frozen=True)
class Batch:
    """A prepared batch of ``B`` rows: its parameters on the device (``rows``), per-row inputs,
    the :class:`EnginePlan` of a ``sample`` call, the fingerprints its check compares (int64
    ``[FACTS]``; per row, ``row_facts`` of every per-row input of a ``sample`` call, padded to
    ``max_rows``, and ``row_params`` of the row's sampling parameters and position, padded to
    ``verify_rows``), and
    what calls need from the host: whether some row samples (``any_sampled``) and the most top
    logprobs a row asks (``top_n``). Nothing here holds the batch's size but its tensors, so a
    compiled call serves every size of 2 to ``max_rows`` rows with one program."""

    rows: Rows
    any_sampled: bool
    top_n: int
    positions: torch.Tensor
    token_counts: TokenCounts | None
    bitmask: torch.Tensor | None
    plan: EnginePlan
    facts: torch.Tensor
    row_facts: torch.Tensor
    row_params: torch.Tensor
    verify_plans: tuple[EnginePlan, EnginePlan]
    """The plan of a ``verify`` call without and with draft logits, and its check word (below)."""
    verify_plan_words: tuple[int, int]
    held: HeldStops | None = None
    """The ``min_tokens`` exclusions of a batch holding back some row's stop ids, which
    verification recomputes per draft position."""

    @property
    def size(self) -> int:
        return self.positions.shape[0]


class Sampler:
    """Samples, verifies and scores this rank's shard of logits (float32, bfloat16 or float16,
    upcast inside the call) for batches of at most ``max_rows`` rows, with the fixed scripts of
    :mod:`vocabpar.wire.scripts`: every message of ``sample`` and ``token_logprobs`` carries
    ``max_rows`` rows. ``max_top_n``: the most top logprobs a call may ask.

    ``verify`` stacks ``B·(k+1)`` target rows for ``k`` drafts per row, and ``B·(2k+1)`` when
    draft logits are given and some row samples (every row's ``k`` draft rows). They must fit its row
    bound: ``max_rows`` itself, or with ``max_drafts=k`` given ``max_rows·(2k+1)``, which fits
    any prepared batch verifying up to ``k`` drafts per row (``verify``'s messages then carry
    that many rows). ``check``: fold the agreement check into each call's first collective (it
    costs words, not collectives). ``search_bits``: the rounds of a threshold search (adding up to
    32 bits), by default the fastest for ``max_rows`` on a link of ``latency`` s and ``bandwidth``
    B/s (the device type's when not given): :func:`~vocabpar.wire.scripts.choose_search_bits`."""

    def __init__(self, layout: VocabLayout, *, max_rows: int, max_top_n: int = 0,
                 max_drafts: int | None = None, group: comm.ProcessGroup = None, check: bool = True,
                 search_bits: tuple[int, ...] | None = None, latency: float | None = None,
                 bandwidth: float | None = None) -> None:
        bounds = [("max_rows", max_rows, 1), ("max_top_n", max_top_n, 0)]
        for name, value, low in bounds + [("max_drafts", max_drafts, 0)] * (max_drafts is not None):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= LIMIT:
                raise ValueError(f"{name} must be an int in [{low}, 2**24]"
                                 + " or None" * (name == "max_drafts") + f", got {value!r}")
        if max_top_n > layout.vocab_size:
            raise ValueError(f"max_top_n must be at most vocab_size={layout.vocab_size}, got {max_top_n}")
        self.layout, self.group, self.max_rows, self.max_top_n = layout, group, max_rows, max_top_n
        self.max_drafts, self.verify_rows = max_drafts, max_rows * (2 * (max_drafts or 0) + 1)
        """The most rows ``verify`` stacks, and the rows its messages carry."""
        if self.verify_rows > LIMIT:
            raise ValueError(f"max_rows·(2·max_drafts+1) must be at most 2**24, got {self.verify_rows}")
        self.check = bool(check)
        self.ranks = group_ranks(layout, group)
        device = comm.device(group)
        self.search_bits = checked_search_bits(search_bits) if search_bits is not None else \
            choose_search_bits(max_rows, self.ranks.n, *link(device.type, latency, bandwidth))
        if self.ranks.n > 1:
            comm.verify_consistent(group, sampler="vocabpar.Sampler", layout=layout.describe(),
                                   max_rows=max_rows, max_top_n=max_top_n, max_drafts=max_drafts,
                                   check=self.check, search_bits=self.search_bits)
        self.padded = bool((self.ranks.ids < 0).any())
        self.widest = min(max(self.ranks.real_counts), layout.vocab_size)
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self._countdowns: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._columns(device)  # the usual device's constants now, not in a first call
        for rows in {max_rows, self.verify_rows}:
            self._countdown(device, rows)

    # ------------------------------------------------------------------ host side
    def prepare(self, params: SamplingParams, *, positions: torch.Tensor,
                token_counts: TokenCounts | None = None, bitmask: torch.Tensor | None = None,
                device: torch.device | str | None = None, output_lens: torch.Tensor | None = None) -> Batch:
        """Validate a batch of ``len(positions)`` rows (raises ``ValueError`` here, on the host)
        and plan its calls. The rows' tensors go to ``device`` (default: the group's device).
        ``output_lens``: the tokens each row has produced, for ``min_tokens``."""
        device = torch.device(device) if device is not None else comm.device(self.group)
        V = self.layout.vocab_size
        pos = torch.as_tensor(positions)
        if pos.dim() != 1:
            raise ValueError(f"positions must be one integer per row (1-D), got shape {tuple(pos.shape)}")
        B = pos.shape[0]
        check_row_counts(B, params, token_counts, bitmask)
        pos = check_positions(pos, B)
        if B > self.max_rows:
            raise ValueError(f"batch of {B} rows exceeds max_rows={self.max_rows}")
        host = params.resolve(B, V, output_lens)
        if host.top_n > self.max_top_n:
            raise ValueError(f"logprobs asks for {host.top_n} top tokens but max_top_n={self.max_top_n}")
        if token_counts is not None:
            token_counts.check(B, V)
        if bitmask is not None:
            check_bitmask(bitmask, B, V)
        fields = (*ROW_FIELDS, *ROW_CONSTRAINTS)
        # each a unit-stride copy (a scalar parameter is an expanded view): one program for both
        dense = torch.contiguous_format
        rows = replace(host, **{name: getattr(host, name).clone(memory_format=dense).to(device)
                                for name in (*fields, "logprobs") if getattr(host, name) is not None})
        counts = None if token_counts is None else token_counts.to(device)
        mask = None if bitmask is None else bitmask.to(device)
        pos = pos.to(device)
        seen = [] if counts is None else [counts.ids, counts.counts] + (
            [] if counts.in_prompt is None else [counts.in_prompt.long()])
        _any_rows(pos, mask, rows.logprobs, *(getattr(rows, name) for name in fields))
        ragged = () if counts is None else (counts.ids, counts.counts, counts.in_prompt)
        _any_rows(rows.bias_ids, rows.bias, *ragged, dims=(0, 1))  # the tokens a row has seen change
        plan = self._plan(host)
        held = held_stops(params.allowed_token_ids, params.min_tokens, params.stop_token_ids,
                          output_lens, B, V, device)
        held_rows = [] if held is None else list(vars(held).values())  # what verify's later positions read
        _any_rows(*held_rows)
        # the min_tokens state counts as sampling parameters (named field by field when it is absent)
        sampling = torch.cat([params_fact(rows), *[t.flatten().long() for t in held_rows]]) if held_rows \
            else params_fact(rows)
        facts = [B, _crc(repr(plan)), sampling,
                 rows.logprobs if rows.logprobs is not None else -1, pos,
                 torch.cat([t.flatten() for t in seen] + [torch.zeros(0, dtype=torch.long, device=device)]),
                 mask if mask is not None else 0]
        row_inputs = seen + [t for t in (rows.logprobs, mask) if t is not None]
        row_params, row_facts = self._row_facts(rows, pos, row_inputs, held_rows)
        # verify's stacked rows repeat the plan in verify_rows rows; its check word is hashed on the host
        verify_plans = tuple(replace(plan, rows=self.verify_rows, top_n=None, drafts=drafts)
                             for drafts in (False, True))
        return Batch(rows, not bool(host.greedy.all()), host.top_n, pos, counts, mask, plan,
                     self._facts(facts, device), row_facts, row_params, verify_plans,
                     tuple(_crc(repr(p)) for p in verify_plans), held)

    def _plan(self, host: Rows) -> EnginePlan:
        """The script of a ``sample`` call on these (host) parameters."""
        values = {f.name: getattr(host, f.name).tolist() for f in FILTERS}
        return engine_plan(self.max_rows, self.ranks.n, self.widest, self.layout.vocab_size,
                           greedy=host.greedy.tolist(), values=values, search_bits=self.search_bits,
                           top_n=None if host.logprobs is None else self.max_top_n)

    def _facts(self, facts: list[int | torch.Tensor], device: torch.device) -> torch.Tensor:
        """int64 ``[FACTS]``: ints and 0-dim tensors as they are, other tensors by
        :func:`vocabpar.hashing.fingerprint` (one pass each); zeros when the check is off (the
        message keeps its size)."""
        if not self.check:
            return torch.zeros(FACTS, dtype=torch.long, device=device)
        words = [(f if not f.dim() else fingerprint(f)).to(device) if isinstance(f, torch.Tensor)
                 else torch.tensor(int(f), device=device) for f in facts]
        return torch.stack(words + [torch.tensor(0, device=device)] * (FACTS - len(words)))

    def _row_facts(self, rows: Rows, positions: torch.Tensor, seen: list[torch.Tensor],
                   held: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the fingerprint of its sampling parameters, position and ``held`` (the
        ``min_tokens`` state verification reads, ``[B, ...]`` each) (``[verify_rows]``), and of
        those with every other per-row input in ``seen`` (``[max_rows]``), 0 past the batch;
        zeros when the check is off."""
        B = positions.shape[0]
        if not self.check:
            zeros = torch.zeros(self.verify_rows, dtype=torch.long, device=positions.device)  # >= max_rows
            return zeros, zeros[: self.max_rows]
        core = row_fingerprints(param_words(rows), positions[:, None], *[t.reshape(B, -1) for t in held])
        every = (core + row_fingerprints(*[t.reshape(B, -1) for t in seen])) & MASK62 if seen else core
        return padded(core, self.verify_rows), padded(every, self.max_rows)

    def _columns(self, device: torch.device) -> torch.Tensor:
        """This rank's column ids on ``device`` (cached)."""
        if device not in self._on_device:
            self._on_device[device] = self.ranks.ids.to(device)
        return self._on_device[device]

    def _countdown(self, device: torch.device, rows: int) -> torch.Tensor:
        """int64 ``rows, ..., 1`` on ``device`` (cached): :meth:`Check.of`'s row weights."""
        if (device, rows) not in self._countdowns:
            self._countdowns[device, rows] = torch.arange(rows, 0, -1, device=device)
        return self._countdowns[device, rows]

    # ------------------------------------------------------------------ device side
    def sample(self, local_logits: torch.Tensor, batch: Batch) -> SampleOutput:
        """One token per row of this rank's shard ``[B, columns]`` (float32, bfloat16 or
        float16); every rank returns the same :class:`SampleOutput` (failed rows hold -1), with
        ``script`` the plan's script, ``failures`` the flags and ``tokens`` a view of the one
        int64 tensor (``packed``) that holds the ids and the flags. No host read."""
        device = batch.positions.device
        shape = (batch.size, self.ranks.ids.numel())
        (raw,), problem, rejected = self._inputs(device, (local_logits, shape, 1))
        choice = self._choose(raw, batch.rows, batch.positions, batch.plan, batch.facts, batch.row_facts,
                              problem, rejected, batch.token_counts, batch.bitmask)
        tokens = choice.tokens
        fields = {"tokens": tokens}
        if batch.plan.top_n is not None:
            source = choice.raw if batch.rows.logprobs_of == "raw" else choice.drawn.drawn_from()
            scores = self._score(source, tokens.clamp(min=0), batch.plan.top_n)
            n = batch.top_n
            out = with_logprobs(tokens, batch.rows.logprobs, scores.logprobs, scores.ranks,
                                scores.top_ids[:, :n], scores.top_logprobs[:, :n])
            fields = {name: getattr(out, name) for name in SCORED}
        views, failures, packed = self._pack("Sampler.sample", fields, choice.codes, choice.check,
                                             SAMPLE_FACTS)
        return SampleOutput(**views, script=engine_sample_script(batch.plan), failures=failures,
                            packed=packed)

    def verify(self, target_logits: torch.Tensor, batch: Batch, draft_tokens: torch.Tensor,
               draft_logits: torch.Tensor | None = None) -> VerifyOutput:
        """:func:`~vocabpar.sampling.verify.verify` for a prepared batch: ``draft_tokens`` int64
        ``[B, k]``, this rank's target logits ``[B, k+1, columns]`` and optionally the draft's
        ``[B, k, columns]`` (float32, bfloat16 or float16; a greedy row's are not read, so an
        infinite one there is no failure). The stacked rows -- ``B·(k+1)``, or ``B·(2k+1)`` with
        draft logits and some sampled row -- must fit :attr:`verify_rows` (``max_rows``, or
        ``max_rows·(2·max_drafts+1)``); else ``ValueError`` naming them. ``accepted`` and
        ``tokens`` are views of ``packed``. No host read; failures are flags."""
        B, device, V = batch.size, batch.positions.device, self.layout.vocab_size
        if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dtype != torch.long \
                or draft_tokens.dim() != 2 or draft_tokens.shape[0] != B:
            raise ValueError(f"Sampler.verify: draft_tokens must be int64 [{B}, k] (k drafts per row of the "
                             f"batch), got {describe(draft_tokens)}")
        k, R = draft_tokens.shape[1], self.ranks.ids.numel()
        drafted = draft_logits is not None and k > 0 and batch.any_sampled  # every row's drafts join
        stacked = B * (k + 1 + k * drafted)
        if stacked > self.verify_rows:
            raise ValueError(self._too_many_rows(B, k, draft_logits is not None, drafted, stacked))
        at, offset = every_row_index(B, k, drafted, device)
        given = [(target_logits, (B, k + 1, R), 5)] + [(draft_logits, (B, k, R), 6)] * drafted
        logits, problem, rejected = self._inputs(device, *given)
        raw = logits[0].reshape(B * (k + 1), R)
        in_use = None  # the stacked rows whose outcome counts: a greedy row's draft rows do not
        if drafted:
            draft, sampled = logits[1], ~batch.rows.greedy
            problem = fold_problem(problem, draft.isposinf().any(-1) & sampled[:, None], 4)
            raw = torch.cat([raw, draft.reshape(B * k, R)])
            in_use = torch.cat([torch.ones(B * (k + 1), dtype=torch.bool, device=device),
                                sampled[:, None].expand(B, k).reshape(-1)])
        problem = fold_problem(problem, (draft_tokens < 0) | (draft_tokens >= V), 2)
        drafts = draft_tokens.clamp(0, V - 1)
        rows = batch.rows.take(at)
        if batch.held is not None:  # min_tokens counts the draft positions: each stacked row's own exclusions
            rows = replace(rows, allowed=batch.held.at(at, offset))
        positions = batch.positions[at] + offset
        plan = batch.verify_plans[drafted]
        draft_fact, row_facts = 0, batch.row_params
        if self.check:
            draft_rows = row_fingerprints(draft_tokens)
            draft_fact = draft_rows.sum() & MASK62
            row_facts = (row_facts + padded(draft_rows, plan.rows)) & MASK62
        # the stacked rows' parameters and positions follow from the batch's, hashed in prepare
        facts = self._facts([stacked, batch.verify_plan_words[drafted], batch.facts[2], -1,
                             batch.facts[4], 0, 0, draft_fact, int(drafted)], device)
        choice = self._choose(raw, rows, positions, plan, facts, row_facts, problem, rejected)
        drawn = choice.tokens[: B * (k + 1)].view(B, k + 1)
        accept = drafts == drawn[:, :k]
        masses = fixed_draft_masses(choice, self.layout, self.ranks, plan, batch.positions, drafts) \
            if drafted else None
        if masses is not None:
            accept = torch.where(masses.weighed, masses.accept, accept)
        accepted = accept.long().cumprod(1).sum(1)
        last = drawn.gather(1, accepted[:, None])[:, 0]
        if masses is not None:  # every row, corrected where it rejected a weighed draft
            last = masses.correct(last, accepted, None)
        used = choice.codes if in_use is None else torch.where(in_use, choice.codes, 0)
        codes = torch.zeros(B, dtype=torch.long, device=device).scatter_reduce(0, at, used, "amax")
        failed = (codes != 0) | choice.check.failed()
        accepted = torch.where(failed, 0, accepted)
        tokens = emitted(drafts, accepted, torch.where(failed, -1, last))
        views, failures, packed = self._pack("Sampler.verify", {"accepted": accepted, "tokens": tokens},
                                             codes, choice.check, SAMPLE_FACTS)
        return VerifyOutput(**views, script=engine_sample_script(plan), failures=failures, packed=packed)

    def _too_many_rows(self, B: int, k: int, with_logits: bool, drafted: bool, stacked: int) -> str:
        """The error of a verification whose stacked rows exceed :attr:`verify_rows`."""
        rows = f"{B}·({k}+1) target rows" + (f" + {B}·{k} draft rows" if drafted else "")
        bound = f"max_rows={self.max_rows}" if self.max_drafts is None else (
            f"max_rows·(2·max_drafts+1) = {self.verify_rows} (max_rows={self.max_rows}, "
            f"max_drafts={self.max_drafts})")
        need = B * (2 * k + 1) if with_logits else B * (k + 1)
        return (f"Sampler.verify: B={B} rows with k={k} drafts {'and' if with_logits else 'without'} draft "
                f"logits stack {rows} = {stacked} rows, more than {bound}; verify needs B·(k+1) rows, "
                f"B·(2k+1) with draft logits: build the Sampler with max_rows >= {need}, or with "
                f"max_rows={B} and max_drafts={k}")

    def token_logprobs(self, local_logits: torch.Tensor, token_ids: torch.Tensor, *,
                       top_n: int = 0) -> TokenLogprobs:
        """Logprobs, ranks and top-``top_n`` of ``token_ids`` (int64 ``[T]``, ``T <= max_rows``)
        under this rank's raw logits ``[T, columns]`` (float32, bfloat16 or float16):
        :func:`token_logprobs` with the check folded into its first collective (so two
        collectives, ``script``) and failures as flags; ``ranks`` and ``top_ids`` are views of
        ``packed``. No host read."""
        if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= self.max_top_n:
            raise ValueError(f"top_n must be an int in [0, max_top_n={self.max_top_n}], got {top_n!r}")
        if not isinstance(token_ids, torch.Tensor) or token_ids.dtype != torch.long or token_ids.dim() != 1:
            raise ValueError(f"Sampler.token_logprobs: token_ids must be int64 [T], got "
                             f"{describe(token_ids)}")
        T, device, V = token_ids.shape[0], token_ids.device, self.layout.vocab_size
        if T > self.max_rows:
            raise ValueError(f"Sampler.token_logprobs: {T} rows exceed max_rows={self.max_rows}")
        (logits,), problem, rejected = self._inputs(device, (local_logits, (T, self.ranks.ids.numel()), 1))
        problem = fold_problem(problem, (token_ids < 0) | (token_ids >= V), 3)
        id_fact, row_facts = 0, torch.zeros(T, dtype=torch.long, device=device)
        if self.check:
            row_facts = row_fingerprints(token_ids[:, None])
            id_fact = row_facts.sum() & MASK62
        facts = self._facts([T, top_n, id_fact], device)
        ids = self._columns(device)
        record, per_row = folded(score(top_n), self.max_rows, FACTS), score(top_n)
        stats = local_scores(logits, ids, self.layout, self.ranks.me, token_ids.clamp(0, V - 1), top_n)
        stats = padded(stats, self.max_rows).reshape(1, -1)
        message = record.pack(rows=stats, problem=problem[:1], row=problem[1:], input=rejected[None],
                              facts=facts[None], row_facts=padded(row_facts, self.max_rows)[None])
        got = record.unpack(self.ranks.gather(message)[:, 0])
        scores = per_row.unpack(got.rows.view(self.ranks.n, self.max_rows, -1)[:, :T])
        out = merged_scores(logits, ids, scores, self._sum_rows)
        check = Check.of(got, self._countdown(device, self.max_rows))
        fields = {name: getattr(out, name) for name in ("logprobs", "ranks", "top_ids", "top_logprobs")}
        fine = torch.zeros(T, dtype=torch.long, device=device)  # a row's NaN is its logprob, not a failure
        views, failures, packed = self._pack("Sampler.token_logprobs", fields, fine, check, SCORE_FACTS)
        script = engine_score_script(self.max_rows, top_n, FACTS)
        return TokenLogprobs(**views, script=script, failures=failures, packed=packed)

    # ------------------------------------------------------------------ steps
    def _inputs(self, device: torch.device, *given: tuple[object, tuple[int, ...], int]
                ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Each given ``(logits, shape, code)`` as float32 -- zeros of ``shape`` in place of one
        :func:`~vocabpar.sampling.failures.rejected_input` rejects, so the call still sends its
        collectives and no rank waits forever -- with this rank's (problem code, row) and the
        first rejected input's words (problem ``code``). Dtypes, shapes and devices are host
        metadata: no read."""
        out, problems = [], []
        for value, shape, code in given:
            words = rejected_input(value, shape, device)
            out.append(value.float() if words is None else torch.zeros(shape, device=device))
            problems += [] if words is None else [(code, words)]
        code, words = problems[0] if problems else (0, [0] * INPUT_WORDS)
        head = torch.tensor([code, -1, *words], device=device)
        return out, head[:2], head[2:]

    def _pack(self, where: str, fields: dict[str, torch.Tensor], codes: torch.Tensor, check: Check,
              names: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], Failures, Packed]:
        """``fields`` and the flags in one int64 tensor: the fields (int64 ones as its views), the
        call's :class:`Failures` and the :class:`Packed` words."""
        packed = Packed.of({**fields, "flags": check.flags(codes)})
        views = packed.on_device(fields)
        failures = Failures(where, packed.words[packed.span("flags")], codes.numel(), self.ranks.n, names,
                            FACTS, self.layout.vocab_size, check.rows)
        return views, failures, packed

    def _sum_rows(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce ``t`` ``[T, words]`` as ``max_rows`` rows (the fixed size), back to ``[T, words]``."""
        return self.ranks.sum(padded(t, self.max_rows))[: t.shape[0]]

    def _score(self, source: torch.Tensor, tokens: torch.Tensor, top_n: int) -> TokenLogprobs:
        """Logprobs of ``tokens`` under ``source`` ``[B, columns]`` in two fixed collectives."""
        ids = self._columns(source.device)
        B = tokens.shape[0]
        stats = padded(local_scores(source, ids, self.layout, self.ranks.me, tokens, top_n), self.max_rows)
        got = score(top_n).unpack(self.ranks.gather(stats)[:, :B])
        return merged_scores(source, ids, got, self._sum_rows)

    def _choose(self, raw: torch.Tensor, rows: Rows, positions: torch.Tensor, plan: EnginePlan,
                facts: torch.Tensor, row_facts: torch.Tensor, problem: torch.Tensor, rejected: torch.Tensor,
                token_counts: TokenCounts | None = None, bitmask: torch.Tensor | None = None) -> Flagged:
        """Round one (carrying the check: ``facts``, ``row_facts`` ``[plan.rows]``, this rank's
        (code, row) ``problem`` and ``rejected`` input words), thresholds and the draw on the
        ``B`` rows of float32 ``raw``, with the collectives of ``plan`` and no host read."""
        device, B, V = positions.device, positions.shape[0], self.layout.vocab_size
        n, M = self.ranks.n, plan.rows
        ids = self._columns(device)
        x = processed_logits(raw, ids, rows, lambda t: self.layout.local_ids(t, self.ranks.me), token_counts,
                             bitmask, padded=self.padded)
        c = plan.candidates
        # 1. round one, with the check folded in
        record = round_one(c, ties=True, masks=plan.masks)
        local = padded(record.pack(**round_one_fields(raw, x, ids, c, ties=True, masks=plan.masks)), M)
        first_message = folded(record, M, FACTS)
        message = first_message.pack(rows=local.reshape(1, -1), problem=problem[:1], row=problem[1:],
                                     input=rejected[None], facts=facts[None], row_facts=row_facts[None])
        got = first_message.unpack(self.ranks.gather(message)[:, 0])
        first = record.unpack(got.rows.view(n, M, -1)[:, :B])
        check = Check.of(got, self._countdown(device, M))
        drawn = draw_from_round_one(x, ids, rows, positions, self.ranks, V, first, Fixed(plan),
                                    masks=plan.masks, ties=True)
        return Flagged.of(raw, check, drawn)


def _any_rows(*tensors: torch.Tensor | None, dims: tuple[int, ...] = (0,)) -> None:
    """Let a compiled call take ``tensors`` at any size along ``dims`` (the batch's rows) without
    recompiling: a hint to ``torch.compile``, nothing else."""
    for t in tensors:
        for dim in dims if t is not None else ():
            torch._dynamo.maybe_mark_dynamic(t, dim)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())
