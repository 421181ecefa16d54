"""Hugging Face causal LMs with a vocab-parallel embedding and LM head, and their decode loop.

:func:`parallelize` swaps a ``transformers`` causal LM's input embedding and LM head for a
:class:`VocabParallelEmbedding` and a :class:`ParallelLMHead` over a process group; each rank
keeps only its rows of the model's own matrices, and a tied head stays tied (it views the
embedding's storage). The transformer body is left untouched and runs replicated on every rank,
so every rank must hold the same model and be given the same prompts and parameters.

The decode loop left-pads the prompts into one batch, with the attention mask and position ids
``transformers``' ``generate`` builds, and per step runs: vocab-parallel lookup -> body with KV
cache (``inputs_embeds``) -> last row of every sequence -> logits step -> collection strategy and
the single-device sampler on the full rows the strategy gives this rank, or (``strategy="none"``)
the distributed sampler on the sharded logits; strategies that leave each rank only some rows
then share the sampled ids. Every rank returns the same tokens. :func:`reference_generate` runs
the same loop on the unmodified model (its own embedding and ``lm_head``): the single-device
oracle.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from vocabpar import comm
from vocabpar.collect import broadcast_tokens, compute_logits, iter_logits
from vocabpar.embedding import VocabParallelEmbedding
from vocabpar.head import ParallelLMHead, select_rows
from vocabpar.layout import VocabLayout
from vocabpar.sampling import SamplingParams, TokenCounts, reference_sample, sample
from vocabpar.sampling.params import ROW_FIELDS
from vocabpar.sampling.scoring import TokenLogprobs, token_logprobs
from vocabpar.wire.sampler import SCORE_ROWS
from vocabpar.wire.strategies import STRATEGIES

GREEDY = SamplingParams(temperature=0.0)

NextTokens = Callable[[torch.Tensor, SamplingParams, torch.Tensor, TokenCounts | None], torch.Tensor]
Scorer = Callable[[torch.Tensor, torch.Tensor], TokenLogprobs]  # (hidden rows, target ids) -> scores


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


@dataclass
class ParallelCausalLM:
    """A causal LM whose embedding and head are vocab-parallel over ``group`` (see
    :func:`parallelize`); ``strategy`` names how logits reach the sampler."""

    model: nn.Module
    embedding: VocabParallelEmbedding
    head: ParallelLMHead
    strategy: str
    group: comm.ProcessGroup = None
    scatter: str = "all_to_all"

    @property
    def layout(self) -> VocabLayout:
        return self.embedding.layout

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None,
                 max_new_tokens: int = 16, *, prompt_logprobs: int | None = None, draft=None,
                 num_draft_tokens: int | None = None) -> Generation:
        """``max_new_tokens`` new tokens for every prompt (no stop tokens); ``params`` ``None``
        is greedy. Sampling is keyed on (seed, position, token id), so the tokens do not depend
        on the number of ranks, the strategy or the batch. ``prompt_logprobs=n``: also score
        every prompt's tokens 1.. (with the top ``n``) during the prefill, on the shards
        (:meth:`score`'s arithmetic); ``Generation.prompt_logprobs[b]`` holds prompt b's.
        ``draft`` and ``num_draft_tokens=k``: speculative decoding with ``k`` drafts per step from
        another :class:`ParallelCausalLM` or a ``PromptLookup``
        (:mod:`vocabpar.integrations.speculative`)."""
        if draft is not None or num_draft_tokens is not None:
            from vocabpar.integrations.speculative import speculative_generate

            if prompt_logprobs is not None:
                raise ValueError("prompt_logprobs is not available with speculative decoding")
            return speculative_generate(self, prompts, params, max_new_tokens, draft, num_draft_tokens)
        scorer = None if prompt_logprobs is None else functools.partial(self._score_rows,
                                                                         top_n=prompt_logprobs)
        return _decode(self.model, self.embedding, self.layout.vocab_size, self._next_tokens, prompts, params,
                       max_new_tokens, scorer)

    @torch.inference_mode()
    def score(self, input_ids: torch.Tensor, *, top_n: int = 0,
              chunk_rows: int = SCORE_ROWS) -> TokenLogprobs:
        """Log-probabilities of ``input_ids`` (int64 ``[B, L]``, ``L >= 2``, no padding) under the
        model: fields ``[B, L - 1]`` (``top_*``: ``[B, L - 1, top_n]``) for the predictions of
        tokens 1..L-1. Logits are computed ``chunk_rows`` hidden rows at a time and never
        gathered, so no rank holds more than one ``[chunk_rows, V/n]`` block of them."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2 \
                or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids must be an int64 [B, L] tensor with L >= 2, got "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}"
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        B, L = input_ids.shape
        device = next(self.model.parameters()).device
        ids = input_ids.to(device)
        states = self.model.base_model(inputs_embeds=self.embedding(ids), use_cache=False).last_hidden_state
        hidden = states[:, :-1].reshape(B * (L - 1), states.shape[-1])
        scores = self._score_rows(hidden, ids[:, 1:].reshape(-1), top_n, chunk_rows)
        return scores.map(lambda t: t.reshape(B, L - 1, *t.shape[1:]))

    def _score_rows(self, hidden: torch.Tensor, targets: torch.Tensor, top_n: int,
                    chunk_rows: int = SCORE_ROWS) -> TokenLogprobs:
        """:func:`token_logprobs` of ``targets`` under the logits of ``hidden``, chunk by chunk."""
        parts = [token_logprobs(local, self.layout, targets[rows], top_n=top_n, group=self.group)
                 for rows, local in iter_logits(self.head, hidden, strategy="none", group=self.group,
                                                chunk_rows=chunk_rows)]
        return TokenLogprobs.concat(parts)

    def _next_tokens(self, hidden: torch.Tensor, params: SamplingParams, positions: torch.Tensor,
                     counts: TokenCounts | None) -> torch.Tensor:
        s = STRATEGIES[self.strategy]
        B, n, me = hidden.shape[0], comm.world_size(self.group), comm.rank(self.group)
        if s.on_shards:
            sharded = compute_logits(self.head, hidden, strategy=s.name, group=self.group)
            return sample(sharded.logits, self.layout, params, positions=positions, group=self.group,
                          token_counts=counts).tokens
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
        tokens = None if full is None else _sample_rows(full[: len(owned[me])], params, positions, counts,
                                                        mine)
        if s.ids is None:
            return tokens
        with comm.booked_as("sampled_ids"):
            if s.ids == "broadcast":
                return broadcast_tokens(tokens, B, src=0, group=self.group)
            return torch.cat(comm.all_gather_uneven(tokens, [len(r) for r in owned], self.group))


