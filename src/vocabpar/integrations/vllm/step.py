"""One vLLM decode step sampled on vocabulary shards, or handed back to vLLM when it cannot be.

What is served on shards, exactly and identically on every rank: greedy and random sampling with
temperature, top-k, top-p, min-p (vLLM's order: min-p before top-p), repetition / presence /
frequency penalties (repetition over prompt and output, the others over the output, as vLLM),
``logit_bias``, ``allowed_token_ids``, ``min_tokens`` (its stop ids: the request's
``all_stop_token_ids``), top-n logprobs of the raw logits (vLLM's default ``raw_logprobs``) with
the sampled token's rank, per-request seeds, and structured output (xgrammar bitmasks). A step
holding any request that needs something else gathers the shards and runs vLLM's own sampler,
counted by cause (:data:`CAUSES`). Random draws are vocabpar's (a request's seed and its position), not vLLM's
generator's: the same seed gives the same tokens at any TP size, but not vLLM's tokens.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from vocabpar import comm
from vocabpar.layout import VocabLayout
from vocabpar.sampling import Sampler, SamplingParams, TokenCounts

log = logging.getLogger("vllm.vocabpar")  # under vLLM's logger, which vLLM configures
SUPPORTED_VERSIONS = ("0.32.0",)
"""The vLLM releases the plugin was tested with; on any other it stays off."""
MODES = ("shards", "gather")
"""``shards``: sample on shards where the step allows it; ``gather``: every step gathers and vLLM
samples (vLLM's own path, with the plugin's counters -- a baseline)."""
CAUSES = {
    "mode": "mode='gather' (vLLM samples every step)",
    "speculative": "speculative decoding (not wired yet)",
    "all_logprobs": "logprobs of the whole vocabulary (logprobs=-1)",
    "logprob_token_ids": "logprobs of chosen token ids",
    "logprobs_mode": "a logprobs_mode other than raw_logprobs",
    "grammar_logprobs": "logprobs asked by a structured-output request (vLLM masks them)",
    "bad_words": "bad_words",
    "thinking_budget": "a thinking-token budget",
    "custom_logitsprocs": "custom logits processors",
    "rows": "logits rows that are not one per request",
    "bitmask": "a grammar bitmask of another width",
    "flagged": "rows vocabpar flagged (NaN logits, or no token allowed)",
}
"""Why a step falls back to vLLM's sampler, by counter name."""


@dataclass(frozen=True)
class Settings:
    """``additional_config={"vocabpar": {...}}``: ``enabled`` (default True), ``mode`` (one of
    :data:`MODES`), ``check`` (fold the ranks' agreement check into the first collective),
    ``record`` (keep every sharded step's gathered logits and inputs, for tests: one more
    all-gather per step)."""

    enabled: bool = True
    mode: str = "shards"
    check: bool = True
    record: bool = False

    @classmethod
    def of(cls, given: dict) -> Settings:
        known = {f.name for f in fields(cls)}
        for key, value in given.items():
            if key not in known:
                raise ValueError(f"vocabpar: unknown setting {key!r} (known: {sorted(known)})")
            if key != "mode" and not isinstance(value, bool):
                raise ValueError(f"vocabpar: setting {key!r} must be true or false, got {value!r}")
        if given.get("mode", "shards") not in MODES:
            raise ValueError(f"vocabpar: mode must be one of {MODES}, got {given['mode']!r}")
        return cls(**given)


@dataclass
class Stats:
    """Per rank, since start: steps sampled on shards, steps vLLM sampled (by cause), the bytes
    this rank received for the logits of each, and gathers of the decode step's logits."""

    sharded_steps: int = 0
    fallback_steps: Counter = field(default_factory=Counter)
    sharded_bytes: int = 0
    gathered_bytes: int = 0
    step_gathers: int = 0


def column_ids(lm_head: Any) -> torch.Tensor:
    """The token id of each column of this rank's LM head shard in vLLM (-1: padding), from the
    head's own shard indices."""
    s = lm_head.shard_indices
    ids = torch.full((lm_head.num_embeddings_per_partition,), -1, dtype=torch.long)
    ids[: s.num_org_elements] = torch.arange(s.org_vocab_start_index, s.org_vocab_end_index)
    added = slice(s.num_org_elements_padded, s.num_org_elements_padded + s.num_added_elements)
    ids[added] = torch.arange(s.added_vocab_start_index, s.added_vocab_end_index)
    return ids


