"""The pieces both decode loops share: the plain loop (:mod:`vocabpar.integrations.hf`) and the
speculative one (:mod:`vocabpar.integrations.speculative`).

* :class:`Generation`: what a loop returns, and the per-step bookkeeping of time and traffic;
* the request prologue, :func:`open_request`: the checked request, the left-padded prompts on
  the model's device (:func:`left_pad`, :func:`pad_id`), their positions, an empty
  :class:`KVStream` and :class:`Generation` -- everything before a loop's first step;
* :class:`KVStream`: one model body's KV cache over rows that advance in lockstep;
* :class:`Step`: hidden rows -> logits by collection strategy -> sampled (or verified) ids that
  every rank holds, including which rows each rank samples and how their ids are shared; with
  ``strategy="auto"`` the planner picks the strategy per step (:meth:`Step.resolved`).

Neither loop imports the other: both import this module, and ``hf`` imports ``speculative``.
"""

from __future__ import annotations

import inspect
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from vocabpar import comm, plan
from vocabpar.collect import broadcast_tokens, compute_logits
from vocabpar.head import ParallelLMHead, select_rows
from vocabpar.layout import VocabLayout
from vocabpar.sampling import Sampler, SamplingParams, TokenCounts, VerifyOutput, reference_sample, sample
from vocabpar.sampling import verify as verify_drafts
from vocabpar.sampling.scoring import TokenLogprobs
from vocabpar.wire.filters import FILTERS, strictest
from vocabpar.wire.strategies import STRATEGIES

GREEDY = SamplingParams(temperature=0.0)
AUTO = "auto"
"""The strategy that lets the planner choose, per step, between gathering the logits and
sampling on shards (:class:`vocabpar.plan.Switch`)."""


@dataclass
class Generation:
    """What a decode loop returns (the same on every rank): ``tokens[b]``, the new ids of prompt
    b; per step (step 0 is the prefill) ``inputs`` (the ids fed to the embedding, ``[B, T]``),
    the wall time, and by collective kind the bytes this rank received (``step_received``) and
    the collectives it took part in (``step_collectives``; the exchange of sampled ids is booked
    as ``"sampled_ids"``; the handshake and agreement checks are left out);
    ``prompt_logprobs[b]`` (when asked for): the scores of prompt b's tokens 1.., ``[len - 1]``."""

    tokens: list[list[int]]
    inputs: list[torch.Tensor]
    step_seconds: list[float]
    step_received: list[dict[str, int]]
    prompt_logprobs: list[TokenLogprobs] | None = None
    step_collectives: list[dict[str, int]] = field(default_factory=list)
    drafted: int = 0  # speculative decoding: draft tokens proposed, and how many were accepted
    accepted: int = 0
    strategies: list[str] = field(default_factory=list)  # the collection strategy each step ran

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 without speculation)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def record(self, before: dict[str, comm.Counter], began: float, fed: torch.Tensor) -> None:
        """Close a step that started at ``began`` with counters ``before`` and fed ``fed``."""
        self.step_seconds.append(time.perf_counter() - began)
        self.step_received.append(_since(before, "received"))
        self.step_collectives.append(_since(before, "calls"))
        self.inputs.append(fed.cpu())


def _since(before: dict[str, comm.Counter], field: str) -> dict[str, int]:
    """Per collective kind, how much ``field`` (``received`` bytes or ``calls``) of this process's
    counters grew since ``before``; the safety exchanges (``comm.OVERHEAD``) are left out."""
    def prior(kind: str) -> int:
        return getattr(before[kind], field) if kind in before else 0

    return {kind: getattr(c, field) - prior(kind) for kind, c in comm.traffic().items()
            if kind not in comm.OVERHEAD and getattr(c, field) != prior(kind)}


# ---------------------------------------------------------------------- the request prologue
@dataclass
class Request:
    """A checked request ready for its first step: ``ids``/``mask`` int64 ``[B, longest]`` on
    ``device`` (prompts right-aligned), ``position_ids`` the prefill's logical positions (as
    ``transformers``' ``generate``: padding at 0), ``positions`` ``[B]`` the position of each
    row's first new token (its prompt's length), an empty ``stream`` over the model body and an
    empty ``out``."""

    params: SamplingParams
    ids: torch.Tensor
    mask: torch.Tensor
    position_ids: torch.Tensor
    positions: torch.Tensor
    device: torch.device
    stream: KVStream
    out: Generation


