"""Sampling on sharded logits against the single-device oracle, on real gloo ranks.

One launch per world size runs every case under every layout scheme; the main process compares
each rank's output with ``reference_sample`` on the full logits."""

import dataclasses
import math

import pytest
import torch

from vocabpar import SamplingParams, VocabLayout, comm, reference_sample, sample
from vocabpar.launch import LaunchError, run
from vocabpar.sampling import TokenCounts, search
from vocabpar.sampling.constraints import pack_bits
from vocabpar.sampling.noise import gumbel, row_keys
from vocabpar.sampling.reference import kept_tokens
from vocabpar.sampling.semantics import penalise
from vocabpar.wire.scripts import calls


def _layouts(V: int, org: int, n: int) -> list[VocabLayout]:
    return [
        VocabLayout(V, n, org_vocab_size=org, pad_to=8, scheme="padded"),
        VocabLayout(V, n, org_vocab_size=org, scheme="uneven"),
        VocabLayout(V, n, org_vocab_size=org, scheme="replicated"),
    ]


def _shard(full: torch.Tensor, layout: VocabLayout, rank: int, junk: float) -> torch.Tensor:
    """This rank's columns; padding columns hold ``junk`` (they must never matter)."""
    ids = layout.local_token_ids(0 if layout.scheme == "replicated" else rank)
    return torch.where(ids >= 0, full[:, ids.clamp(min=0)], junk)


def _order_rows() -> tuple[torch.Tensor, SamplingParams]:
    """Rows on which the filter orders keep different sets: min-p removes much of the top-p pool
    (most rows: four head tokens above a tail that fails min-p but holds most of the mass). Each
    row comes 8 times (at different positions, hence different noise), so that a wrong kept set
    shows in the sampled tokens."""
    g = torch.Generator().manual_seed(99)
    V = 1000

    def head_and_tail(lo: float, hi: float) -> torch.Tensor:
        x = torch.rand(V, generator=g) * (hi - lo) + lo
        x[torch.randperm(V, generator=g)[:4]] = torch.tensor([0.0, -0.5, -1.0, -1.5])
        return x

    rows = torch.stack(8 * [
        head_and_tail(-3.5, -2.5),  # unsent tokens all fail min-p: the candidates hold the vLLM pool
        head_and_tail(-3.5, -2.5),  # top-k beyond the candidates (radix select)
        torch.randn(V, generator=g) * 0.05,  # flat: min-p keeps about half, top-p by radix select
        torch.randn(V, generator=g) * 3,  # peaked
        head_and_tail(-3.5, -2.5),  # small top-k holding two tail tokens
        head_and_tail(-6.0, -2.0),  # temperature 2: part of the tail passes min-p
    ])
    params = SamplingParams(temperature=8 * [1, 1, 1, 0.9, 1, 2], top_k=8 * [0, 600, 0, 0, 6, -1],
                            top_p=8 * [0.5, 0.5, 0.3, 0.6, 0.7, 0.5],
                            min_p=8 * [0.1, 0.1, 0.85, 0.02, 0.1, 0.25], seed=7, logprobs=2)
    return rows, params


ORDER_ROWS, ORDER_PARAMS = _order_rows()