def layout_of(lm_head: Any, logits_processor: Any, tp_size: int, tp_rank: int) -> VocabLayout:
    """The :class:`VocabLayout` of vLLM's LM head; ``ValueError`` when the plugin cannot serve it."""
    if lm_head.num_added_embeddings:
        raise ValueError(f"an LM head with {lm_head.num_added_embeddings} added (LoRA) vocabulary rows")
    if logits_processor.org_vocab_size != lm_head.org_vocab_size:
        raise ValueError(f"logits over {logits_processor.org_vocab_size} ids from a head of "
                         f"{lm_head.org_vocab_size}")
    layout = VocabLayout(lm_head.num_embeddings, tp_size, org_vocab_size=lm_head.org_vocab_size,
                         pad_to=lm_head.padding_size)
    ours, theirs = layout.local_token_ids(tp_rank), column_ids(lm_head)
    if ours.shape != theirs.shape or not torch.equal(ours, theirs):
        raise ValueError(f"rank {tp_rank}'s columns differ: vLLM holds {theirs.shape[0]} columns, "
                         f"vocabpar's layout {layout.describe()} {ours.shape[0]}")
    return layout


def request_seed(seed: int | None, request_id: str, model_seed: int | None) -> int:
    """A request's sampling seed in ``[0, 2**63)``: its own seed, or one every rank derives alike
    from the request id and the engine's seed."""
    if seed is not None:
        return seed % 2**63
    digest = hashlib.blake2b(f"{model_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def fallback_cause(runner: Any, grammar_rows: bool) -> str | None:
    """Why vLLM must sample this step, by :data:`CAUSES` key; ``None`` when vocabpar serves it."""
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    served = (LogitBiasLogitsProcessor, MinPLogitsProcessor, MinTokensLogitsProcessor)  # from the requests

    metadata = runner.input_batch.sampling_metadata
    n = metadata.max_num_logprobs
    holder = metadata.thinking_budget_state_holder
    checks = [
        ("speculative", runner.speculative_config is not None),
        ("all_logprobs", n == -1),
        ("logprob_token_ids", bool(metadata.logprob_token_ids)),
        ("logprobs_mode", n is not None and runner.model_config.logprobs_mode != "raw_logprobs"),
        ("grammar_logprobs", n is not None and grammar_rows),
        ("bad_words", bool(metadata.bad_words_token_ids)),
        ("thinking_budget", holder is not None and holder.has_tracked_requests()),
    ]
    checks += [("custom_logitsprocs", True) for processor in metadata.logitsprocs.all
               if not isinstance(processor, served)]
    return next((cause for cause, applies in checks if applies), None)


def ordered_bitmask(req_ids: list[str], grammar_output: Any, words: int) -> torch.Tensor | None:
    """The grammar bitmask in the batch's row order (``-1``: every token allowed), int32
    ``[B, words]``; ``None`` when its width is not ``words``."""
    given = torch.from_numpy(grammar_output.grammar_bitmask)
    if given.shape[1] != words:
        return None
    at = {rid: i for i, rid in enumerate(grammar_output.structured_output_request_ids)}
    mask = torch.full((len(req_ids), words), -1, dtype=torch.int32)
    for b, rid in enumerate(req_ids):
        if rid in at:
            mask[b] = given[at[rid]]
    return mask


class ShardedSampling:
    """A runner's sampling on shards: a :class:`vocabpar.Sampler` on the TP group, the step's
    state (armed for one ``compute_logits``, the shard held, the grammar held back) and
    :class:`Stats`."""

    def __init__(self, runner: Any, settings: Settings, layout: VocabLayout, group: Any,
                 tp_rank: int) -> None:
        self.runner, self.settings, self.layout, self.tp_rank = runner, settings, layout, tp_rank
        self.tp_size = layout.world_size
        self.vocab_size = layout.vocab_size
        self.max_top_n = min(max(runner.model_config.max_logprobs, 0), self.vocab_size)
        self.sampler = Sampler(layout, max_rows=runner.scheduler_config.max_num_seqs,
                               max_top_n=self.max_top_n, group=group, check=settings.check)
        self.stats = Stats()
        self.records: list[dict[str, Any]] = []
        self.armed = self.holds_shard = False
        self.grammar: tuple[Callable, Any, Any] | None = None
        self._logged: set[str] = set()

    def configure(self, **changes: Any) -> Settings:
        """Change ``mode`` or ``record`` (as in :class:`Settings`) between steps; returns the new
        settings. Every rank of the group must make the same change."""
        if set(changes) - {"mode", "record"}:
            raise ValueError(f"vocabpar: only mode and record change after start, got {sorted(changes)}")
        self.settings = Settings.of({**vars(self.settings), **changes})
        return self.settings

    @classmethod
    def attach(cls, runner: Any, settings: Settings) -> ShardedSampling | None:
        """Build it for ``runner``, or say in one log line why the plugin stays off."""
        from vllm.distributed import get_pp_group, get_tp_group

        tp = get_tp_group()
        why = None
        if get_pp_group().world_size > 1:
            why = "pipeline parallelism is not supported"
        elif runner.is_pooling_model:
            why = "a pooling model samples nothing"
        if why is None:
            model = runner.get_model()
            try:
                layout = layout_of(model.lm_head, model.logits_processor, tp.world_size, tp.rank_in_group)
            except (AttributeError, ValueError) as e:
                why = f"the LM head is not one it serves: {e}"
        if why is not None:
            if tp.rank_in_group == 0:
                log.warning("vocabpar: switched on but staying off: %s", why)
            return None
        sampling = cls(runner, settings, layout, tp.device_group, tp.rank_in_group)
        if tp.rank_in_group == 0:
            log.info("vocabpar: on for TP group of %d (ranks %s), mode %s, layout %s, max_num_seqs %d",
                     tp.world_size, tp.ranks, settings.mode, layout.describe(), sampling.sampler.max_rows)
        return sampling

    # ------------------------------------------------------------------ the step's state
    def begin_step(self) -> None:
        """Arm the next ``compute_logits`` (the decode step's) to keep its shard."""
        self.armed, self.holds_shard, self.grammar = True, False, None

    def end_forward(self) -> None:
        self.armed = False

    def claim(self) -> bool:
        """True once per step, for the armed ``compute_logits``, when the shard is to be kept."""
        if not self.armed:
            return False
        self.armed = False
        if self.settings.mode == "gather":
            self._fallback("mode")
            return False
        self.holds_shard = True
        return True

    def hold_grammar(self, apply: Callable, scheduler_output: Any, grammar_output: Any) -> None:
        """Keep the step's grammar bitmask for the sampler (and vLLM's ``apply`` for a fallback)."""
        self.grammar = (apply, scheduler_output, grammar_output)

    def count_gather(self, shard: torch.Tensor) -> None:
        """Book a gather of the decode step's logits: what this rank receives of the others'
        shards."""
        self.stats.step_gathers += 1
        self.stats.gathered_bytes += shard.numel() * shard.element_size() * (self.tp_size - 1)

    def _fallback(self, cause: str) -> None:
        """Count a step vLLM samples; the first of each cause is logged on rank 0."""
        self.stats.fallback_steps[cause] += 1
        if cause not in self._logged and self.tp_rank == 0:
            self._logged.add(cause)
            log.info("vocabpar: steps with %s gather the logits and vLLM samples them", CAUSES[cause])

    # ------------------------------------------------------------------ sampling
    def sample(self, shard: torch.Tensor, vllm_sample: Callable[[torch.Tensor], Any]) -> Any:
        """The step's ``SamplerOutput``: from the sharded sampler, or from ``vllm_sample`` on the
        gathered logits when the step falls back."""
        self.holds_shard = False
        batch = self.runner.input_batch
        batch.update_async_output_token_ids()  # as vLLM's _sample does before penalties
        req_ids = list(batch.req_ids)
        bitmask, grammar_rows = None, False
        if self.grammar is not None:
            bitmask = ordered_bitmask(req_ids, self.grammar[2], math.ceil(self.vocab_size / 32))
            grammar_rows = any(rid in self.grammar[2].structured_output_request_ids for rid in req_ids)
        cause = fallback_cause(self.runner, grammar_rows)
        if cause is None and shard.shape[0] != len(req_ids):
            cause = "rows"
        if cause is None and self.grammar is not None and bitmask is None:
            cause = "bitmask"
        if cause is None:
            output = self._on_shards(shard, req_ids, bitmask)
            if output is not None:
                return output
            cause = "flagged"
        self._fallback(cause)
        self.count_gather(shard)
        full = self._gather(shard)
        if self.grammar is not None:
            apply, scheduler_output, grammar_output = self.grammar
            apply(scheduler_output, grammar_output, batch, full)
        return vllm_sample(full)

    def _on_shards(self, shard: torch.Tensor, req_ids: list[str], bitmask: torch.Tensor | None) -> Any:
        """The ``SamplerOutput`` of the sharded sampler, ``None`` when it flags a row. vLLM keeps
        every parameter within vocabpar's ranges, so ``prepare`` raising would be a bug: it
        raises alike on every rank, before any collective."""
        inputs = self._inputs(req_ids, bitmask)
        prepared = self.sampler.prepare(inputs["params"], positions=inputs["positions"],
                                        token_counts=inputs["token_counts"], bitmask=inputs["bitmask"],
                                        output_lens=inputs["output_lens"], device=shard.device)
        with comm.recording() as calls:
            out = self.sampler.sample(shard, prepared)
        host = out.to_host()  # the one copy of the ids, with the flags
        if bool(host.failures.failed().any()):
            return None
        self.stats.sharded_steps += 1
        self.stats.sharded_bytes += sum(received for _, received in calls)
        if self.settings.record:
            self.records.append({**inputs, "logits": self._gather(shard).cpu(), "tokens": host.tokens,
                                 "logprobs": host.logprobs, "top_ids": host.top_ids,
                                 "top_logprobs": host.top_logprobs, "ranks": host.ranks})
        return self._output(out, inputs["params"].logprobs is not None)

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The step's logits as vLLM would have gathered them: ``[B, vocab_size]``."""
        from vllm.distributed import tensor_model_parallel_all_gather

        full = tensor_model_parallel_all_gather(shard) if self.tp_size > 1 else shard
        return full[..., : self.vocab_size]

    def _inputs(self, req_ids: list[str], bitmask: torch.Tensor | None) -> dict[str, Any]:
        """The vocabpar inputs of the batch's rows, from vLLM's request states."""
        runner = self.runner
        batch = runner.input_batch
        params = [runner.requests[rid].sampling_params for rid in req_ids]
        metadata = batch.sampling_metadata
        model_seed = runner.model_config.seed
        penalised = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
                        for p in params)
        outputs = metadata.output_token_ids or [runner.requests[rid].output_token_ids for rid in req_ids]
        outputs = [list(o) for o in outputs[: len(req_ids)]]
        token_counts = None
        if penalised:
            prompts = [batch.token_ids_cpu[b, : batch.num_prompt_tokens[b]].tolist()
                       for b in range(len(req_ids))]
            token_counts = TokenCounts.from_history(outputs, prompts)
        V = self.vocab_size
        sampling = SamplingParams(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k if 0 < p.top_k < V else 0 for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            repetition_penalty=[p.repetition_penalty for p in params],
            presence_penalty=[p.presence_penalty for p in params],
            frequency_penalty=[p.frequency_penalty for p in params],
            seed=[request_seed(p.seed, rid, model_seed) for p, rid in zip(params, req_ids)],
            logprobs=metadata.max_num_logprobs, logprobs_of="raw", filter_order="vllm",
            logit_bias=[p.logit_bias or None for p in params],
            allowed_token_ids=[list(p.allowed_token_ids) if p.allowed_token_ids else None for p in params],
            min_tokens=[p.min_tokens for p in params],
            stop_token_ids=[sorted(p.all_stop_token_ids) or None for p in params])
        positions = torch.as_tensor(batch.num_tokens_no_spec[: len(req_ids)], dtype=torch.long)
        return {"params": sampling, "positions": positions, "token_counts": token_counts, "bitmask": bitmask,
                "output_lens": torch.tensor([len(o) for o in outputs], dtype=torch.long)}

    def _output(self, out: Any, with_logprobs: bool) -> Any:
        """vLLM's ``SamplerOutput`` of a sharded ``sample`` call: int32 ids ``[B, 1]``; with
        logprobs, ids and logprobs ``[B, n+1]`` (the sampled token first) and its rank."""
        from vllm.v1.outputs import LogprobsTensors, SamplerOutput

        tokens = out.tokens
        logprobs = None
        if with_logprobs:
            logprobs = LogprobsTensors(torch.cat([tokens[:, None], out.top_ids], 1).to(torch.int32),
                                       torch.cat([out.logprobs[:, None], out.top_logprobs], 1), out.ranks)
        return SamplerOutput(sampled_token_ids=tokens.to(torch.int32)[:, None], logprobs_tensors=logprobs)
