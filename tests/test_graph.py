"""An engine compiles its whole step: ``torch.compile(sampler.sample, fullgraph=True)``,
``verify`` and ``token_logprobs`` trace as one graph with no break (``fullgraph=True`` raises at
a break), give the eager call's ids, logprobs and flags, and a second batch of the same plan with
other values reuses the program. One process (the collectives of a group trace alike:
``scripts/graph_breaks.py`` checks 2 ranks and prints every break where one is left); Dynamo's
eager backend, so nothing compiles to C++ here."""

import pytest
import torch

from vocabpar import Sampler, SamplingParams, VocabLayout
from vocabpar.kernels import fused

V, B = 4096, 6
PLANS = {"greedy": {}, "top-p search": {"temperature": 1.0, "top_p": 0.9},
         "certified": {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "min_p": 0.05},
         "greedy with logprobs": {"logprobs": 3},
         "constraints": {"temperature": 1.0, "top_p": 0.9, "logit_bias": {5: 2.0, 9: -1.0},
                         "allowed_token_ids": list(range(0, V, 3))},
         "top-n-sigma": {"temperature": 1.0, "top_n_sigma": 1.0, "top_k": 20}}


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    return Sampler(VocabLayout(V, 1), max_rows=8, max_top_n=3)


def _batch(sampler: Sampler, params: dict, seed: int):
    params = SamplingParams(seed=[seed + b for b in range(B)], **params)
    return sampler.prepare(params, positions=torch.arange(B))


@pytest.mark.parametrize("plan", PLANS)
def test_sample_is_one_graph_equal_to_eager(sampler, plan):
    torch._dynamo.reset()
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0))
    batch = _batch(sampler, PLANS[plan], 0)
    with fused.compiling(False):
        compiled = torch.compile(sampler.sample, fullgraph=True, backend="eager")
        assert torch.equal(compiled(logits, batch).packed.words, sampler.sample(logits, batch).packed.words)
        other = _batch(sampler, PLANS[plan], 7)  # other seeds
        logits2 = torch.randn(B, V, generator=torch.Generator().manual_seed(1))
        with torch._dynamo.config.patch(error_on_recompile=True):  # other values, the same program
            got = compiled(logits2, other).packed.words
        assert torch.equal(got, sampler.sample(logits2, other).packed.words)


def test_token_logprobs_is_one_graph_equal_to_eager(sampler):
    torch._dynamo.reset()
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(3))

    def score(logits: torch.Tensor, ids: torch.Tensor):
        return sampler.token_logprobs(logits, ids, top_n=3)

    with fused.compiling(False):
        got = torch.compile(score, fullgraph=True, backend="eager")(logits, ids)
        assert torch.equal(got.packed.words, score(logits, ids).packed.words)


@pytest.mark.parametrize("with_draft_logits", [False, True])
def test_verify_is_one_graph_equal_to_eager(with_draft_logits):
    torch._dynamo.reset()
    k = 2
    sampler = Sampler(VocabLayout(V, 1), max_rows=B, max_drafts=k)
    g = torch.Generator().manual_seed(4)
    target = torch.randn(B, k + 1, V, generator=g)
    draft_logits = target[:, :k] + torch.randn(B, k, V, generator=g) if with_draft_logits else None
    drafts = torch.randint(0, V, (B, k), generator=g)
    batch = _batch(sampler, PLANS["certified"], 0)

    def verify(target: torch.Tensor, drafts: torch.Tensor):
        return sampler.verify(target, batch, drafts, draft_logits)

    with fused.compiling(False):
        got = torch.compile(verify, fullgraph=True, backend="eager")(target, drafts)
        assert torch.equal(got.packed.words, verify(target, drafts).packed.words)