def _cases() -> list[dict]:
    g = torch.Generator().manual_seed(1234)
    cases = []

    def add(name, logits, org=None, **kw):
        cases.append(
            dict(
                name=name,
                logits=logits.float(),
                org=org or logits.shape[1],
                positions=kw.pop("positions", torch.arange(logits.shape[0]) * 7 + 3),
                **kw,
            )
        )

    mixed = SamplingParams(
        temperature=[0, 0.5, 1, 2, 0.7, 1.3, 1, 1],
        top_k=[0, 3, 50, 1, 0, 10, 0, 0],
        top_p=[1, 0.9, 0.5, 1, 0.01, 0.999, 0.3, 1],
        min_p=[0, 0, 0.1, 0, 0.05, 0, 0, 0.2],
        seed=[5, 6, 7, 8, 9, 10, 11, 2**40 + 1],
        logprobs=4,
    )
    add("mixed", torch.randn(8, 37, generator=g) * 2, org=30, params=mixed)
    ties = torch.randn(6, 37, generator=g).round()  # many exact ties across shard boundaries
    ties[:, [3, 20, 33]] = 9.0
    for name, p in [
        ("greedy", SamplingParams(temperature=0)),
        ("topk_ties", SamplingParams(temperature=1, top_k=[1, 2, 3, 4, 5, 36], seed=3)),
        ("topp_ties", SamplingParams(top_p=[0.05, 0.3, 0.5, 0.7, 0.95, 0.9999], seed=4)),
    ]:
        add(f"ties_{name}", ties, org=31, params=p)
    add(
        "all_equal",
        torch.zeros(4, 37),
        params=SamplingParams(top_p=[0.01, 0.5, 0.99, 1], top_k=[0, 0, 5, 36]),
    )
    peaked = torch.randn(8, 37, generator=g) * 6
    add(
        "peaked",
        peaked,
        org=33,
        params=SamplingParams(
            temperature=0.9, top_p=[0.5, 0.9, 0.99, 0.999] * 2, min_p=[0, 0.01, 0.1, 0] * 2, seed=17
        ),
    )
    inf = torch.randn(5, 37, generator=g)
    inf[0, [4, 30]] = float("inf")
    inf[1, :35] = float("-inf")
    inf[2, ::2] = float("-inf")
    inf[3, 1:] = float("-inf")  # only token 0 left
    inf[4, 36] = float("inf")
    add(
        "inf",
        inf,
        org=32,
        params=SamplingParams(
            temperature=[0.8, 1.0, 1.1, 1.5, 0], top_p=[0.9, 0.5, 0.8, 0.9, 1], top_k=[2, 0, 7, 0, 0]
        ),
    )
    hist = [[0, 3, 3, 36, 20], [], [35, 35, 35, 1], [7], [0, 1, 2, 3, 4, 5, 30, 31, 32, 33]]
    add(
        "penalties",
        torch.randn(5, 37, generator=g) * 3,
        org=31,
        params=SamplingParams(
            temperature=[0, 0.7, 1, 0, 1.2],
            repetition_penalty=[1.3, 1.5, 0.8, 2.0, 1.1],
            presence_penalty=[0.5, 0, 1.0, 0.2, -0.5],
            frequency_penalty=[0.2, 0.3, 0.1, 0, 0.4],
            top_k=[0, 5, 0, 0, 3],
            logprobs=3,
        ),
        token_counts=TokenCounts.from_history(hist, [[3, 9, 9], [2, 5], [], [7, 8], [36, 0]]),
    )
    allow = torch.rand(6, 100, generator=g) < 0.3
    allow[0] = False
    allow[0, 67] = True  # exactly one allowed token
    allow[1] = False
    allow[1, [0, 31, 32, 63, 64, 99]] = True  # word boundaries
    add(
        "bitmask",
        torch.randn(6, 100, generator=g) * 2,
        org=90,
        params=SamplingParams(
            temperature=[0, 1, 0.5, 1, 0.8, 0], top_p=[1, 0.9, 0.95, 1, 0.5, 1], logprobs=2
        ),
        bitmask=pack_bits(allow),
    )
    add(
        "tiny_vocab",
        torch.randn(4, 5, generator=g),
        params=SamplingParams(top_p=[1, 0.5, 0.9, 1], top_k=[0, 0, 2, 4], logprobs=5),
    )
    big = torch.randn(6, 1000, generator=g) * torch.tensor([0.05, 0.05, 1, 3, 0.05, 2])[:, None]
    add(
        "radix",
        big,
        org=990,
        params=SamplingParams(
            top_k=[300, 0, 600, 0, 700, 0],
            top_p=[1, 0.5, 0.9, 0.999, 0.95, 1],
            min_p=[0, 0, 0, 0, 0.5, 0.01],
            seed=[1, 2, 3, 4, 5, 6],
            logprobs=1,
        ),
    )
    B = 24
    rnd = torch.randn(B, 300, generator=g) * torch.rand(B, 1, generator=g) * 8
    add(
        "random_rows",
        rnd,
        org=280,
        params=SamplingParams(
            temperature=(torch.rand(B, generator=g) * 2).tolist(),
            top_k=torch.randint(0, 320, (B,), generator=g).tolist(),
            top_p=(torch.rand(B, generator=g) * 0.999 + 0.001).tolist(),
            min_p=(torch.rand(B, generator=g) * 0.3).tolist(),
            seed=torch.randint(0, 2**62, (B,), generator=g).tolist(),
        ),
        positions=torch.randint(0, 2**40, (B,), generator=g),
    )
    for order in ("hf", "vllm"):
        add(f"order_{order}", ORDER_ROWS, org=990,
            params=dataclasses.replace(ORDER_PARAMS, filter_order=order))
    huge = torch.randn(4, 37, generator=g)
    huge[0, [3, 30]] = 1e16  # two tokens share all the mass
    huge[1] = -1e16  # uniform
    huge[2] = 1e16
    huge[2, 5] = -1e16  # uniform over the other 36
    huge[3] *= 1e16  # the max takes all the mass
    add("huge", huge, org=31,
        params=SamplingParams(temperature=[1, 0.8, 0, 1.3], top_p=[1, 0.9, 1, 0.5], logprobs=3),
        # the chosen token's logprob whichever token each row samples, and the first top logprobs
        logprob=torch.tensor([-math.log(2), -math.log(37), -math.log(36), 0.0]),
        top_logprobs=[[-math.log(2)] * 2, [-math.log(37)] * 3, [-math.log(36)] * 3, [0.0]])
    # per-row logprob counts (None: none for that row), raw and processed
    for of in ("raw", "processed"):
        add(f"logprobs_per_row_{of}", torch.randn(8, 37, generator=g) * 2, org=30,
            params=dataclasses.replace(mixed, logprobs=[None, 0, 3, 1, None, 5, 2, 4], logprobs_of=of))
    # top-k beyond the candidates on its own: the search draws, from the tokens above its bucket
    # listed (few enough at 1-2 ranks and when replicated) or from the shard (3-4 ranks)
    add("top_k_draw", torch.randn(4, 20000, generator=g) * 3, org=19990,
        params=SamplingParams(temperature=[1.0, 0.7, 1.3, 1.0], top_k=[300, 1000, 257, 600],
                              min_p=[0, 0.05, 0, 0], seed=[1, 2, 3, 4]))
    return cases


