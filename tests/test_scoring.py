"""Log-probabilities of given tokens on vocab shards against torch.log_softmax of full rows.

One launch per world size scores every case under every layout; the main process compares."""

import pytest
import torch

from vocabpar import VocabLayout, comm, token_logprobs
from vocabpar.launch import run
from vocabpar.wire.scripts import CHECK, calls, score_script

TOP_N = 5


def _cases():
    g = torch.Generator().manual_seed(7)
    cases = {}
    logits = torch.randn(12, 1030, generator=g) * 3
    logits[0] = 1e4 + torch.randn(1030, generator=g)  # magnitudes where LSE is ~1e4
    logits[1, 5:] = float("-inf")  # few finite tokens; scored token finite
    logits[2, ::3] = 2.0  # ties, also across shards
    logits[3, 100] = float("-inf")  # scored token is -inf
    ids = torch.randint(0, 1030, (12,), generator=g)
    ids[1], ids[2], ids[3] = 3, 6, 100
    cases["mixed"] = (logits, ids, 1000)  # 30 added ids
    cases["tiny"] = (torch.randn(3, 5, generator=g), torch.tensor([4, 0, 2]), 5)  # empty trailing shard
    cases["empty"] = (torch.randn(0, 1030, generator=g), torch.zeros(0, dtype=torch.long), 1000)
    return cases


CASES = _cases()


def _layouts(V, org, n):
    return [VocabLayout(V, n, org_vocab_size=org, pad_to=8, scheme=scheme)
            for scheme in ("padded", "uneven", "replicated")]


def _score_all():
    n, me = comm.world_size(), comm.rank()
    out = {}
    for name, (full, ids, org) in CASES.items():
        for layout in _layouts(full.shape[1], org, n):
            local = layout.local_token_ids(0 if layout.scheme == "replicated" else me)
            shard = torch.where(local >= 0, full[:, local.clamp(min=0)], float("nan"))  # padding ignored
            comm.reset_traffic()
            with comm.recording() as measured:
                got = token_logprobs(shard, layout, ids, top_n=min(TOP_N, full.shape[1]))
            out[name, layout.scheme] = got, comm.total_bytes()[1], measured
    bad = {
        "id_out_of_range": lambda: token_logprobs(shard, layout, ids.index_fill(0, torch.tensor([0]), 1030)
                                                  if me == 0 else ids),
        "wrong_length": lambda: token_logprobs(shard, layout, ids[:2]),
        "not_fp32": lambda: token_logprobs(shard.double(), layout, ids),
        "width": lambda: token_logprobs(shard[:, 1:], layout, ids),
    }
    layout = VocabLayout(1030, n, org_vocab_size=1000)
    local = layout.local_token_ids(me)
    full, ids, _ = CASES["mixed"]
    shard = torch.where(local >= 0, full[:4, local.clamp(min=0)], 0.0)
    ids = ids[:4]
    for name, call in bad.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    # a forced-token row (+inf) and a NaN row get log_softmax's answer; the others stay exact
    odd = full[:4].clone()
    odd[0, 7], odd[1, 3] = float("inf"), float("nan")
    out["non_finite"] = odd, token_logprobs(torch.where(local >= 0, odd[:, local.clamp(min=0)], 0.0), layout,
                                            ids, top_n=2)
    return out


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def scored(request):
    return request.param, run(_score_all, request.param)


def _reference(full, ids, top_n):
    logp = torch.log_softmax(full.double(), 1)
    chosen = full.gather(1, ids[:, None])
    ranks = 1 + (full > chosen).sum(1)
    order = torch.argsort(-full.double(), dim=1, stable=True)[:, :top_n]  # ties: lowest id first
    return logp.gather(1, ids[:, None])[:, 0], ranks, order, logp.gather(1, order)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_log_softmax_of_full_rows(scored, name):
    n, per_rank = scored
    full, ids, _ = CASES[name]
    top_n = min(TOP_N, full.shape[1])
    logp, ranks, order, top_logp = _reference(full, ids, top_n)
    lse = torch.logsumexp(full.double(), 1)
    tol = 2e-5 * lse.abs().clamp(min=1)
    for out in per_rank:
        for scheme in ("padded", "uneven", "replicated"):
            first = per_rank[0][name, scheme][0]
            got, _, measured = out[name, scheme]
            where = f"{name} {scheme} n={n}"
            # what crossed ranks is the scorer's script (after the agreement check), as priced
            script = (CHECK,) + score_script(ids.shape[0], top_n)
            assert measured == calls(script, 1 if scheme == "replicated" else n), where
            assert got.logprobs.dtype == torch.float32 and got.logprobs.shape == ids.shape, where
            finite = logp.isfinite()
            assert torch.equal(got.logprobs.isfinite(), finite), where
            assert ((got.logprobs.double() - logp).abs()[finite] <= tol[finite]).all(), where
            assert torch.equal(got.ranks, ranks), where
            assert torch.equal(got.top_ids, order), where
            assert ((got.top_logprobs.double() - top_logp).abs() <= tol[:, None]).all(), where
            # every rank merges the same gathered numbers in the same order: identical bits
            # (across layouts the shards' partial sums differ, hence the tolerance above)
            for a, b in zip((got.logprobs, got.ranks, got.top_ids, got.top_logprobs),
                            (first.logprobs, first.ranks, first.top_ids, first.top_logprobs)):
                assert torch.equal(a, b), f"{where}: ranks differ"


def test_bytes_received_are_bounded_and_independent_of_vocab(scored):
    n, per_rank = scored
    for out in per_rank:
        for name, (full, ids, _) in CASES.items():
            top_n = min(TOP_N, full.shape[1])
            T = ids.numel()
            for scheme in ("padded", "uneven"):
                received = out[name, scheme][1]
                assert received <= T * (64 + 24 * top_n) * n  # whatever V: O(T·top_n) per rank
            assert out[name, "replicated"][1] == 0


@pytest.mark.parametrize("name,message", [
    ("id_out_of_range", "token id 1030 is outside [0, 1030)"),
    ("wrong_length", "token_ids must be int64 [4]"),
    ("not_fp32", "local logits must be float32"),
    ("width", "local logits must be float32"),
])
def test_bad_input_fails_every_rank(scored, name, message):
    n, per_rank = scored
    for me, out in enumerate(per_rank):
        if name == "id_out_of_range" and me != 0:  # only rank 0 passed the bad id
            assert "rank(s) [0] rejected their input" in out[name]
        else:
            assert message in out[name], out[name]


def test_rows_with_nan_or_inf_get_nan_and_the_others_stay_exact(scored):
    n, per_rank = scored
    for out in per_rank:
        odd, got = out["non_finite"]
        ids = CASES["mixed"][1][:4]
        want = torch.log_softmax(odd.double(), 1).gather(1, ids[:, None])[:, 0]
        assert got.logprobs[:2].isnan().all() and got.top_logprobs[:2].isnan().all(), n
        torch.testing.assert_close(got.logprobs[2:].double(), want[2:], rtol=0, atol=1e-5)