def parallelize(model: nn.Module, *, group: comm.ProcessGroup = None, scheme: str = "padded",
                strategy: str = "all_gather", exchange: str = "auto", scatter: str = "all_to_all",
                deterministic: bool = False) -> ParallelCausalLM:
    """Replace ``model``'s input embedding and LM head (in place) by vocab-parallel modules over
    ``group`` laid out by ``scheme``, loading this rank's rows from the model's own weights.

    ``strategy``: one of :data:`vocabpar.wire.strategies.STRATEGIES` (``replicated`` needs
    ``scheme="replicated"``; ``none`` samples on sharded logits). ``exchange``: the embedding
    exchange. ``scatter``: how ``dp_gather_scatter`` returns rows (``all_to_all``, or SGLang's
    ``all_gather``; each rank then stands for one DP attention group holding a contiguous block
    of the batch).
    ``deterministic``: logits whose bits do not depend on the number of ranks (see
    :class:`ParallelLMHead`)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {sorted(STRATEGIES)}")
    if STRATEGIES[strategy].replicated_only != (scheme == "replicated"):
        raise ValueError(f"strategy='replicated' goes with scheme='replicated' and only with it "
                         f"(got strategy={strategy!r}, scheme={scheme!r})")
    for key in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, key, None) not in (None, 1.0):
            raise ValueError(f"models with {key} are not supported")
    source, target = model.get_input_embeddings(), model.get_output_embeddings()
    # exact types: a subclass may change forward (Gemma scales its embedding output)
    if type(source) is not nn.Embedding or type(target) is not nn.Linear:
        raise TypeError(f"expected a plain nn.Embedding input embedding and nn.Linear LM head, got "
                        f"{type(source).__name__} and {type(target).__name__} (subclasses such as "
                        f"scaled embeddings are not supported)")
    weight = source.weight.detach()
    if tuple(target.weight.shape) != tuple(weight.shape):
        raise ValueError(f"LM head {tuple(target.weight.shape)} and embedding {tuple(weight.shape)} "
                         f"differ in shape")
    vocab, hidden = weight.shape
    layout = VocabLayout(vocab, comm.world_size(group), scheme=scheme)
    embedding = VocabParallelEmbedding(layout, hidden, group=group, dtype=weight.dtype, exchange=exchange,
                                       device=weight.device)
    embedding.load_full_weight(weight)
    tied = target.weight is source.weight
    head = ParallelLMHead(layout, hidden, group=group, dtype=weight.dtype, tie_to=embedding if tied else None,
                          bias=target.bias is not None, deterministic=deterministic, device=weight.device)
    if not tied:
        head.load_full_weight(target.weight.detach())
    if target.bias is not None:
        head.load_full_bias(target.bias.detach())
    model.set_input_embeddings(embedding)
    model.set_output_embeddings(head)
    return ParallelCausalLM(model.eval(), embedding, head, strategy, group, scatter)


def reference_generate(model: nn.Module, prompts: Sequence[Sequence[int]],
                       params: SamplingParams | None = None, max_new_tokens: int = 16) -> Generation:
    """The single-device oracle: the same loop on the unmodified model, sampling its own
    ``lm_head`` logits (FP32) with :func:`reference_sample`."""
    lm_head = model.get_output_embeddings()

    def next_tokens(hidden, params, positions, counts):
        return _sample_rows(lm_head(hidden).float(), params, positions, counts, slice(0, hidden.shape[0]))

    return _decode(model.eval(), model.get_input_embeddings(), lm_head.weight.shape[0], next_tokens, prompts,
                   params, max_new_tokens)


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


# ---------------------------------------------------------------------- the loop
@torch.inference_mode()
def _decode(model: nn.Module, embed: nn.Module, vocab: int, next_tokens: NextTokens,
            prompts: Sequence[Sequence[int]], params: SamplingParams | None,
            max_new_tokens: int, scorer: Scorer | None = None) -> Generation:
    params = checked_request(params, max_new_tokens)
    ids, mask = left_pad(prompts, pad_id(model.config), vocab)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as transformers' generate
    positions = torch.tensor([len(p) for p in prompts], device=device)  # of the token being sampled
    B = len(prompts)
    history: list[list[int]] = [[] for _ in range(B)]
    penalised = uses_penalties(params, B, vocab)
    out = Generation([[] for _ in range(B)], [], [], [])
    stream = KVStream(model.base_model, embed, B, device)
    inputs, valid = ids, mask.bool()
    for _ in range(max_new_tokens):
        before, start = comm.traffic(), time.perf_counter()
        states = stream.feed(inputs, position_ids, valid)
        if scorer is not None and not out.inputs:  # the prefill: score the prompts' own tokens
            out.prompt_logprobs = _score_prompts(scorer, states, ids, prompts)
        counts = TokenCounts.from_history(history, prompts) if penalised else None
        tokens = next_tokens(last_rows(states), params, positions, counts)
        out.record(before, start, inputs)
        for b, t in enumerate(tokens.tolist()):
            out.tokens[b].append(t)
            history[b].append(t)
        inputs, valid = tokens.view(B, 1).to(device), torch.ones(B, 1, dtype=torch.bool, device=device)
        position_ids = position_ids[:, -1:] + 1
        positions = positions + 1
    return out


def checked_request(params: SamplingParams | None, max_new_tokens: int) -> SamplingParams:
    """The request's sampling parameters (``None`` is greedy), once ``max_new_tokens`` is valid."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    return GREEDY if params is None else params


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