CASES = _cases()


def _sample_all(cases):
    """On each rank: every case under every layout scheme; exceptions are returned, not raised
    (so later cases prove that no rank was left behind in a collective)."""
    out = {}
    for case in cases:
        V = case["logits"].shape[1]
        for i, layout in enumerate(_layouts(V, case["org"], comm.world_size())):
            junk = [float("nan"), 1e30, float("inf")][i]
            local = _shard(case["logits"], layout, comm.rank(), junk)
            comm.reset_traffic()
            with comm.recording() as sent:
                try:
                    res = sample(
                        local,
                        layout,
                        case["params"],
                        positions=case["positions"],
                        token_counts=case.get("token_counts"),
                        bitmask=case.get("bitmask"),
                    )
                except ValueError as e:
                    res = f"ValueError: {e}"
            out[case["name"], layout.scheme] = (res, comm.total_bytes(), sent)
    return out


def _sample_both_ways(cases):
    """Every case's tokens with the threshold search's rounds always on listed bucket tokens, then
    always on the shard in place (whichever a bucket's size picks, the tokens are the same)."""
    out = {}
    for share in (1, 2**62):
        search.DENSE_SHARE = share
        for case in cases:
            layout = _layouts(case["logits"].shape[1], case["org"], comm.world_size())[0]
            try:
                out[share, case["name"]] = sample(
                    _shard(case["logits"], layout, comm.rank(), float("nan")), layout, case["params"],
                    positions=case["positions"], token_counts=case.get("token_counts"),
                    bitmask=case.get("bitmask")).tokens
            except ValueError:
                pass
    return out


def test_search_rounds_listed_or_in_place_give_the_same_tokens():
    per_rank = run(_sample_both_ways, 3, CASES)
    for (share, name), tokens in per_rank[0].items():
        case = next(c for c in CASES if c["name"] == name)
        assert torch.equal(tokens, _reference(case).tokens), (share, name)
        assert all(torch.equal(r[share, name], tokens) for r in per_rank[1:])
    assert len(per_rank[0]) > len(CASES)


def _reference(case):
    return reference_sample(
        case["logits"],
        case["params"],
        positions=case["positions"],
        token_counts=case.get("token_counts"),
        bitmask=case.get("bitmask"),
    )


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.once) for n in (1, 2)] + [3, 4])
def sharded(request):
    """One launch per world size runs every case; each case is then its own named test."""
    return request.param, run(_sample_all, request.param, CASES)