def open_request(model: nn.Module, embed: nn.Module, vocab: int, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | None, max_new_tokens: int) -> Request:
    """What both loops do before their first step; ``ValueError`` on a bad ``max_new_tokens``
    first, then on a bad prompt (:func:`left_pad`)."""
    params = checked_request(params, max_new_tokens)
    ids, mask = left_pad(prompts, pad_id(model.config), vocab)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as transformers' generate
    positions = torch.tensor([len(p) for p in prompts], device=device)  # of the token being sampled
    B = len(prompts)
    stream, out = KVStream(model.base_model, embed, B, device), Generation([[] for _ in range(B)], [], [], [])
    return Request(params, ids, mask, position_ids, positions, device, stream, out)


def checked_request(params: SamplingParams | None, max_new_tokens: int) -> SamplingParams:
    """The request's sampling parameters (``None`` is greedy), once ``max_new_tokens`` is valid;
    idempotent."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    return GREEDY if params is None else params


def uses_penalties(params: SamplingParams, batch: int, vocab: int) -> bool:
    """Whether any row applies a repetition, presence or frequency penalty."""
    r = params.unconstrained().resolve(batch, vocab)
    return bool((r.repetition_penalty != 1).any() or (r.presence_penalty != 0).any()
                or (r.frequency_penalty != 0).any())


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int,
             vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)``, both int64 ``[B, longest]``, prompts right-aligned. Every id
    must be an integer (not a bool) in ``[0, vocab_size)`` (``[0, 2**63)`` when ``vocab_size``
    is ``None``); otherwise ``ValueError`` names the prompt."""
    if not prompts:
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    rows = [_prompt_ids(b, p, vocab_size) for b, p in enumerate(prompts)]
    longest = max(r.numel() for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, longest - r.numel():] = r
        mask[b, longest - r.numel():] = 1
    return ids, mask


def _prompt_ids(b: int, prompt: Sequence[int], vocab_size: int | None) -> torch.Tensor:
    """Prompt ``b`` as int64 ids; a non-integer id is an error, never truncated."""
    if isinstance(prompt, torch.Tensor):
        integral = prompt.dim() == 1 and not (prompt.is_floating_point() or prompt.is_complex()
                                              or prompt.dtype == torch.bool)
        values = prompt.tolist()
    else:
        try:
            values = list(prompt)
        except TypeError:
            raise ValueError(f"prompt {b}: expected a sequence of token ids, "
                             f"got {type(prompt).__name__}") from None
        integral = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values)
    if not integral:
        raise ValueError(f"prompt {b}: token ids must be integers, got {prompt!r:.100}")
    if len(values) == 0:
        raise ValueError(f"prompt {b} is empty: prompts must be non-empty token id lists")
    limit = 2**63 if vocab_size is None else vocab_size
    if not all(0 <= v < limit for v in values):
        raise ValueError(f"prompt {b}: token ids must be in [0, {limit}), got {prompt!r:.100}")
    return torch.as_tensor(values, dtype=torch.long)


def pad_id(config: object) -> int:
    """The id placed in left padding (masked out, so its value never reaches a real position;
    it only has to be a valid id)."""
    vocab = getattr(config, "vocab_size", None)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None and 0 <= int(value) < (vocab or int(value) + 1):
            return int(value)
    return 0


