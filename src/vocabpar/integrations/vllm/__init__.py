"""vocabpar inside vLLM: the decode step samples on the tensor-parallel group's vocabulary shards.

vLLM loads this module through its ``vllm.general_plugins`` entry point in every process, workers
included, and calls :func:`register`. The plugin is off unless switched on, by ``VOCABPAR_VLLM=1``
in the environment or ``additional_config={"vocabpar": {...}}`` (:class:`Settings`); when on, on
vLLM's V1 model runner:

1. the decode step's ``compute_logits`` keeps each rank's shard of the LM head's output (prompt
   logprobs, drafters and warm-up runs keep vLLM's gathered logits);
2. the structured-output bitmask, which vLLM would apply to the logits it holds, is kept for the
   sampler instead (applied to a shard, xgrammar would read the first bits on every rank);
3. ``_sample`` is served by a :class:`vocabpar.Sampler` on the TP group, returning vLLM's
   ``SamplerOutput`` identical on every rank -- or, for a step holding a request the sampler does
   not serve exactly, by gathering the shards and calling vLLM's own sampler (counted, one log
   line per cause). :mod:`vocabpar.integrations.vllm.step` says what is served and how.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from typing import Any

from vocabpar.integrations.vllm.step import SUPPORTED_VERSIONS, Settings, ShardedSampling, log

ENV = "VOCABPAR_VLLM"
"""``1`` switches the plugin on for every engine of the process (its workers inherit it)."""

_CURRENT: contextvars.ContextVar[ShardedSampling | None] = contextvars.ContextVar("vocabpar_step",
                                                                                 default=None)
_HOOKED: set[str] = set()


def settings_of(vllm_config: Any) -> Settings | None:
    """The plugin's settings for an engine, ``None`` when it is not switched on. Bad settings
    raise ``ValueError`` naming the key."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    given = extra.get("vocabpar") if isinstance(extra, dict) else None
    if given is None:
        return Settings() if os.environ.get(ENV, "") not in ("", "0") else None
    if not isinstance(given, dict):
        raise ValueError(f"vocabpar: additional_config['vocabpar'] must be a dict, got {given!r}")
    settings = Settings.of(given)
    return settings if settings.enabled else None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: on a vLLM release it was tested with, wraps the
    V1 runner's ``execute_model`` so that each runner decides, at its first step, whether the
    plugin is on for it (nothing else of vLLM changes until one does); on any other release it
    changes nothing, and says so when ``VOCABPAR_VLLM`` asks for it."""
    import vllm

    if vllm.__version__ not in SUPPORTED_VERSIONS:
        if os.environ.get(ENV, "") not in ("", "0"):
            log.warning("vocabpar: vLLM %s is not one of the tested releases %s; the plugin stays off",
                        vllm.__version__, SUPPORTED_VERSIONS)
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap(GPUModelRunner, "execute_model", _execute_model)


def _wrap(owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)``, once per process."""
    key = f"{owner.__module__}.{owner.__qualname__}.{name}"
    if key not in _HOOKED:
        _HOOKED.add(key)
        setattr(owner, name, make(getattr(owner, name)))


def _execute_model(original: Callable) -> Callable:
    def execute_model(runner: Any, *args: Any, **kwargs: Any) -> Any:
        sampling = sampling_of(runner)
        if sampling is None:
            return original(runner, *args, **kwargs)
        sampling.begin_step()
        token = _CURRENT.set(sampling)
        try:
            return original(runner, *args, **kwargs)
        finally:
            sampling.end_forward()
            _CURRENT.reset(token)
    return execute_model


def sampling_of(runner: Any) -> ShardedSampling | None:
    """The runner's :class:`ShardedSampling`, built at its first step or first call here
    (``None``: the plugin is off for it). Building it is collective: every rank of the TP group
    calls this together (a worker's ``collective_rpc`` does)."""
    if "_vocabpar" not in vars(runner):
        runner._vocabpar = None
        settings = settings_of(runner.vllm_config)
        if settings is not None:
            runner._vocabpar = ShardedSampling.attach(runner, settings)
            if runner._vocabpar is not None:
                _install_step_hooks()
    return runner._vocabpar


def _install_step_hooks() -> None:
    """The hooks a switched-on runner needs: the LM head keeps its shard for the armed call, the
    grammar bitmask is held back, ``_sample`` goes to the sharded sampler."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap(LogitsProcessor, "_get_logits", _get_logits)
    _wrap(LogitsProcessor, "_gather_logits", _gather_logits)
    _wrap(GPUModelRunner, "sample_tokens", _sample_tokens)
    _wrap(GPUModelRunner, "_sample", _sample)
    key = "gpu_model_runner.apply_grammar_bitmask"
    if key not in _HOOKED:
        _HOOKED.add(key)
        held_back = _apply_grammar_bitmask(gpu_model_runner.apply_grammar_bitmask)
        gpu_model_runner.apply_grammar_bitmask = held_back


def _get_logits(original: Callable) -> Callable:
    def _get_logits(processor: Any, hidden_states: Any, lm_head: Any, embedding_bias: Any,
                    skip_gather: bool = False) -> Any:
        sampling = _CURRENT.get()
        if sampling is None or skip_gather or not sampling.claim():
            return original(processor, hidden_states, lm_head, embedding_bias, skip_gather)
        return original(processor, hidden_states, lm_head, embedding_bias, True)
    return _get_logits


def _gather_logits(original: Callable) -> Callable:
    def _gather_logits(processor: Any, logits: Any) -> Any:
        sampling = _CURRENT.get()
        if sampling is not None:
            sampling.count_gather(logits)
        return original(processor, logits)
    return _gather_logits


def _sample_tokens(original: Callable) -> Callable:
    def sample_tokens(runner: Any, *args: Any, **kwargs: Any) -> Any:
        token = _CURRENT.set(vars(runner).get("_vocabpar"))
        try:
            return original(runner, *args, **kwargs)
        finally:
            _CURRENT.reset(token)
    return sample_tokens


def _apply_grammar_bitmask(original: Callable) -> Callable:
    def apply_grammar_bitmask(scheduler_output: Any, grammar_output: Any, input_batch: Any,
                              logits: Any) -> None:
        sampling = _CURRENT.get()
        if sampling is None or not sampling.holds_shard:
            return original(scheduler_output, grammar_output, input_batch, logits)
        sampling.hold_grammar(original, scheduler_output, grammar_output)
    return apply_grammar_bitmask


def _sample(original: Callable) -> Callable:
    def _sample(runner: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        sampling = _CURRENT.get()
        if sampling is None or not sampling.holds_shard:
            return original(runner, logits, spec_decode_metadata)
        return sampling.sample(logits, lambda full: original(runner, full, spec_decode_metadata))
    return _sample
