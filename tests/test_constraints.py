"""Request constraints -- logit_bias, allowed_token_ids, min_tokens with stop_token_ids -- on
shards, in both samplers and in verification, against the single-device reference and against
vLLM's definitions (bias before the penalties; excluded ids at -inf), on real gloo ranks."""

import dataclasses

import pytest
import torch

from vocabpar import SamplingParams, VocabLayout, comm, reference_sample, reference_verify, sample, verify
from vocabpar.launch import run
from vocabpar.sampling import Sampler, TokenCounts
from vocabpar.sampling.constraints import pack_bits
from vocabpar.sampling.semantics import processed_logits

B, V, ORG = 8, 301, 290  # a vocabulary that is not a multiple of 64, with 11 added (LoRA) ids


def _case() -> dict:
    """Rows where every constraint changes the token: a bias lifts a tail token or sinks the
    argmax, allowed ids leave a few tokens, min_tokens holds back the argmax as a stop token."""
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(B, V, generator=g) * 3
    top = logits.argmax(1).tolist()
    low = logits.argmin(1).tolist()
    params = SamplingParams(
        temperature=[0, 1, 0.8, 0, 1, 0, 1.2, 0.7], top_k=[0, 0, 20, 0, 0, 0, 50, 0],
        top_p=[1, 0.9, 1, 1, 0.8, 1, 1, 0.95], min_p=[0, 0, 0.05, 0, 0, 0, 0, 0.02],
        repetition_penalty=[1, 1.5, 1, 1.3, 1, 1, 1, 1], seed=list(range(30, 30 + B)),
        logit_bias=[{low[0]: 40.0}, {low[1]: 9.0, top[1]: -2.5}, None, {top[3]: -100.0, 7: 0.5}, None,
                    {280: 2.0, 295: 30.0}, {}, None],
        allowed_token_ids=[None, None, [3, 9, 27, 81, 243, 296], None, [top[4], 1, 2, 3], None, None,
                           list(range(100))],
        min_tokens=[0, 0, 0, 5, 0, 3, 2, 0],
        stop_token_ids=[None, None, [9], [top[3], 11], None, [295], [top[6]], None])
    counts = TokenCounts.from_history([[low[1]], [], [], [top[3], 7], [], [], [], []])
    output_lens = torch.tensor([0, 0, 0, 4, 0, 3, 1, 0])  # rows 3 and 6 are held back, row 5 is not
    return dict(logits=logits, params=params, token_counts=counts, output_lens=output_lens,
                positions=torch.arange(B) * 3 + 1)


CASE = _case()
LAYOUTS = ("padded", "uneven", "replicated")


def _layout(scheme: str, n: int) -> VocabLayout:
    return VocabLayout(V, n, org_vocab_size=ORG, pad_to=8 if scheme == "padded" else 1, scheme=scheme)