@pytest.mark.exact
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_sharded_equals_reference(sharded, case):
    n, results = sharded
    ref = _reference(case)
    for scheme in ("padded", "uneven", "replicated"):
        for rank, per_rank in enumerate(results):
            got, (sent, _), measured = per_rank[case["name"], scheme]
            where = f"{case['name']} {scheme} rank {rank}/{n}"
            assert torch.equal(got.tokens, ref.tokens), f"{where}: {got.tokens} != {ref.tokens}"
            # what crossed ranks is what the call's script prices, collective for collective
            assert measured == calls(got.script, 1 if scheme == "replicated" else n), where
            if ref.logprobs is not None:
                assert torch.equal(got.top_ids, ref.top_ids), where
                assert torch.equal(got.ranks, ref.ranks), where
                assert torch.allclose(got.logprobs, ref.logprobs, atol=1e-5, equal_nan=True), where
                assert torch.allclose(got.top_logprobs, ref.top_logprobs, atol=1e-5, equal_nan=True), where
            if "logprob" in case:
                _assert_logprobs(got, case, where)
            if scheme == "replicated" or n == 1:
                assert sent == 0, where
    if "logprob" in case:
        _assert_logprobs(ref, case, f"{case['name']} reference")


def _assert_logprobs(out, case, where: str) -> None:
    """The case's expected logprobs, to 1e-6 (float32 rounding of the float64 results)."""
    torch.testing.assert_close(out.logprobs, case["logprob"], rtol=0, atol=1e-6, msg=where)
    for row, want in zip(out.top_logprobs, case["top_logprobs"]):
        torch.testing.assert_close(row[: len(want)], torch.tensor(want), rtol=0, atol=1e-6, msg=where)


def test_greedy_is_one_small_all_gather():
    B, V = 16, 1000
    logits = torch.randn(B, V)
    results = run(
        _sample_all,
        4,
        [
            dict(
                name="g",
                logits=logits,
                org=V,
                params=SamplingParams(temperature=0),
                positions=torch.zeros(B, dtype=torch.long),
            )
        ],
    )
    for per_rank in results:
        got, (sent, _), _ = per_rank["g", "padded"]
        assert torch.equal(got.tokens, logits.argmax(1))
        assert sent == 3 * B * 16  # ring all-gather of (float64 value, int64 id) per row


def test_logprobs_match_torch_log_softmax():
    case = CASES[0]
    ref = _reference(case)
    logp = torch.log_softmax(case["logits"], 1)
    assert torch.allclose(ref.logprobs, logp.gather(1, ref.tokens[:, None])[:, 0], atol=1e-5)
    top = logp.topk(4, 1)
    assert torch.allclose(ref.top_logprobs, top.values, atol=1e-5)


def _errors():
    V = 40
    layout = VocabLayout(V, comm.world_size(), scheme="uneven")
    full = torch.randn(4, V)
    nan = full.clone()
    nan[2, 17] = float("nan")
    masked = torch.ones(4, V, dtype=torch.bool)
    masked[1] = False
    masked[3] = False
    cases = [
        ("top_p", full, SamplingParams(top_p=[1, 1, 1.5, 1]), None),
        ("temperature", full, SamplingParams(temperature=[1, -1, 1, 1]), None),
        ("top_k", full, SamplingParams(top_k=[0, 0, 0, 2.5]), None),
        ("nan", nan, SamplingParams(), None),
        ("masked", full, SamplingParams(temperature=0), pack_bits(masked)),
        ("ok", full, SamplingParams(temperature=0), None),
    ]
    out = {}
    for name, logits, params, mask in cases:
        try:
            out[name] = sample(
                _shard(logits, layout, comm.rank(), 0.0),
                layout,
                params,
                positions=torch.zeros(4, dtype=torch.long),
                bitmask=mask,
            ).tokens
        except ValueError as e:
            out[name] = str(e)
    return out


def test_errors_name_rows_on_every_rank_without_hanging():
    for per_rank in run(_errors, 3, timeout=20):
        assert "row 2: top_p" in per_rank["top_p"]
        assert "row 1: temperature" in per_rank["temperature"]
        assert "row 3: top_k must be an integer" in per_rank["top_k"]
        assert "rows [2] contain NaN" in per_rank["nan"]
        assert "rows [1, 3] have no allowed token" in per_rank["masked"]
        assert isinstance(per_rank["ok"], torch.Tensor)


def test_param_validation():
    with pytest.raises(ValueError, match=r"^SamplingParams: min_p must be in \[0, 1\], got 2"):
        SamplingParams(min_p=2)  # a scalar: rejected when built
    with pytest.raises(ValueError, match="expected a scalar or 3 values"):
        SamplingParams(seed=[1, 2]).resolve(3, 10)
    with pytest.raises(ValueError, match="row 1: repetition_penalty"):
        SamplingParams(repetition_penalty=[1, 0, 1]).resolve(3, 10)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=11).resolve(3, 10)
    with pytest.raises(ValueError, match="row 0: token_counts ids must be unique"):
        TokenCounts(torch.tensor([[1, 1]]), torch.tensor([[1, 2]])).check(1, 10)
    with pytest.raises(LaunchError, match="layout is for 3 ranks"):
        run(_wrong_world, 2)


