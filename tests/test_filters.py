"""The filter registry (vocabpar.wire.filters): every filter stated once, and what the planner, the
command line and the host-work keys read from it."""

import dataclasses
import json
import re

import pytest

from vocabpar import cli
from vocabpar.integrations.decode import planned_sampling
from vocabpar.plan import Sampling, host
from vocabpar.plan.model import sampler_traffic
from vocabpar.sampling import SamplingParams
from vocabpar.wire import filters
from vocabpar.wire.records import round_one

SIGMA_WORDS = filters.BY_NAME["top_n_sigma"].words


def test_every_key_is_named_once_and_its_example_takes_it():
    """Greedy, then every combination of the filters' states; the sampling the launch counts are
    measured on (``example``) takes exactly its key at the probe's shape (2 ranks of 2000 tokens)."""
    keys = filters.keys()
    states = 1
    for f in filters.FILTERS:
        states *= 1 + len(f.examples)
    assert len(keys) == len(set(keys)) == 1 + states
    assert keys[:2] == ("greedy", "temperature")
    vocab, ranks, widest = 4000, 2, 2000
    for key in keys:
        s = filters.example(key)
        assert s.key(vocab, s.candidates(ranks, widest)) == key
        if key != "greedy":
            assert filters.name_of({name: filters.states(key).get(name) for name in filters.BY_NAME}) == key
    for bad in ("top_k=all", "min_p+top_p", "top_p=on"):  # unknown, out of order, not as named
        with pytest.raises(ValueError, match=re.escape(f"'{bad}' is no entry name")):
            filters.states(bad)


def test_a_sampling_checks_its_fields_and_says_what_it_does():
    assert [f.name for f in dataclasses.fields(Sampling)] == ["temperature"] + list(filters.BY_NAME)
    assert all(getattr(Sampling(), f.name) == f.off for f in filters.FILTERS)
    assert Sampling().greedy and Sampling().describe() == "greedy"
    s = Sampling(0.8, top_k=50, top_n_sigma=1.5)
    assert s.describe() == "temperature 0.8, top-k 50, top-n-sigma 1.5"
    assert s.key(32000, s.candidates(8, 4000)) == "top_k=candidates+top_n_sigma"
    assert Sampling(1.0, top_k=32000).key(32000, 1) == "temperature"  # the whole vocabulary filters nothing
    for bad, field in (({"top_p": 0.0}, "top_p"), ({"min_p": 1.5}, "min_p"), ({"top_k": -1}, "top_k"),
                       ({"top_n_sigma": -1.0}, "top_n_sigma"), ({"temperature": -1.0}, "temperature")):
        with pytest.raises(ValueError, match=rf"^{field} must be in \["):
            Sampling(**bad)
    with pytest.raises(TypeError, match="typical_p"):
        Sampling(typical_p=0.5)
    with pytest.raises(ValueError, match=r"^top_k must be an integer, got 50.5"):
        Sampling(1.0, top_k=50.5)


def test_candidates_cover_each_filter_s_need():
    assert filters.candidate_count(8, 4000, {}) == 1
    assert filters.candidate_count(8, 4000, {"top_k": [50.0, 1000.0, 0.0]}) == 50  # 1000 searches instead
    assert isinstance(filters.candidate_count(8, 4000, {"top_k": [50.0]}), int)
    assert filters.candidate_count(8, 4000, {"top_p": [1.0, 0.9]}) == 64  # 512 over 8 ranks
    assert filters.candidate_count(8, 4000, {"min_p": [0.1], "top_n_sigma": [1.0]}) == 16
    assert filters.candidate_count(2, 100, {"top_k": [200], "top_p": [0.9]}) == 100  # at most the shard


def test_a_batch_is_planned_as_its_most_demanding_rows():
    columns = {"top_k": [40, 0], "top_p": [0.95, 0.8], "min_p": [0.0, 0.05], "top_n_sigma": [0.0, 2.0]}
    assert filters.strictest(columns) == Sampling(1.0, top_k=40, top_p=0.8, min_p=0.05, top_n_sigma=2.0)
    assert filters.strictest({f.name: [] for f in filters.FILTERS}) == Sampling()
    params = SamplingParams(temperature=[0.0, 0.7, 0.9], top_k=[5, -1, 20], top_p=[0.1, 0.9, 1.0],
                            top_n_sigma=[3.0, 0.0, 1.0])
    assert planned_sampling(params, 3, 1000) == Sampling(1.0, top_k=20, top_p=0.9, top_n_sigma=1.0)
    assert planned_sampling(SamplingParams(temperature=0.0, top_p=0.5), 2, 1000) == Sampling()
    wide = SamplingParams(top_k=-1, top_p=1e-12, top_n_sigma=1e9)  # on, beyond the planner's ranges
    assert planned_sampling(wide, 2, 1000) == Sampling(1.0, top_p=1e-9, top_n_sigma=1e6)