def _shard(full: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    ids = layout.local_token_ids(0 if layout.scheme == "replicated" else comm.rank())
    return torch.where(ids >= 0, full[..., ids.clamp(min=0)], 7.0)  # padding junk never matters


def _drafts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target and draft logits [B, 3, V] / [B, 2, V] and two drafts per row."""
    g = torch.Generator().manual_seed(5)
    target = torch.randn(B, 3, V, generator=g) * 2
    draft = torch.randn(B, 2, V, generator=g) * 2
    drafts = torch.stack([target[:, 0].argmax(1), torch.randint(0, V, (B,), generator=g)], 1)
    return target, draft, drafts


def _on_ranks() -> dict:
    out = {}
    inputs = {k: CASE[k] for k in ("params", "positions", "token_counts", "output_lens")}
    target, draft, drafts = _drafts()
    for scheme in LAYOUTS:
        layout = _layout(scheme, comm.world_size())
        local = _shard(CASE["logits"], layout)
        adaptive = sample(local, layout, **inputs, check=True)
        sampler = Sampler(layout, max_rows=B, max_drafts=2)
        batch = sampler.prepare(**inputs)
        engine = sampler.sample(local, batch)
        engine.raise_if_failed()
        checked = verify(_shard(target, layout), layout, CASE["params"], drafts, positions=CASE["positions"],
                         draft_logits=_shard(draft, layout), output_lens=CASE["output_lens"])
        engine_checked = sampler.verify(_shard(target, layout), batch, drafts, _shard(draft, layout))
        engine_checked.raise_if_failed()
        out[scheme] = adaptive.tokens, engine.tokens, checked.tokens, engine_checked.tokens
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_constraints_on_shards_equal_the_reference_in_both_samplers_and_in_verify(n):
    """Row 3 is held back at its first position but not at its second: verification recomputes
    min_tokens per draft position, in both samplers."""
    expected = reference_sample(CASE["logits"], CASE["params"], positions=CASE["positions"],
                                token_counts=CASE["token_counts"], output_lens=CASE["output_lens"]).tokens
    unconstrained = reference_sample(CASE["logits"], dataclasses.replace(
        CASE["params"], logit_bias=None, allowed_token_ids=None, min_tokens=0), positions=CASE["positions"],
        token_counts=CASE["token_counts"]).tokens
    assert (expected != unconstrained).sum() >= 5  # the constraints decide most rows
    target, draft, drafts = _drafts()
    checked = reference_verify(target, CASE["params"], drafts, positions=CASE["positions"],
                               draft_logits=draft, output_lens=CASE["output_lens"])
    for per_rank in run(_on_ranks, n, timeout=120):
        for scheme, (adaptive, engine, verified, engine_verified) in per_rank.items():
            assert torch.equal(adaptive, expected), (n, scheme)
            assert torch.equal(engine, expected), (n, scheme)
            assert torch.equal(verified, checked.tokens), (n, scheme)
            assert torch.equal(engine_verified, checked.tokens), (n, scheme)


def test_the_tokens_obey_each_constraint():
    out = reference_sample(CASE["logits"], CASE["params"], positions=CASE["positions"],
                           token_counts=CASE["token_counts"], output_lens=CASE["output_lens"]).tokens.tolist()
    p = CASE["params"]
    for b, token in enumerate(out):
        if p.allowed_token_ids[b] is not None:
            assert token in p.allowed_token_ids[b], b
    top = CASE["logits"].argmax(1)
    assert out[0] == CASE["logits"][0].argmin()  # greedy, a bias of 40 on its lowest token
    assert out[3] != top[3] and out[3] != 11  # sunk by its bias, then held back as a stop token
    assert out[5] == 295  # its stop token, allowed: 3 tokens produced of min_tokens 3
    assert out[6] != top[6]  # held back: 1 of 2


def test_bias_comes_before_the_penalties_and_exclusions_are_minus_inf_as_vllm_applies_them():
    """vLLM's order on one row: allowed ids, then logit_bias (and min_tokens), then repetition /
    frequency / presence penalties, then temperature and the filters."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, logit_bias={0: 1.0, 1: 3.0},
                            allowed_token_ids=[0, 1, 2, 4], min_tokens=2, stop_token_ids=[4])
    rows = params.resolve(1, 5, torch.tensor([1]))
    counts = TokenCounts.from_history([[0, 1, 1]])
    got = processed_logits(logits, torch.arange(5), rows, lambda t: (t.clamp(min=0), t >= 0), counts, None)
    biased = logits[0] + torch.tensor([1.0, 3.0, 0, 0, 0])
    seen = torch.tensor([1, 2, 0, 0, 0])
    want = torch.where(seen > 0, torch.where(biased > 0, biased / 2, biased * 2), biased) - 0.5 * seen
    want[3] = want[4] = float("-inf")  # not allowed; a stop token before min_tokens
    assert torch.equal(got[0], want)


def test_bits_and_per_row_forms():
    may = torch.zeros(2, 70, dtype=torch.bool)
    may[0, [0, 31, 32, 69]] = True
    words = pack_bits(may)
    assert words.dtype == torch.int32 and words.shape == (2, 3)
    assert words[0].tolist() == [1 - 2**31, 1, 2**5]  # ids 0 and 31, 32, 69
    assert words[1].tolist() == [0, 0, 0]
    one = SamplingParams(allowed_token_ids=[1, 2], logit_bias={3: 1.0}).resolve(3, 10)
    per_row = SamplingParams(allowed_token_ids=[[1, 2]] * 3, logit_bias=[{3: 1.0}] * 3).resolve(3, 10)
    assert torch.equal(one.allowed, per_row.allowed) and torch.equal(one.bias_ids, per_row.bias_ids)
    assert SamplingParams().resolve(3, 10).allowed is None
    done = torch.tensor([4, 5])  # both rows have produced min_tokens: nothing held back
    assert SamplingParams(min_tokens=4, stop_token_ids=[1]).resolve(2, 10, done).allowed is None
    taken = SamplingParams(logit_bias=[{1: 1.0}, None, {2: 2.0}]).take(3, 10, torch.tensor([2, 0]))
    assert taken.logit_bias == [{2: 2.0}, {1: 1.0}]


