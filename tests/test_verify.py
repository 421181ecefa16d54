"""Speculative verification on sharded logits against the single-device reference, on real gloo
ranks, and against the distribution it promises (the target's)."""

import dataclasses
import math

import pytest
import torch

from vocabpar import SamplingParams, VocabLayout, comm, reference_sample, reference_verify, sample, verify
from vocabpar.launch import run
from vocabpar.sampling.reference import kept_tokens
from vocabpar.wire.scripts import calls


def _layouts(V: int, org: int, n: int) -> list[VocabLayout]:
    return [VocabLayout(V, n, org_vocab_size=org, pad_to=8, scheme="padded"),
            VocabLayout(V, n, org_vocab_size=org, scheme="uneven"),
            VocabLayout(V, n, org_vocab_size=org, scheme="replicated")]


def _shard(full: torch.Tensor, layout: VocabLayout, rank: int, junk: float) -> torch.Tensor:
    """This rank's columns of ``[..., V]`` logits; padding columns hold ``junk``."""
    ids = layout.local_token_ids(0 if layout.scheme == "replicated" else rank)
    return torch.where(ids >= 0, full[..., ids.clamp(min=0)], junk)


MIXED = SamplingParams(temperature=[0, 0.8, 1.0, 1.5, 0.6, 1.0], top_k=[0, 5, 0, 0, 300, 2],
                       top_p=[1, 0.9, 0.6, 1, 0.95, 1], min_p=[0, 0, 0.05, 0.1, 0, 0],
                       seed=[3, 1, 4, 1, 5, 9])


def _case(name: str, g: torch.Generator, *, B: int = 6, k: int, V: int, org: int | None = None,
          params: SamplingParams = MIXED, drafted: bool, scale: float = 3.0, ties: bool = False) -> dict:
    """Target logits, and drafts that the target often accepts: with draft logits, tokens drawn
    from nearby draft logits (a different seed, so independent of the verifier's noise); without,
    the target's own argmax or a random token."""
    target = torch.randn(B, k + 1, V, generator=g) * scale
    if ties:
        target = target.round()
    positions = torch.arange(B) * 11 + 2
    draft_logits = None
    if drafted:
        draft_logits = target[:, :k] + torch.randn(B, k, V, generator=g) * 0.7
        picks = reference_sample(draft_logits.reshape(B * k, V),
                                 dataclasses.replace(params.take(B, V, torch.arange(B).repeat_interleave(k)),
                                                     seed=list(range(1000, 1000 + B * k))),
                                 positions=torch.arange(B * k))
        drafts = picks.tokens.view(B, k)
    else:
        drafts = torch.where(torch.rand(B, k, generator=g) < 0.7, target[:, :k].argmax(-1),
                             torch.randint(0, V, (B, k), generator=g))
    return dict(name=name, target=target, drafts=drafts, draft_logits=draft_logits, org=org or V,
                params=params, positions=positions)


def _cases() -> list[dict]:
    g = torch.Generator().manual_seed(2024)
    cases = []
    for k in (0, 1, 3, 5):
        for drafted in (False, True) if k else (False,):
            cases.append(_case(f"mixed_k{k}_{'draft' if drafted else 'onehot'}", g, k=k, V=41, org=33,
                               drafted=drafted))
    cases.append(_case("greedy_k3_draft", g, k=3, V=41, params=SamplingParams(temperature=0), drafted=True))
    cases.append(_case("ties_k3_draft", g, k=3, V=41, org=35, drafted=True, ties=True,
                       B=4, params=SamplingParams(temperature=1, top_k=[0, 3, 0, 2], top_p=[0.7, 1, 0.5, 1],
                                                  seed=7)))
    cases.append(_case("vllm_order_k2_draft", g, k=2, V=41, drafted=True,
                       params=dataclasses.replace(MIXED, filter_order="vllm")))
    # threshold searches: top-k beyond the candidates and flat top-p rows
    cases.append(_case("search_k2_draft", g, k=2, V=900, org=880, drafted=True, scale=0.3, B=4,
                       params=SamplingParams(temperature=1, top_k=[400, 0, 300, 0], top_p=[1, 0.9, 0.8, 0.95],
                                             seed=[1, 2, 3, 4])))
    inf = _case("inf_k2_draft", g, k=2, V=41, drafted=True, B=4,
                params=SamplingParams(temperature=1, top_p=0.9, seed=[1, 2, 3, 4]))
    inf["target"][1, 0, 7] = float("inf")  # a point mass: accepted iff the draft is token 7
    inf["drafts"][1, 0] = 7
    cases.append(inf)
    return cases


CASES = _cases()


def _verify_all(cases):
    """On each rank, every case under every layout; errors are returned, not raised."""
    out = {}
    for case in cases:
        V = case["target"].shape[-1]
        for i, layout in enumerate(_layouts(V, case["org"], comm.world_size())):
            junk = [float("nan"), 1e30, float("inf")][i]
            draft = case["draft_logits"]
            draft = None if draft is None else _shard(draft, layout, comm.rank(), junk)
            comm.reset_traffic()
            with comm.recording() as measured:
                try:
                    res = verify(_shard(case["target"], layout, comm.rank(), junk), layout, case["params"],
                                 case["drafts"], positions=case["positions"],
                                 draft_logits=draft)
                except ValueError as e:
                    res = f"ValueError: {e}"
            out[case["name"], layout.scheme] = res, comm.total_bytes(), measured
    return out


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.once) for n in (1, 2)] + [3, 4])
def sharded(request):
    return request.param, run(_verify_all, request.param, CASES, timeout=60)


