"""The planner's launch and host-read tables (vocabpar.plan.host) equal what vocabpar's own code
paths do, counted on real gloo ranks (tests/host_probe.py): the functional sampler and verifier per
key on peaked rows (typical) and on peaked, flat, Zipf and tied rows (at most the worst), scoring
and each collection strategy at two world sizes. When the code changes, this fails and names the
entry to update."""

import host_probe
import pytest

from vocabpar.launch import run
from vocabpar.plan import host


def _busiest(per_rank: list[dict], part: str, key) -> tuple[int, int]:
    return max(r[part][key] for r in per_rank)


@pytest.fixture(scope="module")
def two_ranks():
    return run(host_probe.measure, 2, 4, timeout=300, run_timeout=600)


@pytest.fixture(scope="module")
def three_ranks():
    return run(host_probe.measure, 3, 7, ("score", "collect"), timeout=300, run_timeout=600)


def test_functional_sampler_table(two_ranks):
    for key in host.SAMPLER_KEYS:
        table = host.FUNCTIONAL[key]
        typical = _busiest(two_ranks, "sample", (key, "peaked"))
        assert typical == (table.launches, table.reads), (key, typical)
        seen = [_busiest(two_ranks, "sample", (key, name)) for name in host_probe.families()]
        worst = (max(s[0] for s in seen), max(s[1] for s in seen))
        assert worst == (table.launches_worst, table.reads_worst), key


def test_functional_verifier_table(two_ranks):
    for (key, draft), table in host.FUNCTIONAL_VERIFY.items():
        typical = _busiest(two_ranks, "verify", (key, draft, "peaked"))
        assert typical == (table.launches, table.reads), (key, draft, typical)
        for name in host_probe.families():
            launches, reads = _busiest(two_ranks, "verify", (key, draft, name))
            assert launches <= table.launches_worst and reads <= table.reads_worst, (key, draft, name)


@pytest.mark.parametrize("ranks", [2, 3])
def test_scoring_and_collection_tables(ranks, two_ranks, three_ranks):
    measured = two_ranks if ranks == 2 else three_ranks
    for top_n in (0, 5):
        work = host.score_work("functional", top_n, ranks, 1)
        assert _busiest(measured, "score", top_n) == (work.launches, work.reads), top_n
    for strategy in ("all_gather", "gather", "all_to_all", "dp_gather_scatter", "none", "replicated"):
        work = host.collect_work(strategy, ranks)
        assert _busiest(measured, "collect", strategy) == (work.launches, work.reads), strategy
    for ids in ("broadcast_ids", "all_gather_ids"):  # the collective alone
        assert _busiest(measured, "collect", ids) == (0, 0)


def test_counts_do_not_depend_on_the_batch(two_ranks):
    """The functional sampler's counts per call at 4 rows equal those at 7 rows and 3 ranks."""
    keys = (host.SamplerKey(True), host.SamplerKey(False, "candidates", True, False))
    wider = run(host_probe.measure, 3, 7, ("sample",), keys, timeout=300, run_timeout=600)
    for key in keys:
        assert _busiest(wider, "sample", (key, "peaked")) == _busiest(two_ranks, "sample", (key, "peaked"))


def test_engine_sampler_table_holds_for_every_family(two_ranks):
    """The engine Sampler launches the same ops whatever the logits (a fixed script; ATen may
    add one copy on some inputs) and reads nothing on the host."""
    assert set(host.ENGINE) == set(host.SAMPLER_KEYS)
    for key in host.SAMPLER_KEYS:
        seen = [_busiest(two_ranks, "engine", (key, name)) for name in host_probe.families()]
        assert max(s[0] for s in seen) == host.ENGINE[key].launches, (key, seen)
        assert max(s[0] for s in seen) - min(s[0] for s in seen) <= 1 and all(s[1] == 0 for s in seen), key
        assert host.sampler_work("engine", key).reads == 1  # the flags, read once per step
        for draft in (False, True) if not key.greedy else (False,):
            seen = [_busiest(two_ranks, "engine", (key, draft, name)) for name in host_probe.families()]
            work = host.verify_work("engine", key, draft)
            assert max(s[0] for s in seen) == work.launches and all(s[1] == 0 for s in seen), (key, draft)
    with pytest.raises(ValueError, match="unknown sampler"):
        host.sampler_work("magic", host.SamplerKey(True))
