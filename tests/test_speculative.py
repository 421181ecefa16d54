"""Speculative decoding through the Hugging Face integration, on real gloo ranks: greedy output
equals plain greedy decoding and transformers' assisted generation; prompt-lookup drafts give
exactly the plain loop's sampled tokens; draft-model sampling is identical at every rank count."""

import pytest
import torch

from vocabpar import SamplingParams
from vocabpar.demo import build_draft, build_model
from vocabpar.launch import run

pytest.importorskip("transformers")
from vocabpar.integrations.hf import parallelize  # noqa: E402
from vocabpar.integrations.speculative import PromptLookup  # noqa: E402

PROMPTS = [[5, 17, 300, 42, 9, 17, 300], [7, 8], [1000, 2, 31999, 1000, 2]]
TOKENS = 6
SAMPLED = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, seed=[11, 12, 13])
NEAR_TIE = 1e-4  # top-2 logit gap below which a different batch shape may flip the argmax


def _runs(strategies: list[str], modes: tuple[str, ...] = ("greedy", "sampled")) -> dict:
    """On each rank: plain and speculative generations of the llama model, per strategy."""
    out = {}
    for strategy in strategies:
        lm = parallelize(build_model("llama"), strategy=strategy)
        draft = parallelize(build_draft("llama"), strategy=strategy)
        for mode, params in (("greedy", None), ("sampled", SAMPLED)):
            if mode not in modes:
                continue
            out[strategy, mode, "plain"] = lm.generate(PROMPTS, params, TOKENS).tokens
            model = lm.generate(PROMPTS, params, TOKENS, draft=draft, num_draft_tokens=3)
            lookup = lm.generate(PROMPTS, params, TOKENS, draft=PromptLookup(), num_draft_tokens=2)
            out[strategy, mode, "model"], out[strategy, mode, "lookup"] = model.tokens, lookup.tokens
            out[strategy, mode, "rates"] = model.acceptance_rate, lookup.acceptance_rate
    return out


@pytest.fixture(scope="module")
def generations():
    """(world size, strategy) -> every rank's generations: "none" (verification on shards) at
    1-4 ranks, gather-then-verify ("all_gather") at 2."""
    launches = {1: [_runs(["none"])]}
    for n in (2, 3, 4):  # sampling is checked at 1, 2 and 4 ranks, greedy at 1-4
        launches[n] = run(_runs, n, ["none", "all_gather"] if n == 2 else ["none"],
                          ("greedy",) if n == 3 else ("greedy", "sampled"), timeout=120)
    return {(n, strategy): [{key[1:]: v for key, v in runs.items() if key[0] == strategy}
                            for runs in per_rank]
            for n, per_rank in launches.items() for strategy in ("none", "all_gather")
            if (strategy, "greedy", "plain") in per_rank[0]}


def _decided(model, prompt: list[int], tokens: list[int]) -> int:
    """How many of ``tokens`` (the greedy continuation of ``prompt``) follow from a clear argmax:
    the count before the first step whose top-2 logit gap is below ``NEAR_TIE``."""
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        top = model(ids).logits[0, len(prompt) - 1: -1].float().topk(2, -1).values
    close = ((top[:, 0] - top[:, 1]) < NEAR_TIE).nonzero()
    return len(tokens) if close.numel() == 0 else int(close[0])


@pytest.fixture(scope="module")
def assisted():
    """transformers' assisted generation (one prompt at a time, as it requires) and the length of
    each prompt's greedy continuation decided by a clear argmax."""
    target, draft = build_model("llama"), build_draft("llama")
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        tokens = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=TOKENS)
        tokens = tokens[0, len(prompt):].tolist()
        out.append((tokens, _decided(target, prompt, tokens)))
    return out


