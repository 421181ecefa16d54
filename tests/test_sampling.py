"""Sampling on sharded logits against the single-device oracle, on real gloo ranks.

One launch per world size runs every case under every layout scheme; the main process compares
each rank's output with ``reference_sample`` on the full logits."""

import math

import pytest
import torch

from vocabpar import SamplingParams, VocabLayout, comm, reference_sample, sample
from vocabpar.launch import LaunchError, run
from vocabpar.sampling import TokenCounts
from vocabpar.sampling.noise import gumbel, row_keys


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


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """xgrammar-format int32 words from a bool [B, V] mask (test helper)."""
    B, V = allowed.shape
    words = math.ceil(V / 32)
    bits = torch.zeros(B, words * 32, dtype=torch.long)
    bits[:, :V] = allowed.long()
    packed = (bits.view(B, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).int()


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
        token_counts=TokenCounts.from_history(hist),
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
        bitmask=_bitmask(allow),
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
            out[case["name"], layout.scheme] = (res, comm.total_bytes())
    return out


def _reference(case):
    return reference_sample(
        case["logits"],
        case["params"],
        positions=case["positions"],
        token_counts=case.get("token_counts"),
        bitmask=case.get("bitmask"),
    )


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sharded_equals_reference(n):
    results = run(_sample_all, n, CASES)
    for case in CASES:
        ref = _reference(case)
        for scheme in ("padded", "uneven", "replicated"):
            for rank, per_rank in enumerate(results):
                got, (sent, _) = per_rank[case["name"], scheme]
                where = f"{case['name']} {scheme} rank {rank}/{n}"
                assert torch.equal(got.tokens, ref.tokens), f"{where}: {got.tokens} != {ref.tokens}"
                if ref.logprob is not None:
                    assert torch.equal(got.top_ids, ref.top_ids), where
                    assert torch.allclose(got.logprob, ref.logprob, atol=1e-5), where
                    assert torch.allclose(got.top_logprobs, ref.top_logprobs, atol=1e-5), where
                if scheme == "replicated" or n == 1:
                    assert sent == 0, where


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
        got, (sent, _) = per_rank["g", "padded"]
        assert torch.equal(got.tokens, logits.argmax(1))
        assert sent == 3 * B * 16  # ring all-gather of (float64 value, int64 id) per row


def test_logprobs_match_torch_log_softmax():
    case = CASES[0]
    ref = _reference(case)
    logp = torch.log_softmax(case["logits"], 1)
    assert torch.allclose(ref.logprob, logp.gather(1, ref.tokens[:, None])[:, 0], atol=1e-5)
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
        ("masked", full, SamplingParams(temperature=0), _bitmask(masked)),
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
    with pytest.raises(ValueError, match="row 0: min_p"):
        SamplingParams(min_p=2).resolve(3, 10)
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
    for a, b in ((got.tokens, want.tokens), (got.top_ids, want.top_ids), (got.logprob, want.logprob)):
        assert a.shape == b.shape and a.dtype == b.dtype
