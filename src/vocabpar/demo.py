"""The main job: a Hugging Face causal LM generated through every vocabulary design on local ranks.

For each design of :data:`vocabpar.plan.DESIGNS` that runs on several ranks, every rank builds
the same seeded model from a config (no downloads), :func:`~vocabpar.integrations.hf.parallelize`
swaps in the design's layout, embedding exchange and logits collection, and the ranks generate
greedy and sampled continuations of one batch of prompts. Each row of the result compares the
tokens with the single-process oracle (greedy: ``transformers``' ``generate``; sampled:
:func:`~vocabpar.integrations.hf.reference_generate`, i.e. ``reference_sample`` with the same
seeds), and the bytes a rank received per decode step (from ``vocabpar.comm``'s counters) with
the planner's formulas for the same shapes.
"""

from __future__ import annotations

import gc
import math
import os
import random
import sys
from dataclasses import asdict, dataclass

import torch

from vocabpar import comm, launch, plan, rss
from vocabpar.layout import VocabLayout
from vocabpar.sampling import SamplingParams

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
    untied) or ``qwen2`` (151665, tied). Same name and seed -> same weights in every process."""
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
    return model.eval()


def make_prompts(batch: int, vocab: int, seed: int = SEED) -> list[list[int]]:
    """``batch`` prompts of 2..MAX_PROMPT random token ids (different lengths: exercises left padding)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(2, MAX_PROMPT))] for _ in range(batch)]


def sampling_params(batch: int) -> SamplingParams:
    """Sampled mode: temperature, top-k and top-p together, one seed per row."""
    return SamplingParams(temperature=0.9, top_k=200, top_p=0.95, seed=[1000 + b for b in range(batch)])


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of ``transformers``' own ``generate`` on the left-padded batch."""
    from vocabpar.integrations.hf import left_pad, pad_id

    ids, mask = left_pad(prompts, pad_id(model.config))
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id(model.config))
    return out[:, ids.shape[1]:].tolist()


@dataclass
class Row:
    """One design in one mode. Bytes are received by the busiest rank per decode step (prefill
    excluded); ``predicted`` is ``None`` where the planner has no formula (sharded sampling
    beyond greedy). ``id_bytes``: the exchange of sampled ids, which the planner leaves out."""

    design: str
    engine: str
    mode: str
    equal: int
    rows: int
    measured: float
    predicted: float | None
    id_bytes: float
    ms_per_step: float
    peak_rss_mib: float
    weights_mib: float

    @property
    def tokens_agree(self) -> bool:
        return self.equal == self.rows

    @property
    def bytes_agree(self) -> bool | None:
        return None if self.predicted is None else self.measured == self.predicted


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
    def bytes_agree(self) -> bool:
        return all(r.bytes_agree is not False for r in self.rows)

    def to_json(self) -> dict:
        rows = [asdict(r) | {"tokens_agree": r.tokens_agree, "bytes_agree": r.bytes_agree} for r in self.rows]
        return asdict(self) | {"tokens_agree": self.tokens_agree, "bytes_agree": self.bytes_agree,
                               "rows": rows}


def designs() -> list[plan.Design]:
    return [d for d in plan.DESIGNS if not d.single_device]


def run_demo(model: str = "gpt2", ranks: int = 4, batch: int = 4, tokens: int = 8,
             progress: bool = True) -> DemoResult:
    """Run every multi-rank design on ``ranks`` local gloo ranks and compare with the
    single-process oracle computed here first. Under torchrun ``ranks`` is the world size and
    each process reports what its own rank measured. Arguments outside ``LIMITS`` raise
    ``ValueError`` before any work."""
    _check_limits(ranks=ranks, batch=batch, tokens=tokens)
    from vocabpar.integrations.hf import reference_generate

    if launch.under_torchrun():
        ranks = int(os.environ["WORLD_SIZE"])
    _say(progress, f"building {model} and the single-process reference ...")
    reference_model = build_model(model)
    vocab, hidden = reference_model.get_input_embeddings().weight.shape
    tied = reference_model.get_input_embeddings().weight is reference_model.get_output_embeddings().weight
    prompts = make_prompts(batch, vocab)
    greedy_ref = hf_generate(reference_model, prompts, tokens)
    timed = reference_generate(reference_model, prompts, None, tokens)
    if timed.tokens != greedy_ref:
        raise RuntimeError("the reference loop disagrees with transformers' generate")
    sampled_ref = reference_generate(reference_model, prompts, sampling_params(batch), tokens).tokens
    del reference_model
    per_rank = launch.run(_rank_main, ranks, model, prompts, tokens, progress, timeout=120, run_timeout=600)
    rows = []
    for i, design in enumerate(designs()):
        layout = VocabLayout(vocab, ranks, scheme=design.scheme)
        for mode, reference in (("greedy", greedy_ref), ("sampled", sampled_ref)):
            runs = [r[i][mode] for r in per_rank]
            rows.append(_row(design, mode, runs, reference, layout, hidden))
    return DemoResult(model, vocab, hidden, tied, ranks, batch, tokens,
                      1e3 * _mean(timed.step_seconds[1:]), rows)