@pytest.mark.parametrize("where", [(1, "none"), (2, "none"), (3, "none"), (4, "none"), (2, "all_gather")])
def test_greedy_speculative_equals_plain_and_transformers_assisted(generations, assisted, where):
    for rank, runs in enumerate(generations[where]):
        for b, (want, decided) in enumerate(assisted):
            for kind in ("plain", "model", "lookup"):
                got = runs["greedy", kind][b]
                assert len(got) == TOKENS
                assert got[:decided] == want[:decided], (where, rank, b, kind, got, want)


def test_prompt_lookup_sampling_emits_exactly_the_plain_loops_tokens(generations):
    """Deterministic drafts are verified by the sampler's own draws: the tokens are plain decoding's."""
    for where, per_rank in generations.items():
        for runs in per_rank:
            if ("sampled", "plain") in runs:
                assert runs["sampled", "lookup"] == runs["sampled", "plain"], where


def test_draft_model_sampling_is_the_same_at_every_rank_count(generations):
    first = generations[1, "none"][0]["sampled", "model"]
    assert all(len(t) == TOKENS for t in first)
    for where, per_rank in generations.items():
        for runs in per_rank:
            if ("sampled", "model") in runs:
                assert runs["sampled", "model"] == first, where


def test_the_engine_sampler_verifies_a_batch_of_greedy_and_sampled_rows_as_the_functional_one():
    """Draft-model speculation (draft logits) on a batch whose rows mix greedy and sampled: the
    engine Sampler stacks every row's drafts and gives the functional sampler's tokens."""
    params = SamplingParams(temperature=[0.0, 0.9, 0.0], top_k=200, seed=[11, 12, 13])
    tokens = {}
    for sampler in ("functional", "engine"):
        lm = parallelize(build_model("llama"), strategy="none", sampler=sampler)
        draft = parallelize(build_draft("llama"), strategy="none", sampler=sampler)
        tokens[sampler] = lm.generate(PROMPTS, params, TOKENS, draft=draft, num_draft_tokens=3).tokens
    assert all(len(t) == TOKENS for t in tokens["engine"])
    assert tokens["engine"] == tokens["functional"]


def test_acceptance_rates_are_reported(generations):
    for per_rank in generations.values():
        for runs in per_rank:
            for mode in ("greedy", "sampled"):
                if (mode, "rates") not in runs:
                    continue
                model, lookup = runs[mode, "rates"]
                assert 0 <= lookup <= 1 and 0 < model <= 1  # the draft agrees with its target often


def test_bad_speculative_arguments():
    lm = parallelize(build_model("llama"), strategy="none")
    draft = parallelize(build_draft("llama"), strategy="none")
    cases = [
        (dict(draft=draft, num_draft_tokens=0), "num_draft_tokens"),
        (dict(draft=PromptLookup(), num_draft_tokens=2, params=SamplingParams(presence_penalty=0.5)),
         "penalt"),
        (dict(draft=parallelize(build_draft("llama"), strategy="all_gather"), num_draft_tokens=2), "same"),
        (dict(draft="ngrams", num_draft_tokens=2), "draft"),
        (dict(num_draft_tokens=2), "draft"),
    ]
    for kwargs, fragment in cases:
        params = kwargs.pop("params", None)
        with pytest.raises(ValueError, match=fragment):
            lm.generate(PROMPTS, params, 4, **kwargs)
    with pytest.raises(ValueError, match="collect|strategy"):
        parallelize(build_model("llama"), strategy="gather").generate(PROMPTS, None, 4, draft=PromptLookup(),
                                                                      num_draft_tokens=2)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


def test_prompt_lookup_proposals():
    lookup = PromptLookup(max_ngram=2)
    assert lookup.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # the bigram (1, 2) recurs
    assert lookup.propose([1, 2, 3, 9, 3], 2) == [9, 3]  # only the unigram (3)
    assert lookup.propose([1, 2, 3, 1], 4) == [2, 3, 1, 1]  # short match: its last token repeats
    assert lookup.propose([4, 5, 6], 2) == [6, 6]  # no match