@pytest.mark.exact
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_verify_equals_reference(sharded, case):
    n, results = sharded
    ref = reference_verify(case["target"], case["params"], case["drafts"], positions=case["positions"],
                           draft_logits=case["draft_logits"])
    k = case["drafts"].shape[1]
    assert ref.tokens.shape == (case["drafts"].shape[0], k + 1)
    for rank, per_rank in enumerate(results):
        for scheme in ("padded", "uneven", "replicated"):
            got, (sent, _), measured = per_rank[case["name"], scheme]
            where = f"{case['name']} {scheme} rank {rank}/{n}"
            assert not isinstance(got, str), f"{where}: {got}"
            # what crossed ranks is what the call's script prices, collective for collective
            assert measured == calls(got.script, 1 if scheme == "replicated" else n), where
            assert torch.equal(got.accepted, ref.accepted), f"{where}: {got.accepted} != {ref.accepted}"
            assert torch.equal(got.tokens, ref.tokens), f"{where}: {got.tokens} != {ref.tokens}"
            if scheme == "replicated" or n == 1:
                assert sent == 0, where


def test_cases_exercise_acceptance_rejection_and_bonus():
    """The cases are worth comparing: rows accept some, none and all of their drafts."""
    seen = set()
    for case in CASES:
        if case["drafts"].shape[1] == 0:
            continue
        ref = reference_verify(case["target"], case["params"], case["drafts"], positions=case["positions"],
                               draft_logits=case["draft_logits"])
        k = case["drafts"].shape[1]
        seen |= {"none" if a == 0 else "all" if a == k else "some" for a in ref.accepted.tolist()}
    assert seen == {"none", "some", "all"}


def test_emitted_tokens_follow_the_reference_semantics():
    """Accepted tokens are the drafts; the token after them is the bonus (sample() at
    positions + k) when all were accepted; -1 after that. Without draft logits every emitted
    token is what sample() draws at its position."""
    for case in CASES:
        ref = reference_verify(case["target"], case["params"], case["drafts"], positions=case["positions"],
                               draft_logits=case["draft_logits"])
        B, k = case["drafts"].shape
        V = case["target"].shape[-1]
        at = case["positions"].repeat_interleave(k + 1) + torch.arange(k + 1).repeat(B)
        drawn = reference_sample(case["target"].reshape(B * (k + 1), V),
                                 case["params"].take(B, V, torch.arange(B).repeat_interleave(k + 1)),
                                 positions=at).tokens.view(B, k + 1)
        for b in range(B):
            a = int(ref.accepted[b])
            assert ref.tokens[b, :a].tolist() == case["drafts"][b, :a].tolist()
            assert (ref.tokens[b, a + 1:] == -1).all()
            if a == k or case["draft_logits"] is None:
                assert ref.tokens[b, a] == drawn[b, a], (case["name"], b)


def test_k0_is_sample():
    g = torch.Generator().manual_seed(5)
    B, V = 6, 300
    logits = torch.randn(B, 1, V, generator=g) * 2
    positions = torch.arange(B) * 3
    layout = VocabLayout(V, 1, scheme="uneven")
    got = verify(logits, layout, MIXED, torch.zeros(B, 0, dtype=torch.long), positions=positions)
    want = sample(logits[:, 0], layout, MIXED, positions=positions).tokens
    assert torch.equal(got.accepted, torch.zeros(B, dtype=torch.long))
    assert torch.equal(got.tokens[:, 0], want)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _target_probs(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    rows = params.resolve(1, x.numel())
    z = torch.where(kept_tokens(x, rows, 0), x.double() / rows.temperature[0], float("-inf"))
    return torch.softmax(z, 0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=6),
                                    SamplingParams(temperature=1.2, top_p=0.8, min_p=0.02)])
def test_first_token_follows_the_target_and_acceptance_is_sum_min(params):
    """With q != p: the first emitted token follows p (chi-square over 40000 seeds; the 0.9999
    quantile of chi2(df) is below df + 4.5 sqrt(2 df)), and the acceptance rate is
    sum(min(p, q)) within 4.5 standard errors."""
    N, V = 40000, 12
    target = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.2, 1.2, -3.0, 0.8])
    draft = torch.tensor([0.5, 2.0, 1.0, 1.5, -1.0, 0.0, 0.3, -2.0, 1.4, 0.2, 0.0, -0.5])
    p, q = _target_probs(target, params), _target_probs(draft, params)
    drafts = torch.multinomial(q.float(), N, replacement=True, generator=torch.Generator().manual_seed(1))
    per_row = dataclasses.replace(params, seed=list(range(N)))
    out = verify(target.expand(N, 2, V).contiguous(), VocabLayout(V, 1, scheme="uneven"), per_row,
                 drafts[:, None], positions=torch.full((N,), 9),
                 draft_logits=draft.expand(N, 1, V).contiguous())
    first = torch.bincount(out.tokens[:, 0], minlength=V).double()
    support = p > 0
    assert first[~support].sum() == 0
    df = int(support.sum()) - 1
    assert _chi_square(first[support], p[support]) < df + 4.5 * math.sqrt(2 * df)
    rate, expected = out.accepted.double().mean().item(), torch.minimum(p, q).sum().item()
    assert abs(rate - expected) < 4.5 * math.sqrt(expected * (1 - expected) / N), (rate, expected)


