"""The main job: a Hugging Face causal LM generated through every vocabulary design on local ranks.

For each design of :data:`vocabpar.plan.DESIGNS` that runs on several ranks, every rank builds
the same seeded model from a config (no downloads), :func:`~vocabpar.integrations.hf.parallelize`
swaps in the design's layout, embedding exchange and logits collection, and the ranks generate
greedy and sampled continuations of one batch of prompts (:data:`MODES`). Each row of the result
compares the tokens with the single-process oracle
(:func:`~vocabpar.integrations.hf.reference_generate`, i.e. ``reference_sample`` with the same
seeds; greedy is also checked against ``transformers``' ``generate``), and the bytes a rank
received and the collectives it took part in per decode step (from ``vocabpar.comm``'s
counters) with the planner's prediction for the same shapes: exactly where the traffic does not
depend on the data, within its [typical, worst] range where it does (sampling on shards).
"""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import math
import os
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from vocabpar import comm, launch, plan, rss
from vocabpar.host_reads import counting
from vocabpar.integrations.decode import AUTO, can_verify, planned_sampling
from vocabpar.kernels.fused import SWITCH, compiling
from vocabpar.layout import VocabLayout
from vocabpar.plan.model import step_traffic, verify_step_traffic
from vocabpar.sampling import SamplingParams
from vocabpar.wire.strategies import STRATEGIES
from vocabpar.wire.traffic import Traffic

MODELS = ("gpt2", "llama", "qwen2")
FP32_BYTES = 4  # the demo models, their activations and the logits are FP32
SEED = 0
POSITIONS, MAX_PROMPT = 128, 8  # the models' position table; the longest prompt of make_prompts
# run_demo's accepted [low, high] per argument: ranks are local processes, and prompt plus new
# tokens must fit the position table
LIMITS: dict[str, tuple[int, int]] = {"ranks": (1, 64), "batch": (1, 256),
                                      "tokens": (2, POSITIONS - MAX_PROMPT), "length": (2, POSITIONS),
                                      "top_n": (0, 20)}


def build_model(name: str = "gpt2", seed: int = SEED):
    """A tiny seeded model with a real vocabulary: ``gpt2`` (50257, tied), ``llama`` (32001,
    untied) or ``qwen2`` (151665, tied). Same name and seed -> same weights in every process.
    A process builds each once and hands out copies (a build is 4-15× a copy); torch's global
    generator is left where a build leaves it."""
    model, generator_state = _built(name, seed)
    torch.set_rng_state(generator_state)
    return copy.deepcopy(model)


@functools.cache
def _built(name: str, seed: int):
    import transformers

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=POSITIONS, initializer_range=0.3)
    configs = {
        "gpt2": lambda: transformers.GPT2Config(vocab_size=50257, n_embd=64, n_layer=2, n_head=2,
                                                n_positions=POSITIONS, initializer_range=0.3),
        "llama": lambda: transformers.LlamaConfig(vocab_size=32001, tie_word_embeddings=False, **small),
        "qwen2": lambda: transformers.Qwen2Config(vocab_size=151665, tie_word_embeddings=True, **small),
    }
    if name not in configs:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(configs[name]())
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like our loop
    return model.eval(), torch.get_rng_state()


def build_draft(name: str = "gpt2", seed: int = SEED, noise: float = 0.05):
    """A draft model for :func:`build_model`'s: the same vocabulary, embedding and head, with
    every other weight matrix perturbed by Gaussian noise of ``noise`` times its own spread. A
    stand-in for a distilled draft (a randomly initialised model has no smaller model that agrees
    with it); greedy drafts agree with the target on roughly 55-70 % of tokens."""
    model = build_model(name, seed)
    keep = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and id(p) not in keep:
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return model


def make_prompts(batch: int, vocab: int, seed: int = SEED) -> list[list[int]]:
    """``batch`` prompts of 2..MAX_PROMPT random token ids (different lengths: exercises left padding)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(2, MAX_PROMPT))] for _ in range(batch)]


def sampling_params(batch: int) -> SamplingParams:
    """Sampled mode: temperature, top-k and top-p together, one seed per row."""
    return SamplingParams(temperature=0.9, top_k=200, top_p=0.95, seed=[1000 + b for b in range(batch)])


def decode_step(design: plan.Design, w: plan.Workload, owned: int) -> Traffic:
    """The planner's traffic for one decode step of ``design`` (:func:`vocabpar.plan.model.step_traffic`)
    whose ids' largest owner holds ``owned`` of them; the DP row counts carry the agreement
    record when the checks are on."""
    return step_traffic(design, w, owned=owned, checked=comm.checks_enabled())


def verify_step(design: plan.Design, w: plan.Workload, owned: int) -> Traffic:
    """The planner's traffic for one speculative step of ``design``'s target model
    (:func:`vocabpar.plan.model.verify_step_traffic`); the draft model's decoding is booked apart."""
    return verify_step_traffic(design, w, owned=owned)