def _wrong_world():
    return sample(
        torch.zeros(1, 4),
        VocabLayout(10, 3, scheme="uneven"),
        SamplingParams(),
        positions=torch.zeros(1, dtype=torch.long),
    )


@pytest.mark.exact
def test_noise_is_independent_of_tensor_position():
    keys = row_keys(torch.tensor([3, 2**50]), torch.tensor([11, 0]))
    ids = torch.arange(5000)
    whole = gumbel(keys[:, None, :], ids)
    for start in (1, 7, 33, 4093):
        assert torch.equal(gumbel(keys[:, None, :], ids[start:]), whole[:, start:])
    assert torch.equal(gumbel(keys[1], ids.flip(0)), whole[1].flip(0))
    # a standard Gumbel: mean = Euler-Mascheroni, variance = pi^2 / 6
    assert abs(whole.mean().item() - 0.5772) < 0.03 and abs(whole.var().item() - math.pi**2 / 6) < 0.08


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    "params,keep",
    [
        (SamplingParams(temperature=0.7), None),
        (SamplingParams(temperature=1.3, top_k=4), 4),
    ],
)
def test_empirical_distribution_matches_softmax(params, keep):
    """Chi-square over 40000 seeds at one rank; the 0.9999 quantile of chi2(df) is below
    df + 4.5 sqrt(2 df) for the df used here, so a correct sampler fails about once in 10^4."""
    V, N = 10, 40000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.2, 1.2])
    z = logits.double() / params.temperature
    if keep:
        z = torch.where(z >= z.topk(keep).values[-1], z, float("-inf"))
    probs = torch.softmax(z, 0)
    full = logits.expand(N, V).contiguous()
    p = SamplingParams(temperature=params.temperature, top_k=params.top_k, seed=torch.arange(N).tolist())
    tokens = sample(full, VocabLayout(V, 1, scheme="uneven"), p, positions=torch.full((N,), 5)).tokens
    counts = torch.bincount(tokens, minlength=V).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    df = int(support.sum()) - 1
    assert _chi_square(counts[support], probs[support]) < df + 4.5 * math.sqrt(2 * df)