def _traffic(V: int, drafted: bool):
    """Bytes and collectives of one verification on 2 ranks: greedy rows and top-k 1 rows, whose
    paths do not depend on the data (a top-1 draw always takes the spread all-gather)."""
    B, k = 8, 3
    g = torch.Generator().manual_seed(V)
    target = torch.randn(B, k + 1, V, generator=g)
    draft_logits = torch.randn(B, k, V, generator=g) if drafted else None
    drafts = torch.randint(0, V, (B, k), generator=g)
    layout = VocabLayout(V, 2, scheme="uneven")
    shard = lambda t: None if t is None else _shard(t, layout, comm.rank(), 0.0)  # noqa: E731
    out = {}
    for name, params in (("greedy", SamplingParams(temperature=0)),
                         ("top1", SamplingParams(temperature=[0, 1] * 4, top_k=1, seed=list(range(B))))):
        comm.reset_traffic()
        verify(shard(target), layout, params, drafts, positions=torch.arange(B),
               draft_logits=shard(draft_logits), check=False)
        out[name] = comm.total_bytes()[1], sum(c.calls for c in comm.traffic().values())
    return out


def _traffic_sizes():
    return {(V, drafted): _traffic(V, drafted) for V in (1000, 7000) for drafted in (False, True)}


def test_bytes_per_verification_do_not_depend_on_the_vocabulary():
    B, k = 8, 3
    for per_rank in run(_traffic_sizes, 2):
        for drafted in (False, True):
            assert per_rank[1000, drafted] == per_rank[7000, drafted], drafted
        # greedy: one all-gather of a (value, id) pair per (row, position)
        assert per_rank[1000, False]["greedy"] == (B * (k + 1) * 16, 1)
        assert per_rank[1000, True]["greedy"][1] == 1
        # top-1 rows: round one with one candidate, the draw; with draft logits also the masses'
        # all-reduce and the corrections' all-gather
        assert per_rank[1000, False]["top1"][1] == 2
        assert per_rank[1000, True]["top1"][1] == 4


def _bad_inputs():
    V, B, k = 50, 3, 2
    layout = VocabLayout(V, comm.world_size(), scheme="uneven")
    target = _shard(torch.randn(B, k + 1, V), layout, comm.rank(), 0.0)
    drafts = torch.zeros(B, k, dtype=torch.long)
    params, pos = SamplingParams(temperature=1.0), torch.arange(B)
    cases = {
        "draft id out of range": lambda: verify(target, layout, params, drafts + V, positions=pos),
        "negative draft id on rank 1": lambda: verify(target, layout, params,
                                                      drafts - int(comm.rank() == 1), positions=pos),
        "float drafts": lambda: verify(target, layout, params, drafts.float(), positions=pos),
        "target shape": lambda: verify(target[:, :k], layout, params, drafts, positions=pos),
        "draft logits shape": lambda: verify(target, layout, params, drafts, positions=pos,
                                             draft_logits=target),
        "draft logits +inf": lambda: verify(target, layout, params, drafts, positions=pos,
                                            draft_logits=torch.full_like(target[:, :k], float("inf"))),
        "drafts differ": lambda: verify(target, layout, params, drafts + comm.rank(), positions=pos),
        "logprobs": lambda: verify(target, layout, dataclasses.replace(params, logprobs=1), drafts,
                                   positions=pos),
        "NaN draft logits": lambda: verify(target, layout, params, drafts, positions=pos,
                                           draft_logits=torch.full_like(target[:, :k], float("nan"))),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    out["afterwards"] = verify(target, layout, params, drafts, positions=pos).accepted.shape
    return out


def test_bad_input_raises_on_every_rank():
    results = run(_bad_inputs, 2, timeout=20)
    expect = {"draft id out of range": "outside [0, vocab_size=50)", "negative draft id on rank 1": "rank",
              "float drafts": "draft_tokens must be int64", "target shape": "target_logits must be float32",
              "draft logits shape": "draft_logits must be float32", "draft logits +inf": "+inf",
              "drafts differ": "draft tokens", "logprobs": "no logprobs", "NaN draft logits": "draft row 0"}
    for rank, per_rank in enumerate(results):
        for name, fragment in expect.items():
            assert fragment in per_rank[name], (rank, name, per_rank[name])
        assert per_rank["afterwards"] == (3,)
    assert "position 0 is outside" in results[1]["negative draft id on rank 1"]
    assert "rejected their input" in results[0]["negative draft id on rank 1"]