@dataclass(frozen=True)
class Mode:
    """A way of decoding that the demo runs through every design that supports it:
    ``params(batch)``, the sampling parameters ``generate`` gets (``None``: greedy), and
    ``price(design, workload, owned)``, the planner's traffic for one decode step (``owned``: the
    largest owner's count of its ids). ``spec_tokens > 0``: speculative decoding with that many
    drafts per step from :func:`build_draft`'s model (run for the engines' gather-then-verify
    and for verification on shards: :data:`SPECULATIVE_DESIGNS`)."""

    name: str
    params: Callable[[int], SamplingParams | None]
    price: Callable[[plan.Design, plan.Workload, int], Traffic] = decode_step
    spec_tokens: int = 0

    def runs(self, design: plan.Design) -> bool:
        return not self.spec_tokens or (can_verify(design.strategy) and design.name in SPECULATIVE_DESIGNS)


SPEC_TOKENS = 3
SPECULATIVE_DESIGNS = ("vllm-all-gather", "vocabpar-sharded", "vocabpar-engine")  # gathering vs on shards
APART = ("sampled_ids", "draft")  # received bytes shown apart (ids) or left out (the draft's decoding)
MODES: tuple[Mode, ...] = (Mode("greedy", lambda batch: None), Mode("sampled", sampling_params),
                           Mode("spec-greedy", lambda batch: None, verify_step, SPEC_TOKENS),
                           Mode("spec-sampled", sampling_params, verify_step, SPEC_TOKENS))


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of ``transformers``' own ``generate`` on the left-padded batch."""
    from vocabpar.integrations.decode import left_pad, pad_id

    ids, mask = left_pad(prompts, pad_id(model.config))
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id(model.config))
    return out[:, ids.shape[1]:].tolist()


@dataclass
class Row:
    """One design in one mode, per decode step (prefill excluded), on the busiest rank: the bytes
    received (``measured``; the exchange of sampled ids apart, ``id_bytes``, as the planner
    leaves its bytes out) and the collectives taken part in, ids exchange included, as means
    over the steps, next to the planner's typical and worst predictions. ``planner_agrees``:
    every step's bytes and collectives lie within the planner's [typical, worst] range (equal
    to it where the traffic does not depend on the data)."""

    design: str
    engine: str
    mode: str
    equal: int
    rows: int
    measured: float
    predicted: float
    predicted_worst: float
    collectives: float
    collectives_predicted: float
    collectives_worst: float
    planner_agrees: bool
    id_bytes: float
    ms_per_step: float
    peak_rss_mib: float
    weights_mib: float
    acceptance: float | None = None  # speculative modes: accepted / proposed drafts
    strategy: str = ""  # the collection strategy the steps ran (vocabpar-auto: the planner's choice)
    host_reads: float = 0.0  # host reads of device values per step, the whole step (model included)

    @property
    def tokens_agree(self) -> bool:
        return self.equal == self.rows


@dataclass
class DemoResult:
    model: str
    vocab: int
    hidden: int
    tied: bool
    ranks: int
    batch: int
    tokens: int
    reference_ms_per_step: float
    rows: list[Row]

    @property
    def tokens_agree(self) -> bool:
        return all(r.tokens_agree for r in self.rows)

    @property
    def planner_agrees(self) -> bool:
        return all(r.planner_agrees for r in self.rows)

    def to_json(self) -> dict:
        rows = [asdict(r) | {"tokens_agree": r.tokens_agree} for r in self.rows]
        return asdict(self) | {"tokens_agree": self.tokens_agree, "planner_agrees": self.planner_agrees,
                               "rows": rows}


AUTO_DESIGN = plan.Design("vocabpar-auto", "vocabpar", "padded", "owner_gather", AUTO,
                          "strategy='auto': per step, the planner's choice between gathering and sampling on "
                          "shards (eager prices)")
