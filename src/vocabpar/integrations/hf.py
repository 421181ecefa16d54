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
oracle. The loop's prologue and step live in :mod:`vocabpar.integrations.decode`; ``draft=``
hands the request to :mod:`vocabpar.integrations.speculative`, which never imports this module.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vocabpar import comm, plan
from vocabpar.collect import iter_logits
from vocabpar.embedding import VocabParallelEmbedding
from vocabpar.head import ParallelLMHead
from vocabpar.integrations.decode import (
    AUTO,
    Generation,
    Samplers,
    Step,
    last_rows,
    open_request,
    sample_rows,
    uses_penalties,
)
from vocabpar.integrations.speculative import speculative_generate
from vocabpar.layout import VocabLayout
from vocabpar.sampling import SamplingParams, TokenCounts
from vocabpar.sampling.scoring import TokenLogprobs, token_logprobs
from vocabpar.wire.scripts import SCORE_ROWS
from vocabpar.wire.strategies import STRATEGIES

NextTokens = Callable[[torch.Tensor, SamplingParams, torch.Tensor, TokenCounts | None, torch.Tensor],
                      torch.Tensor]
Scorer = Callable[[torch.Tensor, torch.Tensor], TokenLogprobs]  # (hidden rows, target ids) -> scores


@dataclass
class ParallelCausalLM:
    """A causal LM whose embedding and head are vocab-parallel over ``group`` (see
    :func:`parallelize`); ``strategy`` names how logits reach the sampler (``auto``: chosen per
    step by ``switch``'s prices)."""

    model: nn.Module
    embedding: VocabParallelEmbedding
    head: ParallelLMHead
    strategy: str
    group: comm.ProcessGroup = None
    scatter: str = "all_to_all"
    switch: plan.Switch | None = None
    engine: Samplers | None = None

    @property
    def layout(self) -> VocabLayout:
        return self.embedding.layout

    @property
    def step(self) -> Step:
        """This model's decode step: its head, layout, strategy, group, scatter and switch."""
        return Step(self.head, self.layout, self.strategy, self.group, self.scatter, self.switch,
                    self.engine)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None,
                 max_new_tokens: int = 16, *, prompt_logprobs: int | None = None, draft=None,
                 num_draft_tokens: int | None = None) -> Generation:
        """``max_new_tokens`` new tokens for every prompt (no stop tokens); ``params`` ``None``
        is greedy. Sampling is keyed on (seed, position, token id), so the tokens do not depend
        on the number of ranks or the strategy, nor, with per-row seeds, on the batch (a scalar
        seed gives each row its own, see ``SamplingParams``). ``prompt_logprobs=n``: also score
        every prompt's tokens 1.. (with the top ``n``) during the prefill, on the shards
        (:meth:`score`'s arithmetic); ``Generation.prompt_logprobs[b]`` holds prompt b's.
        ``draft`` and ``num_draft_tokens=k``: speculative decoding with ``k`` drafts per step from
        another :class:`ParallelCausalLM` or a ``PromptLookup``
        (:mod:`vocabpar.integrations.speculative`)."""
        if draft is not None or num_draft_tokens is not None:
            if prompt_logprobs is not None:
                raise ValueError("prompt_logprobs is not available with speculative decoding")
            return speculative_generate(self, prompts, params, max_new_tokens, draft, num_draft_tokens)
        scorer = None if prompt_logprobs is None else functools.partial(self._score_rows,
                                                                         top_n=prompt_logprobs)
        out = _decode(self.model, self.embedding, self.layout.vocab_size, self.step.next_tokens, prompts,
                      params, max_new_tokens, scorer)
        # the choice depends on the batch size and parameters alone: the same at every step
        chosen = self.step.resolved(len(prompts), params or SamplingParams(temperature=0.0)).strategy
        out.strategies = [chosen] * len(out.step_seconds)
        return out

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