def test_xgrammar_mask():
    xgr = pytest.importorskip("xgrammar")
    vocab = [
        "<eos>",
        "{",
        "}",
        '"',
        "a",
        "b",
        ":",
        ",",
        " ",
        "1",
        "2",
        "true",
        "false",
        "null",
        "[",
        "]",
        "ab",
        '"a"',
        "x",
        "y",
    ] + [f"w{i}" for i in range(45)]  # 65 tokens: 3 bitmask words
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[0])
    grammar = xgr.GrammarCompiler(info).compile_grammar('root ::= "{" "\\"a\\"" ":" ("1" | "2" | "true") "}"')
    matcher = xgr.GrammarMatcher(grammar)
    mask = xgr.allocate_token_bitmask(2, info.vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    assert matcher.accept_token(1)  # "{"
    matcher.fill_next_token_bitmask(mask, 1)
    assert mask.dtype == torch.int32 and mask.shape == (2, 3)
    logits = torch.randn(2, len(vocab))
    case = dict(
        name="xgr",
        logits=logits,
        org=len(vocab),
        params=SamplingParams(temperature=[0, 1]),
        positions=torch.tensor([0, 1]),
        bitmask=mask,
    )
    ref = _reference(case)
    assert ref.tokens[0].item() == 1  # only "{" may start
    assert vocab[ref.tokens[1]] in ('"', '"a"')
    for per_rank in run(_sample_all, 3, [case]):
        for scheme in ("padded", "uneven", "replicated"):
            assert torch.equal(per_rank["xgr", scheme][0].tokens, ref.tokens)


def test_empty_batch_matches_reference_with_logprobs():
    layout = VocabLayout(10, 1)
    params = SamplingParams(temperature=0.7, top_p=0.9, logprobs=2)
    positions = torch.empty(0, dtype=torch.long)
    got = sample(torch.empty(0, layout.shard(0).rows), layout, params, positions=positions)
    want = reference_sample(torch.empty(0, 10), params, positions=positions)
    for a, b in ((got.tokens, want.tokens), (got.top_ids, want.top_ids), (got.logprobs, want.logprobs)):
        assert a.shape == b.shape and a.dtype == b.dtype


def test_filter_orders_keep_different_sets_on_the_order_rows():
    """The rows that the sharded tests run under both orders really tell the orders apart (vLLM's
    keeps a subset: its top-p pool is smaller)."""
    V = ORDER_ROWS.shape[1]
    hf, vllm = (dataclasses.replace(ORDER_PARAMS, filter_order=order).resolve(len(ORDER_ROWS), V)
                for order in ("hf", "vllm"))
    for b, x in enumerate(ORDER_ROWS):
        kept_hf, kept_vllm = kept_tokens(x, hf, b), kept_tokens(x, vllm, b)
        assert kept_vllm.sum() < kept_hf.sum() and not (kept_vllm & ~kept_hf).any(), b


def _hf_kept(x: torch.Tensor, t: float, k: int, p: float, min_p: float) -> torch.Tensor:
    """transformers' own warpers, in generate's order."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(t)(None, x[None].clone())
    if k > 0:
        scores = TopKLogitsWarper(k)(None, scores)
    if p < 1:
        scores = TopPLogitsWarper(p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores[0] != float("-inf")


def _vllm_kept(x: torch.Tensor, t: float, k: int, p: float, min_p: float) -> torch.Tensor:
    """vLLM's order, float32: min-p on the softmax, then top-k, then top-p removing the tokens whose
    ascending cumulative probability is <= 1 - p (keeping at least the largest)."""
    z = x / t
    probs = z.softmax(0)
    z = z.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if k > 0:
        z = z.masked_fill(z < z.sort(descending=True).values[k - 1], float("-inf"))
    if p < 1:
        ascending, order = z.sort()
        remove = ascending.softmax(0).cumsum(0) <= 1 - p
        remove[-1] = False
        z = z.masked_fill(torch.zeros_like(remove).scatter(0, order, remove), float("-inf"))
    return z != float("-inf")


def _near_boundary(x: torch.Tensor, t: float, k: int, p: float, min_p: float, order: str) -> bool:
    """Whether float32 rounding could decide the row: two tokens with one float32 ``x / t``, a
    probability ratio within 1e-5 (relative) of min_p, or a top-p cumulative mass within 1e-5 of
    1 - p (computed here in float64)."""
    z = x.double() / t
    ratio = (z - z.max()).exp()
    pool = z >= (z.sort(descending=True).values[k - 1] if k > 0 else -math.inf)
    if order == "vllm":
        pool &= ratio >= min_p
    w = torch.where(pool, ratio, 0.0)
    cum = w.sort().values.cumsum(0) / w.sum()
    return bool((x / t).unique().numel() < x.numel()
                or (min_p > 0 and ((ratio - min_p).abs() < 1e-5 * min_p).any())
                or (p < 1 and ((cum - (1 - p)).abs() < 1e-5).any()))


def test_kept_tokens_match_transformers_warpers_and_vllm_order():
    """``kept_tokens`` equals transformers' warpers (``"hf"``) and a vLLM-style filter (``"vllm"``)
    on random rows with distinct values and random parameters, except rows where float32
    rounding could decide a boundary (:func:`_near_boundary`; at most 5%)."""
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(5)
    B, V = 400, 128
    x = torch.randn(B, V, generator=g) * (torch.rand(B, 1, generator=g) * 3.5 + 0.5)
    assert all(row.unique().numel() == V for row in x)
    t = (torch.rand(B, generator=g) * 1.7 + 0.3).tolist()
    k = torch.where(torch.rand(B, generator=g) < 1 / 3, 0, torch.randint(1, V, (B,), generator=g)).tolist()
    p = torch.where(torch.rand(B, generator=g) < 0.25, 1.0, torch.rand(B, generator=g) * 0.95 + 0.05).tolist()
    min_p = torch.where(torch.rand(B, generator=g) < 0.25, 0.0, torch.rand(B, generator=g) * 0.3).tolist()
    kept = {}
    for order, oracle in (("hf", _hf_kept), ("vllm", _vllm_kept)):
        rows = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=min_p, filter_order=order).resolve(B, V)
        kept[order] = [kept_tokens(x[b], rows, b) for b in range(B)]
        decided = [b for b in range(B) if not _near_boundary(x[b], t[b], k[b], p[b], min_p[b], order)]
        assert len(decided) >= 0.95 * B, order
        for b in decided:
            assert torch.equal(kept[order][b], oracle(x[b], t[b], k[b], p[b], min_p[b])), (order, b)
    assert any(not torch.equal(a, b) for a, b in zip(kept["hf"], kept["vllm"]))


def test_penalties_repetition_over_prompt_presence_and_frequency_over_output():
    """Token 1 only in the prompt, 2 only generated (twice), 3 in both, 4 in neither."""
    x = torch.tensor([[1.0, 2.0, -2.0, 3.0, 4.0]])
    counts = TokenCounts.from_history([[2, 3, 2]], prompts=[[1, 3, 1]])
    assert counts.ids.tolist() == [[1, 2, 3]] and counts.counts.tolist() == [[0, 2, 1]]
    assert counts.in_prompt.tolist() == [[True, False, True]]
    rows = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25).resolve(1, 5)
    got = penalise(x, counts.ids, counts.ids >= 0, counts, rows)
    want = torch.tensor([[1.0, 2.0 / 2, -2.0 * 2 - 0.5 - 2 * 0.25, 3.0 / 2 - 0.5 - 0.25, 4.0]])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    without_prompt = TokenCounts.from_history([[2, 3, 2]])
    assert without_prompt.in_prompt is None
    got = penalise(x, without_prompt.ids, without_prompt.ids >= 0, without_prompt, rows)
    torch.testing.assert_close(got[0, 1], x[0, 1])  # prompt-only token: untouched without prompts


def test_token_counts_validation():
    ids, counts = torch.tensor([[1, -1]]), torch.tensor([[1, 0]])
    TokenCounts(ids, counts, torch.tensor([[True, False]])).check(1, 10)
    with pytest.raises(ValueError, match="in_prompt must be None or a bool tensor of the shape of ids"):
        TokenCounts(ids, counts, torch.tensor([[1, 0]])).check(1, 10)
    with pytest.raises(ValueError, match="in_prompt must be None or a bool tensor of the shape of ids"):
        TokenCounts(ids, counts, torch.tensor([True, False])).check(1, 10)
    with pytest.raises(ValueError, match="row 0: token_counts in_prompt must be False at empty slots"):
        TokenCounts(ids, counts, torch.tensor([[True, True]])).check(1, 10)
    with pytest.raises(ValueError, match="2 histories but 1 prompts"):
        TokenCounts.from_history([[1], [2]], prompts=[[3]])


def test_top_k_minus_one_is_off():
    logits = torch.randn(3, 50)
    positions = torch.arange(3)
    assert SamplingParams(top_k=[-1, 5, 0]).resolve(3, 50).top_k.tolist() == [0, 5, 0]
    off, minus_one = (reference_sample(logits, SamplingParams(top_k=k, seed=[1, 2, 3]), positions=positions)
                      for k in (0, -1))
    assert torch.equal(minus_one.tokens, off.tokens)
    with pytest.raises(ValueError, match=r"row 1: top_k must be >= -1 \(0 and -1 are off\), got -2"):
        SamplingParams(top_k=[0, -2, 1]).resolve(3, 50)


@pytest.mark.parametrize("field,value,message", [
    ("seed", 2**64, "seed: expected an integer in"),
    ("seed", [1, 2**64], "seed: expected a scalar or 2 integers"),
    ("seed", 1e30, "SamplingParams: seed must be an integer in"),
    ("top_k", 2**70, "top_k: expected an integer in"),
    ("top_k", [3, float("nan")], "row 1: top_k must be an integer"),
    ("top_k", "5", "top_k: expected an integer in"),
    ("temperature", 2**2000, "temperature: expected a real number"),
    ("top_p", [0.5, None], "top_p: expected a scalar or 2 real numbers"),
    ("filter_order", "sglang", r"filter_order must be one of \('hf', 'vllm'\), got 'sglang'"),
])
def test_unconvertible_values_name_their_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).resolve(2, 10)


def test_per_row_logprobs_and_processed_logprobs_follow_their_definitions():
    """Per-row counts cut each row's top list (NaN / -1 past it, nothing for None rows); raw
    logprobs are ``log_softmax`` of the logits; processed ones, of what transformers' warpers
    (temperature, top-k, top-p, min-p) leave -- vLLM's ``processed_logprobs``."""
    pytest.importorskip("transformers")
    case = next(c for c in CASES if c["name"] == "logprobs_per_row_processed")
    x, params = case["logits"], case["params"]
    counts = params.logprobs
    processed = _reference(case)
    raw = reference_sample(x, dataclasses.replace(params, logprobs_of="raw"), positions=case["positions"])
    assert torch.equal(processed.tokens, raw.tokens)
    compared = 0
    for b, n in enumerate(counts):
        if n is None:
            assert processed.logprobs[b].isnan() and processed.ranks[b] == -1 and processed.top(b) == []
            continue
        assert len(processed.top(b)) == n and processed.top_ids[b, n:].eq(-1).all()
        logp = torch.log_softmax(x[b].double(), 0)
        assert abs(raw.logprobs[b] - logp[raw.tokens[b]]) < 1e-5
        assert raw.ranks[b] == 1 + (x[b] > x[b, raw.tokens[b]]).sum()
        if params.temperature[b] == 0:  # greedy rows: no temperature or filters to apply
            warped = x[b]
        else:
            t, k, p, m = (float(getattr(params, f)[b]) for f in ("temperature", "top_k", "top_p", "min_p"))
            k = int(k)
            if _near_boundary(x[b], t, k if k < x.shape[1] else 0, p, m, "hf"):  # rounding could decide
                continue
            warped = torch.where(_hf_kept(x[b], t, k, p, m), x[b] / t, float("-inf"))
        want = torch.log_softmax(warped.double(), 0)
        assert abs(processed.logprobs[b] - want[processed.tokens[b]]) < 1e-5, b
        top = [(i, lp) for i, lp in processed.top(b) if lp > float("-inf")]
        assert [i for i, _ in top] == want.topk(len(top)).indices.tolist(), b
        compared += 1
    assert compared >= 4


def _families(B: int, V: int) -> dict[str, torch.Tensor]:
    """The benchmark's logit families at a small size: peaked, flat, zipf (see bench_sampling),
    and tied: eight values shared by every token."""
    g = torch.Generator().manual_seed(3)
    zipf = torch.stack([-1.1 * torch.log1p(torch.randperm(V, generator=g).float()) for _ in range(B)])
    return {"peaked": torch.randn(B, V, generator=g) * 5, "flat": torch.randn(B, V, generator=g) * 0.5,
            "zipf": zipf + torch.randn(B, V, generator=g) * 0.1,
            "tied": torch.randint(0, 8, (B, V), generator=g).float() * 0.25}


# config -> (family, params, the most collectives a call may take with the agreement check off)
COLLECTIVE_COUNTS = {
    "greedy": ("peaked", SamplingParams(temperature=0), 1),
    "mixed": ("peaked", SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05), 1),
    **{f"top-p {family}": (family, SamplingParams(top_p=0.9), 4)
       for family in ("peaked", "flat", "zipf", "tied")},
    "top-k 1000": ("peaked", SamplingParams(top_k=1000), 4),
    "top-k 1000 tied": ("tied", SamplingParams(top_k=1000), 4),
    "min-p flat": ("flat", SamplingParams(min_p=0.1), 2),
    "top-p flat logprobs": ("flat", SamplingParams(top_p=0.9, logprobs=2), 6),
    "top-p flat processed": ("flat", SamplingParams(top_p=0.9, logprobs=2, logprobs_of="processed"), 6),
}


