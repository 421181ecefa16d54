import dataclasses

import pytest
import torch

from vocabpar import ParallelLMHead, SamplingParams, VocabParallelEmbedding
from vocabpar.demo import MODELS, build_model, hf_generate
from vocabpar.launch import run

pytest.importorskip("transformers")
from vocabpar.integrations.hf import parallelize, reference_generate  # noqa: E402

PROMPTS = [[5, 17, 300, 42, 9], [7, 8], [1000, 2, 31999]]  # different lengths: left padding
TOKENS = 3
SAMPLED = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, presence_penalty=0.5, seed=[11, 12, 13],
                         logit_bias=[{5: 3.0, 6: -2.0}, None, {9: 2.5}],
                         allowed_token_ids=[None, list(range(0, 32000, 7)), None], min_tokens=[2, 0, 3],
                         stop_token_ids=[list(range(1, 32000, 2)), None, list(range(0, 32000, 3))])
"""Sampled with request constraints: a bias, allowed ids, half and a third of the vocabulary held
back as stop ids for the first tokens."""
# (scheme, strategy for greedy, strategy for sampled, exchange); each (ranks, model) takes one, so
# every pair runs at some rank count > 1
PAIRS = [("padded", "all_gather", "none", "auto"), ("padded", "gather", "dp_gather_scatter", "all_reduce"),
         ("padded", "all_to_all", "gather", "owner_gather"), ("uneven", "all_gather", "none", "auto"),
         ("replicated", "replicated", "replicated", "auto"), ("padded", "none", "all_to_all", "owner_gather"),
         ("uneven", "dp_gather_scatter", "all_gather", "all_reduce")]


@pytest.fixture(scope="module")
def references():
    """Per model: (transformers' greedy generate, reference_generate sampled), single process."""
    out = {}
    for name in MODELS:
        model = build_model(name)
        greedy = hf_generate(model, PROMPTS, TOKENS)
        assert reference_generate(model, PROMPTS, None, TOKENS).tokens == greedy
        out[name] = (greedy, reference_generate(model, PROMPTS, SAMPLED, TOKENS).tokens)
    return out


def _generate_every_model(references):
    from vocabpar import comm

    n, failures = comm.world_size(), []
    for i, name in enumerate(MODELS):
        scheme, greedy_strategy, sampled_strategy, exchange = PAIRS[(3 * n + i) % len(PAIRS)]
        lm = parallelize(build_model(name), scheme=scheme, strategy=greedy_strategy, exchange=exchange)
        greedy = lm.generate(PROMPTS, None, TOKENS).tokens
        sampled = dataclasses.replace(lm, strategy=sampled_strategy).generate(PROMPTS, SAMPLED, TOKENS).tokens
        for mode, got, want, strategy in (("greedy", greedy, references[name][0], greedy_strategy),
                                         ("sampled", sampled, references[name][1], sampled_strategy)):
            if got != want:
                failures.append((name, mode, scheme, strategy, got, want))
    return failures


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_generation_matches_transformers_and_reference_sampler_at_any_rank_count(n, references):
    """Greedy: exactly transformers' generate tokens; sampled: the single-process reference, hence
    the same tokens at every rank count. One rank runs in this process, without a process group."""
    got = [_generate_every_model(references)] if n == 1 else run(_generate_every_model, n, references,
                                                                  timeout=120)
    assert got == [[]] * n


def test_parallelize_replaces_modules_and_keeps_ties():
    for name, tied in (("gpt2", True), ("llama", False), ("qwen2", True)):
        model = build_model(name)
        lm = parallelize(model)
        assert isinstance(model.get_input_embeddings(), VocabParallelEmbedding)
        assert isinstance(model.get_output_embeddings(), ParallelLMHead)
        assert (lm.head.storage is lm.embedding.storage) == tied
        with pytest.raises(RuntimeError, match="not a layer"):
            model.get_output_embeddings()(torch.zeros(1, lm.head.hidden_size))


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown strategy"):
        parallelize(build_model("llama"), strategy="scatter")
    with pytest.raises(ValueError, match="replicated"):
        parallelize(build_model("llama"), scheme="padded", strategy="replicated")
    lm = parallelize(build_model("llama"))
    for prompts, tokens in (([], 2), ([[1], []], 2), ([[1]], 0)):
        with pytest.raises(ValueError):
            lm.generate(prompts, None, tokens)


def test_scaled_embeddings_are_rejected_not_silently_wrong():
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = GemmaForCausalLM(config)  # its embedding multiplies by sqrt(hidden_size)
    with pytest.raises(TypeError, match="subclasses such as scaled embeddings are not supported"):
        parallelize(model)


def test_invalid_pad_token_id_falls_back_to_a_valid_id():
    from vocabpar.integrations.decode import pad_id

    model = build_model("llama")
    model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = -1, 32001, None
    assert pad_id(model.config) == 0
    greedy = hf_generate(build_model("llama"), PROMPTS, 2)
    assert parallelize(model).generate(PROMPTS, None, 2).tokens == greedy


# tokens the tiny GPT-2 favours, so that a penalty over the prompt changes its greedy path; one
# length, so no padding (transformers would penalise the pad token too)
REPEAT_PROMPTS = [[1426, 45364, 40092, 33040, 36264], [9188, 14440, 12760, 35782, 37934],
                  [14440, 23878, 22104, 40426, 14215], [9188, 30481, 25500, 37051, 8571]]