def parallelize(model: nn.Module, *, group: comm.ProcessGroup = None, scheme: str = "padded",
                strategy: str = "all_gather", exchange: str = "auto", scatter: str = "all_to_all",
                deterministic: bool = False, switch: plan.Switch | None = None,
                sampler: str = "functional") -> ParallelCausalLM:
    """Replace ``model``'s input embedding and LM head (in place) by vocab-parallel modules over
    ``group`` laid out by ``scheme``, loading this rank's rows from the model's own weights.

    ``strategy``: one of :data:`vocabpar.wire.strategies.STRATEGIES` (``replicated`` needs
    ``scheme="replicated"``; ``none`` samples on sharded logits), or ``auto``: per step, the
    planner's choice between ``all_gather`` and ``none`` for that batch size and sampling at
    ``switch``'s prices (default :class:`vocabpar.plan.Switch`, the eager mode's), the same on
    every rank; ``auto`` needs a sharded scheme. ``exchange``: the embedding
    exchange. ``scatter``: how ``dp_gather_scatter`` returns rows (``all_to_all``, or SGLang's
    ``all_gather``; each rank then stands for one DP attention group holding a contiguous block
    of the batch).
    ``deterministic``: logits whose bits do not depend on the number of ranks (see
    :class:`ParallelLMHead`). ``sampler``: on shards, ``functional`` (:func:`vocabpar.sample`,
    adaptive) or ``engine`` (:class:`vocabpar.sampling.Sampler`: a fixed script per call size,
    no host read but the failure flags); the tokens are the same."""
    if sampler not in ("functional", "engine"):
        raise ValueError(f"sampler must be 'functional' or 'engine', got {sampler!r}")
    if strategy not in (*STRATEGIES, AUTO):
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {sorted(STRATEGIES) + [AUTO]}")
    if strategy == AUTO and scheme == "replicated":
        raise ValueError("strategy='auto' chooses between gathering and sampling on shards: it needs a "
                         "sharded scheme, not 'replicated'")
    if switch is not None and not isinstance(switch, plan.Switch):
        raise ValueError(f"switch must be a vocabpar.plan.Switch, got {type(switch).__name__}")
    if strategy != AUTO and STRATEGIES[strategy].replicated_only != (scheme == "replicated"):
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
    engine = Samplers(head.layout, group) if sampler == "engine" else None
    return ParallelCausalLM(model.eval(), embedding, head, strategy, group, scatter, switch, engine)


def reference_generate(model: nn.Module, prompts: Sequence[Sequence[int]],
                       params: SamplingParams | None = None, max_new_tokens: int = 16) -> Generation:
    """The single-device oracle: the same loop on the unmodified model, sampling its own
    ``lm_head`` logits (FP32) with :func:`reference_sample`."""
    lm_head = model.get_output_embeddings()

    def next_tokens(hidden, params, positions, counts, output_lens):
        return sample_rows(lm_head(hidden).float(), params, positions, counts, slice(0, hidden.shape[0]),
                           output_lens)

    return _decode(model.eval(), model.get_input_embeddings(), lm_head.weight.shape[0], next_tokens, prompts,
                   params, max_new_tokens)


# ---------------------------------------------------------------------- the loop
@torch.inference_mode()
def _decode(model: nn.Module, embed: nn.Module, vocab: int, next_tokens: NextTokens,
            prompts: Sequence[Sequence[int]], params: SamplingParams | None,
            max_new_tokens: int, scorer: Scorer | None = None) -> Generation:
    """``max_new_tokens`` steps of ``next_tokens`` over the left-padded prompts; each step feeds
    every row one token (the prefill: its prompt) and appends the one id every rank samples."""
    req = open_request(model, embed, vocab, prompts, params, max_new_tokens)
    params, ids, device, stream, out, B = req.params, req.ids, req.device, req.stream, req.out, len(prompts)
    position_ids, positions = req.position_ids, req.positions
    history: list[list[int]] = [[] for _ in range(B)]
    penalised = uses_penalties(params, B, vocab)
    inputs, valid = ids, req.mask.bool()
    for produced in range(max_new_tokens):
        before, start = comm.traffic(), time.perf_counter()
        states = stream.feed(inputs, position_ids, valid)
        if scorer is not None and not out.inputs:  # the prefill: score the prompts' own tokens
            out.prompt_logprobs = _score_prompts(scorer, states, ids, prompts)
        counts = TokenCounts.from_history(history, prompts) if penalised else None
        tokens = next_tokens(last_rows(states), params, positions, counts, torch.full((B,), produced))
        out.record(before, start, inputs)
        for b, t in enumerate(tokens.tolist()):
            out.tokens[b].append(t)
            history[b].append(t)
        inputs, valid = tokens.view(B, 1).to(device), torch.ones(B, 1, dtype=torch.bool, device=device)
        position_ids = position_ids[:, -1:] + 1
        positions = positions + 1
    return out


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