"""The demo's row for ``strategy="auto"``; it is priced as the strategy it chose."""


def designs() -> list[plan.Design]:
    """The rows the demo runs: every multi-rank design, then ``strategy="auto"``."""
    return [d for d in plan.DESIGNS if not d.single_device] + [AUTO_DESIGN]


def run_demo(model: str = "gpt2", ranks: int = 4, batch: int = 4, tokens: int = 8,
             progress: bool = True) -> DemoResult:
    """Run every multi-rank design on ``ranks`` local gloo ranks and compare with the
    single-process oracle computed here first. Under torchrun ``ranks`` is the world size and
    each process reports what its own rank measured. Arguments outside ``LIMITS`` raise
    ``ValueError`` before any work."""
    _check_limits(ranks=ranks, batch=batch, tokens=tokens)
    if launch.under_torchrun():
        ranks = int(os.environ["WORLD_SIZE"])
    _say(progress, f"building {model} and the single-process reference ...")
    ref = reference(model, batch, tokens)
    per_rank = launch.run(rank_main, ranks, model, ref.prompts, tokens, progress, timeout=120,
                          run_timeout=600)
    return compare(ref, per_rank, ranks)


@dataclass(frozen=True)
class Reference:
    """The single-process side of a run: the model's shape, the prompts, each mode's tokens from
    the oracle, and the oracle loop's milliseconds per decode step."""

    model: str
    vocab: int
    hidden: int
    tied: bool
    prompts: list[list[int]]
    tokens: dict[str, list[list[int]]]
    ms_per_step: float


def reference(model: str, batch: int, tokens: int) -> Reference:
    """``batch`` seeded prompts for ``model`` and their ``tokens`` new tokens in every mode from
    the single-process oracle (greedy also checked against ``transformers``' ``generate``)."""
    from vocabpar.integrations.hf import parallelize, reference_generate

    reference_model = build_model(model)
    vocab, hidden = reference_model.get_input_embeddings().weight.shape
    tied = reference_model.get_input_embeddings().weight is reference_model.get_output_embeddings().weight
    prompts = make_prompts(batch, vocab)
    timed = reference_generate(reference_model, prompts, None, tokens)
    if timed.tokens != hf_generate(reference_model, prompts, tokens):
        raise RuntimeError("the reference loop disagrees with transformers' generate")
    outputs = {mode.name: reference_generate(reference_model, prompts, mode.params(batch), tokens).tokens
               for mode in MODES if not mode.spec_tokens}
    # speculative: gather-then-verify in one process (the full logits verified locally, which
    # tests pin to reference_verify)
    target = parallelize(build_model(model), strategy="all_gather")
    draft = parallelize(build_draft(model), strategy="all_gather")
    for mode in MODES:
        if mode.spec_tokens:
            outputs[mode.name] = target.generate(prompts, mode.params(batch), tokens, draft=draft,
                                                 num_draft_tokens=mode.spec_tokens).tokens
    return Reference(model, vocab, hidden, tied, prompts, outputs, 1e3 * _mean(timed.step_seconds[1:]))


def compare(ref: Reference, per_rank: list[list[dict]], ranks: int) -> DemoResult:
    """The demo's table from what the ``ranks`` ranks of a group measured (:func:`rank_main`;
    under torchrun only this rank's results), against the oracle and the planner."""
    rows = []
    for i, design in enumerate(designs()):
        layout = VocabLayout(ref.vocab, ranks, scheme=design.scheme)
        for mode in filter(lambda m: m.runs(design), MODES):
            runs = [r[i][mode.name] for r in per_rank]
            rows.append(_row(design, mode, runs, ref.tokens[mode.name], layout, ref.hidden))
    new_tokens = len(next(iter(ref.tokens.values()))[0])
    return DemoResult(ref.model, ref.vocab, ref.hidden, ref.tied, ranks, len(ref.prompts), new_tokens,
                      ref.ms_per_step, rows)


def rank_main(model_name: str, prompts: list[list[int]], tokens: int, progress: bool,
              group: comm.ProcessGroup = None) -> list[dict]:
    """On each rank of ``group``: every design generates in every mode it supports; per design,
    per mode what this rank measured (tokens, the ids fed per step, seconds, bytes received and
    collectives per step by kind, weight bytes, peak RSS, the draft acceptance rate). The
    sampler's passes run eager unless ``VOCABPAR_COMPILE=1``: a few rows per step, eleven
    compilations per process would cost more than they save."""
    with compiling(os.environ.get(SWITCH) == "1"):
        return _generate_all(model_name, prompts, tokens, progress, group)


