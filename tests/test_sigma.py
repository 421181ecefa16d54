"""top-n-sigma on shards: the kept set from exact integer sums, identical at any rank count and
layout, in both samplers and in verification, against the single-device reference and against
llama.cpp's definition (max - n * sigma over the finite logits, before temperature)."""

import pytest
import torch

from vocabpar import SamplingParams, VocabLayout, comm, reference_sample, reference_verify, sample, verify
from vocabpar.launch import run
from vocabpar.sampling import Sampler
from vocabpar.sampling import sigma as top_n_sigma
from vocabpar.sampling.reference import kept_tokens

B, V, ORG = 8, 301, 290


def _case() -> dict:
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(B, V, generator=g) * 2
    logits[1, :40] = float("-inf")  # excluded tokens do not count in sigma
    logits[2] = logits[2].round()  # ties at the cut
    params = SamplingParams(temperature=[1, 0.7, 1.5, 1, 0, 1, 2, 1],
                            top_n_sigma=[1.0, 0.5, 1.2, 0, 2, 1.5, 1, 0.3],
                            top_k=[0, 0, 0, 30, 0, 5, 0, 0], top_p=[1, 1, 0.9, 1, 1, 1, 0.95, 1],
                            min_p=[0, 0, 0, 0, 0, 0, 0, 0.01], seed=list(range(40, 40 + B)), logprobs=2,
                            logprobs_of="processed", logit_bias=[None, {3: 5.0}] + [None] * 6)
    return dict(logits=logits, params=params, positions=torch.arange(B) + 5)


CASE = _case()


def _layout(scheme: str, n: int) -> VocabLayout:
    return VocabLayout(V, n, org_vocab_size=ORG, pad_to=8 if scheme == "padded" else 1, scheme=scheme)


def _shard(full: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    ids = layout.local_token_ids(0 if layout.scheme == "replicated" else comm.rank())
    return torch.where(ids >= 0, full[..., ids.clamp(min=0)], 3.0)


def _drafts():
    g = torch.Generator().manual_seed(9)
    target, draft = torch.randn(B, 3, V, generator=g) * 2, torch.randn(B, 2, V, generator=g) * 2
    return target, draft, torch.stack([target[:, 0].argmax(1), torch.randint(0, V, (B,), generator=g)], 1)


def _on_ranks() -> dict:
    out = {}
    p, positions = CASE["params"], CASE["positions"]
    target, draft, drafts = _drafts()
    plain = SamplingParams(temperature=p.temperature, top_n_sigma=p.top_n_sigma, seed=p.seed)
    for scheme in ("padded", "uneven", "replicated"):
        layout = _layout(scheme, comm.world_size())
        local = _shard(CASE["logits"], layout)
        adaptive = sample(local, layout, p, positions=positions, check=True)
        sampler = Sampler(layout, max_rows=B, max_top_n=2, max_drafts=2)
        engine = sampler.sample(local, sampler.prepare(p, positions=positions))
        engine.raise_if_failed()
        checked = verify(_shard(target, layout), layout, plain, drafts, positions=positions,
                         draft_logits=_shard(draft, layout))
        batch = sampler.prepare(plain, positions=positions)
        engine_checked = sampler.verify(_shard(target, layout), batch, drafts, _shard(draft, layout))
        out[scheme] = [(o.tokens, o.top_ids, o.logprobs) for o in (adaptive, engine)], checked.tokens, \
            engine_checked.tokens
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_top_n_sigma_on_shards_equals_the_reference_in_both_samplers_and_in_verify(n):
    p = CASE["params"]
    expected = reference_sample(CASE["logits"], p, positions=CASE["positions"])
    off = reference_sample(CASE["logits"], SamplingParams(**{**vars(p), "top_n_sigma": 0}),
                           positions=CASE["positions"])
    assert (expected.tokens != off.tokens).sum() >= 2  # the filter decides rows
    target, draft, drafts = _drafts()
    plain = SamplingParams(temperature=p.temperature, top_n_sigma=p.top_n_sigma, seed=p.seed)
    checked = reference_verify(target, plain, drafts, positions=CASE["positions"], draft_logits=draft)
    for per_rank in run(_on_ranks, n, timeout=120):
        for scheme, (outputs, verified, engine_verified) in per_rank.items():
            for tokens, top_ids, logprobs in outputs:
                assert torch.equal(tokens, expected.tokens), (n, scheme)
                assert torch.equal(top_ids, expected.top_ids), (n, scheme)
                assert torch.allclose(logprobs, expected.logprobs, atol=1e-5, equal_nan=True), (n, scheme)
            assert torch.equal(verified, checked.tokens), (n, scheme)
            assert torch.equal(engine_verified, checked.tokens), (n, scheme)


def test_the_kept_set_is_llama_cpps_max_minus_n_sigma_before_temperature():
    """llama.cpp: sigma over the finite logits (population), keep logit >= max - n * sigma; the
    rounding of the logits to 2**-16 moves no token of these rows across the cut."""
    x, p = CASE["logits"], CASE["params"]
    rows = p.resolve(B, V)
    summed = top_n_sigma.terms(x, torch.ones(V, dtype=torch.bool))
    bound = top_n_sigma.floor(summed, x.max(1).values.double(), rows.top_n_sigma)
    for b in range(B):
        n = float(rows.top_n_sigma[b])
        if n == 0:
            assert bound[b] == float("-inf")
            continue
        finite = x[b][x[b].isfinite()].double()
        want = x[b].double() >= finite.max() - n * finite.std(unbiased=False)
        assert torch.equal(x[b] >= bound[b], want), b
    # the kept set does not move with the temperature (a min-p of 1e-30 only drops the -inf
    # tokens the mask leaves, at either temperature)
    hot = SamplingParams(temperature=5.0, top_n_sigma=1.0, min_p=1e-30)
    cold = SamplingParams(temperature=0.2, top_n_sigma=1.0, min_p=1e-30)
    row = x[0].clone()
    kept_hot, kept_cold = (kept_tokens(row, q.resolve(1, V), 0) for q in (hot, cold))
    assert torch.equal(kept_hot, kept_cold) and 0 < int(kept_hot.sum()) < V


def test_bad_top_n_sigma_names_row():
    for value, message in [(-1.0, "row 1: top_n_sigma"), (float("nan"), "row 1: top_n_sigma")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(top_n_sigma=[1.0, value]).resolve(2, V)
    assert SamplingParams(top_n_sigma=None).resolve(2, V).top_n_sigma.tolist() == [0.0, 0.0]