def _count_collectives():
    B, V = 16, 12000
    out = {}
    families = _families(B, V)
    for scheme in ("padded", "uneven"):
        layout = VocabLayout(V, comm.world_size(), scheme=scheme)
        for name, (family, params, _) in COLLECTIVE_COUNTS.items():
            local = _shard(families[family], layout, comm.rank(), 0.0)
            p = dataclasses.replace(params, seed=list(range(B)))
            counts = {}
            for check in (False, True):
                comm.reset_traffic()
                with comm.recording() as measured:
                    got = sample(local, layout, p, positions=torch.arange(B), check=check)
                counts[check] = {k: c.calls for k, c in comm.traffic().items()}
                assert measured == calls(got.script, comm.world_size()), (scheme, name, check)
            out[scheme, name] = got.tokens, counts
    return out


def test_collectives_per_call_keep_their_bound_and_tokens_exact():
    """Each benchmark configuration takes at most its collectives per ``sample()`` call (top-p:
    4, whatever the rows hold), the ones its script prices (the agreement check adds exactly
    one), and the tokens stay those of ``reference_sample``."""
    B, V = 16, 12000
    families = _families(B, V)
    refs = {name: reference_sample(families[family], dataclasses.replace(params, seed=list(range(B))),
                                   positions=torch.arange(B)).tokens
            for name, (family, params, _) in COLLECTIVE_COUNTS.items()}
    for per_rank in run(_count_collectives, 4, timeout=120):
        for (scheme, name), (tokens, counts) in per_rank.items():
            bound = COLLECTIVE_COUNTS[name][2]
            assert torch.equal(tokens, refs[name]), (scheme, name)
            assert sum(counts[False].values()) <= bound, (scheme, name, counts[False])
            assert counts[True].pop("agreement") == 1 and counts[True] == counts[False], (scheme, name)