def _rank_main(model_name: str, prompts: list[list[int]], tokens: int, progress: bool) -> list[dict]:
    from vocabpar.integrations.hf import parallelize

    out, todo = [], designs()
    for i, design in enumerate(todo):
        model = build_model(model_name)
        lm = parallelize(model, scheme=design.scheme, collect=design.collection, scatter="all_gather",
                         exchange="auto" if design.embedding == "local" else design.embedding)
        weights = lm.embedding.storage.nbytes + (0 if lm.head.storage is lm.embedding.storage
                                                 else lm.head.storage.nbytes)
        result = {}
        for mode, params in (("greedy", None), ("sampled", sampling_params(len(prompts)))):
            gc.collect()
            peak = rss.reset_peak()
            g = lm.generate(prompts, params, tokens)
            result[mode] = {"rank": comm.rank(), "tokens": g.tokens, "inputs": g.inputs,
                            "seconds": g.step_seconds, "received": g.step_received, "weights": weights,
                            "peak_rss": rss.peak_bytes(peak)}
            _say(progress and comm.rank() == 0,
                 f"[{2 * i + len(result)}/{2 * len(todo)}] {design.name} {mode}: "
                 f"{1e3 * _mean(g.step_seconds[1:]):.1f} ms/step")
        out.append(result)
        del lm, model
    return out


def _row(design: plan.Design, mode: str, runs: list[dict], reference: list[list[int]],
         layout: VocabLayout, hidden: int) -> Row:
    batch = len(reference)
    if any(r["tokens"] != runs[0]["tokens"] for r in runs):
        raise RuntimeError(f"{design.name} {mode}: ranks returned different tokens")
    equal = sum(a == b for a, b in zip(runs[0]["tokens"], reference))
    measured, predicted, ids = [], [], []
    for r in runs:
        steps = r["received"][1:]  # decode steps; step 0 is the prefill
        measured.append(_mean([sum(v for k, v in s.items() if k != "sampled_ids") for s in steps]))
        ids.append(_mean([s.get("sampled_ids", 0) for s in steps]))
        predicted.append(_predicted(design, mode, layout, hidden, batch, r["inputs"][1:]))
    return Row(design.name, design.engine, mode, equal, batch, max(measured),
               None if None in predicted else max(predicted), max(ids),
               1e3 * max(_mean(r["seconds"][1:]) for r in runs),
               max(r["peak_rss"] for r in runs) / 2**20, runs[0]["weights"] / 2**20)


def _predicted(design: plan.Design, mode: str, layout: VocabLayout, hidden: int, batch: int,
               inputs: list[torch.Tensor]) -> float | None:
    """Mean bytes per decode step a rank receives, by the planner's formulas, for the ids fed to
    the embedding at each decode step (owner gather: blocks padded to the largest owner's count)."""
    n, b = layout.world_size, FP32_BYTES
    if design.collection == "none":
        if mode != "greedy":
            return None
        collection = plan.greedy_sampling_bytes(batch, n)
    else:
        collection = plan.logits_collection_bytes(design.collection, batch, layout.vocab_size, n, b,
                                                  scheme=design.scheme, pad_to=layout.pad_to)
    dp = n if design.collection == "dp_gather_scatter" else 1
    hidden_rows = 0 if design.scheme == "replicated" else plan.hidden_gather_bytes(
        batch, dp, hidden, b, checked=comm.checks_enabled())
    per_step = [plan.embedding_exchange_bytes(design.embedding, batch, hidden, n, b,
                                              owned=_largest_owner_count(layout, x))
                + hidden_rows + collection for x in inputs]
    return _mean(per_step)


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

    return parallelize(build_model(model_name), collect="none").score(torch.tensor([ids]), top_n=top_n)


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


def plot(result: DemoResult, path: str) -> str:
    """Write a PNG of the demo's measurements: bytes received per rank per decode step (with the
    planner's prediction) and milliseconds per step, one bar per design and mode. Returns the
    path written (see ``vocabpar.plan.png_path``)."""
    plan.png_path(path)  # a bad name fails before any work
    plt = plan.pyplot()
    labels = [f"{r.design} ({r.mode})" for r in result.rows]
    where = list(range(len(labels)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.4 * len(labels) + 1.5), sharey=True)
    left.barh(where, [max(r.measured, 1) for r in result.rows], label="measured (vocabpar.comm)")
    for i, r in enumerate(result.rows):
        if r.measured == 0:  # log axis: a zero-byte design gets a label instead of a bar
            left.text(1.2, i, "0 B: no collective", va="center", fontsize=8)
    predicted = [(i, r.predicted) for i, r in enumerate(result.rows) if r.predicted]
    left.scatter([p for _, p in predicted], [i for i, _ in predicted], color="black", marker="|", s=200,
                 label="planner", zorder=3)
    left.set(xscale="log", xlabel="bytes received per rank per decode step", yticks=where, yticklabels=labels)
    left.legend(fontsize=8)
    right.barh(where, [r.ms_per_step for r in result.rows], color="tab:orange")
    right.set(xlabel="ms per decode step")
    fig.suptitle(f"{result.model}: vocab {result.vocab}, {result.ranks} gloo ranks, batch {result.batch}")
    for ax in (left, right):
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return plan.save_png(fig, path)