# ---------------------------------------------------------------------- the KV stream
class KVStream:
    """One model body's KV cache over a batch whose rows advance in lockstep: entries in storage
    order, an attention mask in which left padding (and, when speculating, rejected drafts) are
    holes, and explicit logical positions, so each row attends exactly to its own tokens."""

    def __init__(self, body: nn.Module, embed: nn.Module, batch: int, device: torch.device) -> None:
        self.body, self.embed, self.cache = body, embed, None
        # the KV cache argument is ``cache`` in recent transformers, ``past_key_values`` before
        self.key = "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)

    def feed(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[B, T, H]`` of ``ids`` ``[B, T]`` at logical ``positions``; entries where
        ``valid`` is False are holes from the start."""
        self.mask = torch.cat([self.mask, valid.long()], 1)
        result = self.body(inputs_embeds=self.embed(ids), attention_mask=self.mask, position_ids=positions,
                           use_cache=True, **{self.key: self.cache})
        self.cache = getattr(result, self.key)
        return result.last_hidden_state

    def drop(self, holes: torch.Tensor) -> None:
        """Make the last ``holes.shape[1]`` entries holes where ``holes`` (``[B, T]``) is True."""
        if holes.shape[1]:
            self.mask[:, -holes.shape[1]:] *= (~holes).long()


def last_rows(states: torch.Tensor) -> torch.Tensor:
    """The hidden state of every sequence's last position, ``[B, H]``."""
    B, T, H = states.shape
    return select_rows(states.reshape(-1, H), seq_lens=torch.full((B,), T, device=states.device))


# ---------------------------------------------------------------------- the step
def can_verify(strategy: str) -> bool:
    """Whether speculative decoding runs with ``strategy``: on shards (:func:`verify`), or where
    every rank ends with the full logits of every row (gather-then-verify); ``auto`` chooses
    between the two."""
    if strategy == AUTO:
        return True
    s = STRATEGIES[strategy]
    return s.on_shards or s.ids is None


def planned_sampling(params: SamplingParams, batch: int, vocab: int) -> plan.Sampling:
    """The planner's view of a batch's sampling: greedy when every row is; else each filter's
    costliest value over the sampled rows (:func:`vocabpar.wire.filters.strictest`; resolving
    turns a top-k of -1 into 0).
    Computed on the host from the parameters alone."""
    r = params.resolve(batch, vocab)
    sampled = ~r.greedy
    return strictest({f.name: getattr(r, f.name)[sampled].tolist() for f in FILTERS})


class Samplers:
    """The engine ``Sampler`` of each call size a decode loop meets, built on first use (every
    rank meets the same sizes in the same order, so their construction handshakes align)."""

    def __init__(self, layout: VocabLayout, group: comm.ProcessGroup = None) -> None:
        self.layout, self.group = layout, group
        self._by_rows: dict[int, Sampler] = {}

    def get(self, rows: int) -> Sampler:
        """The sampler whose messages carry exactly ``rows`` rows (what the planner prices)."""
        if rows not in self._by_rows:
            self._by_rows[rows] = Sampler(self.layout, max_rows=rows, group=self.group)
        return self._by_rows[rows]


@dataclass(frozen=True)
class Step:
    """Hidden rows -> logits collected by ``strategy`` (:data:`STRATEGIES`) over ``group`` ->
    sampled or verified ids. Every method's result is the same on every rank of ``group``."""

    head: ParallelLMHead
    layout: VocabLayout
    strategy: str
    group: comm.ProcessGroup = None
    scatter: str = "all_to_all"
    switch: plan.Switch | None = None
    engine: Samplers | None = None

    def resolved(self, rows: int, params: SamplingParams, *, spec_tokens: int = 0,
                 draft_logits: bool = False) -> Step:
        """This step with ``auto`` replaced by the planner's choice for ``rows`` rows sampled with
        ``params`` (verifying ``spec_tokens`` drafts per row when > 0): ``all_gather`` below the
        crossover batch, ``none`` (sampling on shards) from it on. Every input is replicated, so
        every rank chooses the same. Any other strategy is returned unchanged."""
        if self.strategy != AUTO:
            return self
        vocab, n = self.layout.vocab_size, comm.world_size(self.group)
        switch = self.switch or plan.Switch()
        w = switch.workload(vocab, self.head.hidden_size, n, rows, planned_sampling(params, rows, vocab),
                            pad_to=self.layout.pad_to, spec_tokens=spec_tokens, draft_logits=draft_logits)
        return replace(self, strategy=switch.strategy(w, "verify" if spec_tokens else "decode"))

    def next_tokens(self, hidden: torch.Tensor, params: SamplingParams, positions: torch.Tensor,
                    counts: TokenCounts | None, output_lens: torch.Tensor | None = None) -> torch.Tensor:
        """One id per row of ``hidden`` ``[B, H]``: sampled on shards, or each rank samples the
        rows whose full logits the strategy leaves it (``owns``), then the ids are shared.
        ``output_lens``: the tokens each row has produced (``min_tokens``)."""
        if self.strategy == AUTO:
            return self.resolved(hidden.shape[0], params).next_tokens(hidden, params, positions, counts,
                                                                      output_lens)
        s = STRATEGIES[self.strategy]
        B, n, me = hidden.shape[0], comm.world_size(self.group), comm.rank(self.group)
        if s.on_shards:
            return self.draw(self.logits(hidden), params, positions, counts, output_lens)
        owned = [s.owns(B, n, r) for r in range(n)]  # each rank samples the rows it ends with
        mine = slice(owned[me].start, owned[me].stop)
        if s.inputs == "own":  # DP attention: each rank stands for one group holding its rows
            rows = hidden[mine]
        elif s.inputs == "blocks":  # equal blocks of ceil(B/n) rows; zero rows fill the tail
            rows = hidden.new_zeros(-(-B // n) * n, hidden.shape[1])
            rows[:B] = hidden
        else:
            rows = hidden
        full = compute_logits(self.head, rows, strategy=s.name, group=self.group, scatter=self.scatter)
        tokens = None if full is None else sample_rows(full[: len(owned[me])], params, positions, counts,
                                                       mine, output_lens)
        if s.ids is None:
            return tokens
        with comm.booked_as("sampled_ids"):
            if s.ids == "broadcast":
                return broadcast_tokens(tokens, B, src=0, group=self.group)
            return torch.cat(comm.all_gather_uneven(tokens, [len(r) for r in owned], self.group))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """FP32 logits of ``hidden`` rows: this rank's shard, or the full rows (strategies that
        pass :func:`can_verify`, where every rank ends with every row)."""
        result = compute_logits(self.head, hidden, strategy=self.strategy, group=self.group)
        return result.logits if STRATEGIES[self.strategy].on_shards else result

    def draw(self, logits: torch.Tensor, params: SamplingParams, positions: torch.Tensor,
             counts: TokenCounts | None = None, output_lens: torch.Tensor | None = None) -> torch.Tensor:
        """One id per row of :meth:`logits`: the sharded sampler (the engine ``Sampler`` when this
        step has one), or the single-device one."""
        if STRATEGIES[self.strategy].on_shards and self.engine is not None:
            sampler = self.engine.get(logits.shape[0])
            out = sampler.sample(logits, sampler.prepare(params, positions=positions, token_counts=counts,
                                                         output_lens=output_lens))
            out.raise_if_failed()
            return out.tokens
        if STRATEGIES[self.strategy].on_shards:
            return sample(logits, self.layout, params, positions=positions, group=self.group,
                          token_counts=counts, output_lens=output_lens).tokens
        return reference_sample(logits, params, positions=positions, token_counts=counts,
                                output_lens=output_lens).tokens

    def verify(self, logits: torch.Tensor, params: SamplingParams, drafts: torch.Tensor,
               positions: torch.Tensor, draft_logits: torch.Tensor | None) -> VerifyOutput:
        """Verify ``drafts`` against :meth:`logits` ``[B, k+1, ...]``: on shards; or
        gather-then-verify: the full rows every rank holds, verified locally as a replicated
        layout (no collective; the same tokens as ``reference_verify``)."""
        layout, group = self.layout, self.group
        if STRATEGIES[self.strategy].on_shards and self.engine is not None:
            B, k = drafts.shape
            greedy = params.unconstrained().resolve(B, layout.vocab_size).greedy  # host-side
            drafted = draft_logits is not None and not bool(greedy.all())  # every row's drafts join then
            sampler = self.engine.get(B * (k + 1 + k * drafted))  # the stacked rows
            out = sampler.verify(logits, sampler.prepare(params, positions=positions), drafts, draft_logits)
            out.raise_if_failed()
            return out
        if not STRATEGIES[self.strategy].on_shards:
            layout, group = VocabLayout(layout.vocab_size, layout.world_size, scheme="replicated"), None
        return verify_drafts(logits, layout, params, drafts, positions=positions, draft_logits=draft_logits,
                             group=group)


def sample_rows(full: torch.Tensor, params: SamplingParams, positions: torch.Tensor,
                counts: TokenCounts | None, rows: slice,
                output_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Reference-sample the logits ``full`` of batch rows ``rows`` (per-row values sliced, a
    row's seed the one it has in the batch)."""
    if full.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=full.device)
    index = torch.arange(rows.start, rows.stop)
    part = params.take(positions.shape[0], full.shape[1], index)
    return reference_sample(full, part, positions=positions[rows],
                            token_counts=None if counts is None else counts.select(rows),
                            output_lens=None if output_lens is None else output_lens[rows]).tokens