def _generate_all(model_name: str, prompts: list[list[int]], tokens: int, progress: bool,
                  group: comm.ProcessGroup) -> list[dict]:
    todo = designs()
    total, runs = sum(m.runs(d) for d in todo for m in MODES), itertools.count(1)
    build_model(model_name)  # transformers imports the model's code on first use
    gc.freeze()  # what exists by now is never garbage: the collection before each run scans only the rest
    try:
        return [_generate_design(design, model_name, prompts, tokens, group,
                                 lambda what, name=design.name: _say(progress and comm.rank(group) == 0,
                                                                     f"[{next(runs)}/{total}] {name} {what}"))
                for design in todo]
    finally:
        gc.unfreeze()


def _generate_design(design: plan.Design, model_name: str, prompts: list[list[int]], tokens: int,
                     group: comm.ProcessGroup, say: Callable[[str], None]) -> dict:
    """:func:`_generate_all`'s measurements for one design, every mode it supports; ``say``
    reports each finished run."""
    from vocabpar.integrations.hf import parallelize

    exchange = "auto" if design.embedding == "local" else design.embedding
    options = dict(group=group, scheme=design.scheme, strategy=design.strategy, scatter="all_gather",
                   exchange=exchange, sampler="engine" if design.sampler == "engine" else "functional")
    lm = parallelize(build_model(model_name), **options)
    draft = None
    weights = lm.embedding.storage.nbytes + (0 if lm.head.storage is lm.embedding.storage
                                             else lm.head.storage.nbytes)
    result = {}
    for mode in filter(lambda m: m.runs(design), MODES):
        gc.collect()
        speculate = {}
        if mode.spec_tokens:
            draft = draft or parallelize(build_draft(model_name), **options)
            speculate = dict(draft=draft, num_draft_tokens=mode.spec_tokens)
        peak = rss.reset_peak()
        with counting() as reads:
            g = lm.generate(prompts, mode.params(len(prompts)), tokens, **speculate)
        result[mode.name] = {"tokens": g.tokens, "inputs": g.inputs, "seconds": g.step_seconds,
                             "received": g.step_received, "collectives": g.step_collectives,
                             "weights": weights, "peak_rss": rss.peak_bytes(peak),
                             "acceptance": g.acceptance_rate if mode.spec_tokens else None,
                             "strategies": g.strategies,
                             "host_reads": sum(reads.values()) / max(len(g.step_seconds), 1)}
        say(f"{mode.name}: {1e3 * _mean(g.step_seconds[1:]):.1f} ms/step")
    return result


def _row(design: plan.Design, mode: Mode, runs: list[dict], reference: list[list[int]],
         layout: VocabLayout, hidden: int) -> Row:
    batch = len(reference)
    if any(r["tokens"] != runs[0]["tokens"] for r in runs):
        raise RuntimeError(f"{design.name} {mode.name}: ranks returned different tokens")
    equal = sum(a == b for a, b in zip(runs[0]["tokens"], reference))
    decode = range(1, len(runs[0]["received"]))  # step 0 is the prefill

    def busiest(count: Callable[[dict, int], float]) -> list[float]:
        return [max(count(r, s) for r in runs) for s in decode]

    measured = busiest(lambda r, s: sum(v for k, v in r["received"][s].items() if k not in APART))
    ids = busiest(lambda r, s: r["received"][s].get("sampled_ids", 0))
    calls = busiest(lambda r, s: sum(v for k, v in r["collectives"][s].items() if k != "draft"))
    if design.strategy == AUTO:  # priced as what it chose, the same at every step
        design = replace(design, strategy=runs[0]["strategies"][-1])
    w = _workload(design, layout, hidden, batch, mode.params(batch), mode.spec_tokens)
    predicted = [mode.price(design, w, _largest_owner_count(layout, runs[0]["inputs"][s])) for s in decode]
    agrees = all(p.bytes <= m <= p.bytes_worst and p.collectives <= c <= p.collectives_worst
                 for m, c, p in zip(measured, calls, predicted))
    return Row(design.name, design.engine, mode.name, equal, batch, _mean(measured),
               _mean([p.bytes for p in predicted]), _mean([p.bytes_worst for p in predicted]), _mean(calls),
               _mean([p.collectives for p in predicted]), _mean([p.collectives_worst for p in predicted]),
               agrees, _mean(ids), 1e3 * max(_mean(r["seconds"][1:]) for r in runs),
               max(r["peak_rss"] for r in runs) / 2**20, runs[0]["weights"] / 2**20, runs[0]["acceptance"],
               design.strategy, max(r["host_reads"] for r in runs))