@pytest.mark.parametrize("params, lens, message", [
    (SamplingParams(logit_bias={301: 1.0}), None, "row 0: logit_bias id 301 is outside [0, vocab_size=301"),
    (SamplingParams(logit_bias=[None, {-1: 1.0}]), None, "row 1: logit_bias id -1"),
    (SamplingParams(logit_bias=[None, {5: float("inf")}]), None, "row 1: logit_bias of id 5 must be finite"),
    (SamplingParams(logit_bias=[{1: 1.0}]), None, "logit_bias: expected one value per row (2), got 1"),
    (SamplingParams(allowed_token_ids=[[1], []]), None, "row 1: allowed_token_ids is empty"),
    (SamplingParams(allowed_token_ids=[[1], [400]]), None, "row 1: allowed_token_ids id 400"),
    (SamplingParams(allowed_token_ids=[1, [2]]), None, "mixing both"),
    (SamplingParams(min_tokens=[0, -1]), None, "row 1: min_tokens must be an int >= 0"),
    (SamplingParams(min_tokens=2, stop_token_ids=[7]), None, "row 0: min_tokens with stop_token_ids needs "
                                                              "output_lens"),
    (SamplingParams(min_tokens=2, stop_token_ids=[[7], [999]]), torch.tensor([0, 0]), "row 1: stop_token_"),
    (SamplingParams(min_tokens=2, stop_token_ids=[7]), torch.tensor([0, -3]), "row 1: output_lens must be"),
    (SamplingParams(min_tokens=2, stop_token_ids=[7]), torch.tensor([0]), "output_lens must be 2 integers"),
])
def test_bad_constraints_name_row_and_field(params, lens, message):
    logits = torch.zeros(2, V)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        reference_sample(logits, params, positions=torch.arange(2), output_lens=lens)
    layout = _layout("uneven", 1)
    with pytest.raises(ValueError, match="row|output_lens|logit_bias"):
        Sampler(layout, max_rows=4).prepare(params, positions=torch.arange(2), output_lens=lens)


def _bad_on_one_rank():
    """Rank 1 alone holds a bias on an id out of range: every rank raises, before any collective."""
    layout = _layout("uneven", comm.world_size())
    bad = {300 + comm.rank(): 1.0}
    params = SamplingParams(temperature=0, logit_bias=bad)
    local = _shard(torch.zeros(1, V), layout)
    try:
        sample(local, layout, params, positions=torch.arange(1), check=True)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_bad_bias_on_one_rank_raises_on_every_rank():
    first, second = run(_bad_on_one_rank, 2, timeout=60)
    assert "row 0: logit_bias id 301 is outside" in second and "rank(s) [1] rejected their input" in first


def test_a_row_left_without_tokens_is_reported():
    params = SamplingParams(temperature=0, allowed_token_ids=[[5], None], min_tokens=1,
                            stop_token_ids=[[5], None])
    lens = torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"rows \[0\] have no allowed token"):
        reference_sample(torch.zeros(2, V), params, positions=torch.arange(2), output_lens=lens)


def _disagreeing_ranks():
    """Each rank passes a valid bias of its own: both samplers say the ranks disagree, naming it."""
    layout = _layout("padded", comm.world_size())
    params = SamplingParams(temperature=0, logit_bias={3: 1.0 + comm.rank()}, seed=[1])
    local = _shard(torch.zeros(1, V), layout)
    out = []
    try:
        sample(local, layout, params, positions=torch.arange(1), check=True)
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    sampler = Sampler(layout, max_rows=2)
    try:
        sampler.sample(local, sampler.prepare(params, positions=torch.arange(1))).to_host().raise_if_failed()
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    return out


def test_ranks_that_disagree_on_a_constraint_are_told_which_on_every_rank():
    for adaptive, engine in run(_disagreeing_ranks, 2, timeout=60):
        assert "logit_bias" in adaptive, adaptive
        assert "disagree" in engine or "differ" in engine, engine
