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
SAMPLED = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, presence_penalty=0.5, seed=[11, 12, 13])
# (scheme, collect for greedy, collect for sampled, exchange); each (ranks, model) takes one, so
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
        scheme, greedy_collect, sampled_collect, exchange = PAIRS[(3 * n + i) % len(PAIRS)]
        lm = parallelize(build_model(name), scheme=scheme, collect=greedy_collect, exchange=exchange)
        greedy = lm.generate(PROMPTS, None, TOKENS).tokens
        sampled = dataclasses.replace(lm, collect=sampled_collect).generate(PROMPTS, SAMPLED, TOKENS).tokens
        for mode, got, want, collect in (("greedy", greedy, references[name][0], greedy_collect),
                                         ("sampled", sampled, references[name][1], sampled_collect)):
            if got != want:
                failures.append((name, mode, scheme, collect, got, want))
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
    with pytest.raises(ValueError, match="unknown collect"):
        parallelize(build_model("llama"), collect="scatter")
    with pytest.raises(ValueError, match="replicated"):
        parallelize(build_model("llama"), scheme="padded", collect="replicated")
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
    from vocabpar.integrations.hf import pad_id

    model = build_model("llama")
    model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = -1, 32001, None
    assert pad_id(model.config) == 0
    greedy = hf_generate(build_model("llama"), PROMPTS, 2)
    assert parallelize(model).generate(PROMPTS, None, 2).tokens == greedy