def _workload(design: plan.Design, layout: VocabLayout, hidden: int, batch: int,
              params: SamplingParams | None, spec_tokens: int = 0) -> plan.Workload:
    """The demo's shapes as a planner workload: FP32 activations and logits; a strategy whose
    ranks bring their own rows runs with one DP attention group per rank; speculative steps
    verify ``spec_tokens`` drafts with the draft's logits when sampling."""
    n = layout.world_size
    sampling = plan.Sampling() if params is None else planned_sampling(params, batch, layout.vocab_size)
    dp = n if STRATEGIES[design.strategy].inputs == "own" else 1
    return plan.Workload(layout.vocab_size, hidden, ranks=n, dp=dp, batch=batch, pad_to=layout.pad_to,
                         weight_dtype_bytes=FP32_BYTES, logits_dtype_bytes=FP32_BYTES, sampling=sampling,
                         spec_tokens=spec_tokens, draft_logits=spec_tokens > 0 and params is not None)


@dataclass
class ScoreResult:
    """Per-token scores of one prompt (``ids``) on ``ranks`` ranks: for tokens 1.. the log
    probability, rank and top-n under the sharded model, and ``reference`` (the single-process
    model's ``log_softmax``)."""

    model: str
    ranks: int
    ids: list[int]
    logprobs: list[float]
    token_ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    reference: list[float]
    tolerance: float = 1e-4

    @property
    def max_error(self) -> float:
        return max((abs(a - b) for a, b in zip(self.logprobs, self.reference)), default=0.0)

    @property
    def agrees(self) -> bool:
        return self.max_error <= self.tolerance

    @property
    def perplexity(self) -> float:
        return math.exp(-_mean(self.logprobs))


def run_score(model: str = "gpt2", ranks: int = 4, ids: list[int] | None = None, length: int = 16,
              top_n: int = 3) -> ScoreResult:
    """Score a prompt (``ids``, or ``length`` seeded random ids) with the model's embedding and head
    sharded over ``ranks`` local ranks (``lm.score``: no rank holds more than one chunk of
    ``[rows, V/n]`` logits), and with the single-process model for reference."""
    _check_limits(ranks=ranks, length=length, top_n=top_n)
    if launch.under_torchrun():
        ranks = int(os.environ["WORLD_SIZE"])
    reference_model = build_model(model)
    vocab = reference_model.get_input_embeddings().weight.shape[0]
    if ids is None:
        rng = random.Random(SEED)
        ids = [rng.randrange(vocab) for _ in range(length)]
    if not 2 <= len(ids) <= POSITIONS or any(isinstance(i, bool) or not isinstance(i, int)
                                             or not 0 <= i < vocab for i in ids):
        raise ValueError(f"ids must be 2..{POSITIONS} integers in [0, {vocab}), got {ids!r}")
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        logp = torch.log_softmax(reference_model(prompt).logits[0, :-1].double(), -1)
    reference = logp.gather(1, prompt[0, 1:, None])[:, 0].tolist()
    got = launch.run(_score_rank, ranks, model, ids, top_n, timeout=120)[0]
    return ScoreResult(model, ranks, ids, got.logprobs[0].tolist(), got.ranks[0].tolist(),
                       got.top_ids[0].tolist(), got.top_logprobs[0].tolist(), reference)


def _score_rank(model_name: str, ids: list[int], top_n: int):
    from vocabpar.integrations.hf import parallelize

    return parallelize(build_model(model_name), strategy="none").score(torch.tensor([ids]), top_n=top_n)


def _check_limits(**values: object) -> None:
    """``ValueError`` naming the first argument that is not an int within its ``LIMITS``."""
    for name, value in values.items():
        low, high = LIMITS[name]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")


def _largest_owner_count(layout: VocabLayout, ids: torch.Tensor) -> int:
    return int(torch.bincount(layout.owner(ids).flatten(), minlength=layout.world_size).max())


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _say(enabled: bool, text: str) -> None:
    if enabled:
        print(text, file=sys.stderr, flush=True)