REPEAT_TOKENS = 8
PENALTY = 1.8


def _repetition_penalty_generate():
    """This rank's greedy tokens with the repetition penalty, through both samplers."""
    params = SamplingParams(temperature=0, repetition_penalty=PENALTY)
    return {strategy: parallelize(build_model("gpt2"), strategy=strategy).generate(REPEAT_PROMPTS, params,
                                                                                   REPEAT_TOKENS).tokens
            for strategy in ("none", "all_gather")}


def test_repetition_penalty_over_the_prompt_matches_transformers():
    """Greedy with ``repetition_penalty`` gives transformers' tokens exactly at 1 and 2 ranks; the
    prompts are chosen so that penalising the generated tokens only would not."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    model = build_model("gpt2")
    ids = torch.tensor(REPEAT_PROMPTS)

    def hf(**kw):
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=REPEAT_TOKENS, do_sample=False, pad_token_id=0, **kw)
        return out[:, ids.shape[1]:].tolist()

    want = hf(repetition_penalty=PENALTY)
    generated_only = hf(logits_processor=LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(PENALTY, prompt_ignore_length=ids.shape[1])]))
    assert want != generated_only and want != hf()
    for per_rank in [_repetition_penalty_generate(), *run(_repetition_penalty_generate, 2, timeout=120)]:
        assert per_rank == {"none": want, "all_gather": want}


@pytest.mark.parametrize("prompts,index", [([[1, 2], [3, 3.5]], 1), ([[True, 2]], 0), ([[1], "ab"], 1),
                                           ([[1, 2], [3], [4, "5"]], 2), ([[1], 7], 1),
                                           ([[1], torch.tensor([2.0, 3.0])], 1), ([[1], [-1]], 1),
                                           ([[50257]], 0)])
def test_prompts_with_non_integer_or_out_of_range_ids_are_rejected(prompts, index, gpt2):
    from vocabpar.integrations.decode import left_pad

    with pytest.raises(ValueError, match=f"prompt {index}"):
        left_pad(prompts, 0, 50257)
    with pytest.raises(ValueError, match=f"prompt {index}"):
        reference_generate(gpt2, prompts, None, 1)


@pytest.fixture(scope="module")
def gpt2():
    return build_model("gpt2")


SCORED = torch.tensor([[5, 17, 300, 42, 9, 11, 12], [7, 8, 9, 10, 11, 12, 13]])


def _score_and_prompt_logprobs(name):
    lm = parallelize(build_model(name), strategy="none", scheme="uneven")
    scores = lm.score(SCORED, top_n=3, chunk_rows=5)  # several chunks of 5 hidden rows
    prompts = [p[: 2 + 2 * b] for b, p in enumerate(PROMPTS)]
    g = lm.generate(prompts, None, 2, prompt_logprobs=2)
    return scores, [(p.logprobs, p.top_ids) for p in g.prompt_logprobs], g.tokens


@pytest.mark.parametrize("n", [2, 3])
def test_score_and_prompt_logprobs_match_the_unparallelised_model(n):
    """``lm.score`` and ``generate(prompt_logprobs=)`` equal ``log_softmax`` of transformers'
    own logits (within 1e-4; ranks and top ids exactly where no near-ties) at 2 and 3 ranks."""
    name = "llama"
    model = build_model(name)
    with torch.inference_mode():
        logp = torch.log_softmax(model(SCORED).logits[:, :-1].double(), -1)
    want = logp.gather(2, SCORED[:, 1:, None])[..., 0]
    for scores, prompt_scores, tokens in run(_score_and_prompt_logprobs, n, name, timeout=120):
        assert scores.logprobs.shape == (2, 6) and scores.top_ids.shape == (2, 6, 3)
        assert (scores.logprobs.double() - want).abs().max() < 1e-4
        # ids and ranks come from other logits than transformers' (another GEMM): compare them
        # through the reference values, to the same tolerance
        assert (logp.gather(2, scores.top_ids) - logp.topk(3, -1).values).abs().max() < 1e-4
        assert (scores.top_logprobs.double() - logp.topk(3, -1).values).abs().max() < 1e-4
        surely_above = 1 + (logp > want[..., None] + 1e-4).sum(-1)
        maybe_above = 1 + (logp > want[..., None] - 1e-4).sum(-1)
        assert ((surely_above <= scores.ranks) & (scores.ranks <= maybe_above)).all()
        prompts = [p[: 2 + 2 * b] for b, p in enumerate(PROMPTS)]
        for p, (lp, top) in zip(prompts, prompt_scores):
            ids = torch.tensor([p])
            with torch.inference_mode():
                ref = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            assert lp.shape == (len(p) - 1,) and top.shape == (len(p) - 1, 2)
            assert (lp.double() - ref.gather(1, ids[0, 1:, None])[:, 0]).abs().max() < 1e-4
        assert tokens == hf_generate(model, prompts, 2)


def test_score_rejects_bad_input():
    lm = parallelize(build_model("gpt2"))
    for bad in (torch.tensor([[1]]), torch.tensor([1, 2, 3]), torch.tensor([[1.0, 2.0]]), [[1, 2]]):
        with pytest.raises(ValueError, match="input_ids must be an int64"):
            lm.score(bad)
    with pytest.raises(ValueError, match="outside"):
        lm.score(torch.tensor([[1, 60000]]))