def test_the_planner_prices_top_n_sigma_s_words_in_round_one():
    B, n, widest, V = 16, 4, 3000, 12000
    plain = sampler_traffic(B, n, widest, V, Sampling(1.0, top_k=50))
    sigma = sampler_traffic(B, n, widest, V, Sampling(1.0, top_k=50, top_n_sigma=1.0))
    assert round_one(50, masks=("top_n_sigma",)).nbytes(B) - round_one(50).nbytes(B) == B * SIGMA_WORDS * 8
    assert sigma.collectives == plain.collectives
    assert sigma.bytes - plain.bytes == (n - 1) * B * SIGMA_WORDS * 8
    # alone it asks round one for one candidate, whose rows then draw by an all-gather, as plain
    # temperature does
    price = lambda **kw: sampler_traffic(B, n, widest, V, Sampling(1.0, **kw))  # noqa: E731
    alone, plain = price(top_n_sigma=1.0), price()
    assert alone.collectives == plain.collectives
    assert alone.bytes - plain.bytes == (n - 1) * B * SIGMA_WORDS * 8
    # with top-p, its floor typically leaves nothing unsent: no total to all-reduce; the worst case
    # keeps every collective top-p may take
    top_p, both = price(top_p=0.9), price(top_p=0.9, top_n_sigma=1.0)
    assert both.collectives == top_p.collectives - 1 and both.collectives_worst == top_p.collectives_worst


def test_the_dense_sampler_adds_each_filter_s_work():
    """vLLM's sampler on full rows: temperature and the draw 6 launches, top-k 6, top-p 6 (8
    alone), min-p 5 and a host read, top-n-sigma 4 (estimated: vLLM has none), as each registry
    entry states it; an entry without that price is refused."""
    keys = ("greedy", "temperature", "top_p", "top_k=search+top_p", "min_p", "top_n_sigma")
    work = [host.sampler_work("dense", key) for key in keys]
    assert [(w.launches, w.reads) for w in work] == [(2, 0), (6, 0), (14, 0), (18, 0), (11, 1), (10, 0)]
    assert {name: (w.launches, w.reads) for name, w in host.DENSE_FILTERS.items()} == \
        {f.name: f.dense_price for f in filters.FILTERS}  # read from the registry
    with pytest.raises(ValueError, match="filter top_x: state its dense_price"):
        dataclasses.replace(filters.BY_NAME["top_k"], name="top_x", dense_price=None)
    extra = host.DENSE_FILTERS["min_p"] + host.DENSE_FILTERS["top_n_sigma"]
    assert host.verify_work("dense", "top_k=candidates+min_p+top_n_sigma", False) == \
        host.DENSE_VERIFY[False, True, False] + extra


def test_the_command_line_has_one_option_per_filter(capsys):
    """``vocabpar plan`` takes every filter of the registry, priced like the others; a value out
    of its range is refused naming the option."""
    assert cli.main(["plan", "--help"]) == 0
    shown = capsys.readouterr().out
    for f in filters.FILTERS:
        assert f"--{f.name.replace('_', '-')}" in shown and f"{f.label} of a sampled step" in shown
    assert cli.main(["plan", "--preset", "llama-3.1-8b", "--top-n-sigma", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["sampling"] == {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                           "top_n_sigma": 1.0}
    assert cli.main(["plan", "--preset", "llama-3.1-8b", "--top-n-sigma", "-1"]) == 2
    assert "--top-n-sigma: must be a number in [0, 1e+06], got '-1'" in capsys.readouterr().err


def test_every_key_is_priced_by_every_sampler_in_every_mode():
    """A filter in the registry reaches every price: each entry name is in the measured tables
    and in the hand-typed dense ones, for sampling and verification, eager and compiled."""
    for key in filters.keys():
        for sampler in host.SAMPLERS:
            for compiled in (False, True):
                assert host.sampler_work(sampler, key, compiled).launches > 0, (key, sampler, compiled)
                for draft_logits in (False, True):
                    assert host.verify_work(sampler, key, draft_logits, compiled).launches > 0