def _score_prompts(scorer: Scorer, states: torch.Tensor, ids: torch.Tensor,
                   prompts: Sequence[Sequence[int]]) -> list[TokenLogprobs]:
    """Per prompt, the scores of its tokens 1.. from the prefill's (left-padded) hidden states."""
    longest = ids.shape[1]
    rows = [(b, j) for b, p in enumerate(prompts) for j in range(longest - len(p), longest - 1)]
    b, j = torch.tensor(rows, dtype=torch.long, device=ids.device).reshape(-1, 2).unbind(1)
    scores = scorer(states[b, j], ids[b, j + 1])
    ends = list(itertools.accumulate(len(p) - 1 for p in prompts))
    spans = [slice(end - len(p) + 1, end) for p, end in zip(prompts, ends)]
    return [scores.map(lambda t, span=span: t[span]) for span in spans]


def _sample_rows(full: torch.Tensor, params: SamplingParams, positions: torch.Tensor,
                 counts: TokenCounts | None, rows: slice) -> torch.Tensor:
    """Reference-sample the logits ``full`` of batch rows ``rows`` (per-row values sliced)."""
    if full.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=full.device)
    sliced = {name: torch.as_tensor(getattr(params, name))[rows] for name in ROW_FIELDS
              if torch.as_tensor(getattr(params, name)).dim() == 1}
    part = None if counts is None else counts.select(rows)
    return reference_sample(full, replace(params, **sliced), positions=positions[rows],
                            token_counts=part).tokens


def uses_penalties(params: SamplingParams, batch: int, vocab: int) -> bool:
    """Whether any row applies a repetition, presence or frequency penalty."""
    r = params.resolve(batch, vocab)
    return bool((r.repetition_penalty != 1).any() or (r.presence_penalty != 0).any()
                or (r.frequency_penalty != 0).any())


def _since(before: dict[str, comm.Counter], field: str) -> dict[str, int]:
    """Per collective kind, how much ``field`` (``received`` bytes or ``calls``) of this process's
    counters grew since ``before``; the safety exchanges (``comm.OVERHEAD``) are left out."""
    def prior(kind: str) -> int:
        return getattr(before[kind], field) if kind in before else 0

    return {kind: getattr(c, field) - prior(kind) for kind, c in comm.traffic().items()
            if kind not in comm.OVERHEAD and getattr(c, field) != prior(kind)}
