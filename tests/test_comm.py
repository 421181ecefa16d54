import os
import time

import pytest
import torch

from vocabpar import comm
from vocabpar.launch import LaunchError, run


def _exercise_primitives():
    """Every primitive at this world size; returns what each rank saw plus its byte counters."""
    n, r = comm.world_size(), comm.rank()
    comm.reset_traffic()
    out = {}
    t = torch.full((5, 3), float(r + 1))
    out["all_reduce"] = comm.all_reduce(t.clone())
    out["all_reduce_max"] = comm.all_reduce_max(torch.tensor([float(r), -float(r)]))
    out["all_gather"] = comm.all_gather(torch.arange(4) + 10 * r)
    out["all_gather_empty"] = comm.all_gather(torch.empty(0, 7))
    uneven = torch.arange(r * 2).reshape(r, 2) if r else torch.empty(0, 2, dtype=torch.long)
    out["uneven_known"] = comm.all_gather_uneven(uneven, sizes=list(range(n)))
    out["uneven_exchanged"] = comm.all_gather_uneven(uneven)
    out["gather"] = comm.gather(torch.tensor([r, r * r]), dst=n - 1)
    out["broadcast"] = comm.broadcast(torch.tensor([r * 7]), src=n - 1)
    # all_to_all: rank r sends (d + 1) rows valued 100*r + d to rank d
    rows = torch.cat([torch.full((d + 1, 2), 100 * r + d) for d in range(n)])
    out["all_to_all"] = comm.all_to_all(rows, [d + 1 for d in range(n)], [r + 1] * n)
    out["traffic"] = {k: (v.calls, v.sent, v.received) for k, v in comm.traffic().items()}
    with pytest.raises(ValueError, match="do not match"):
        comm.all_gather_uneven(torch.zeros(1, 2), sizes=[5] * n)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_primitives_and_byte_counters(n):
    results = run(_exercise_primitives, n)
    for r, out in enumerate(results):
        assert torch.equal(out["all_reduce"], torch.full((5, 3), n * (n + 1) / 2))
        assert out["all_reduce_max"].tolist() == [n - 1, 0]
        assert torch.equal(out["all_gather"], torch.stack([torch.arange(4) + 10 * k for k in range(n)]))
        assert out["all_gather_empty"].shape == (n, 0, 7)
        for key in ("uneven_known", "uneven_exchanged"):
            got = out[key]
            assert [g.shape[0] for g in got] == list(range(n))
            assert all(torch.equal(g, torch.arange(k * 2).reshape(k, 2)) for k, g in enumerate(got))
        if r == n - 1:
            assert out["gather"].tolist() == [[k, k * k] for k in range(n)]
        else:
            assert out["gather"] is None
        assert out["broadcast"].tolist() == [(n - 1) * 7]
        expect = torch.cat([torch.full((r + 1, 2), 100 * k + r) for k in range(n)])
        assert torch.equal(out["all_to_all"], expect)
        traffic = out["traffic"]
        if n == 1:
            assert traffic == {}
            continue
        ring = round(2 * (n - 1) / n * 60)  # 15 float32 values
        ring_max = round(2 * (n - 1) / n * 8)
        assert traffic["all_reduce"] == (2, ring + ring_max, ring + ring_max)
        # all_gather: 4 int64 + empty + uneven (padded to n-1 rows of 2 int64) twice + sizes
        chunk = (n - 1) * 16
        ag = (n - 1) * (32 + 0 + chunk + chunk + 8)
        assert traffic["all_gather"] == (5, ag, ag)
        assert traffic["gather"] == (1, 0 if r == n - 1 else 16, 16 * (n - 1) if r == n - 1 else 0)
        assert traffic["broadcast"] == (1, 8 * (n - 1) if r == n - 1 else 0, 0 if r == n - 1 else 8)
        sent = sum(d + 1 for d in range(n) if d != r) * 16
        assert traffic["all_to_all"] == (1, sent, (n - 1) * (r + 1) * 16)


def _handshake(vocab_for_rank):
    from vocabpar import VocabLayout
    layout = VocabLayout(vocab_for_rank[comm.rank()], comm.world_size())
    comm.verify_consistent(**layout.describe(), hidden_size=64, dtype="torch.bfloat16")
    return comm.traffic()["handshake"].calls


def test_handshake_passes_when_consistent():
    assert run(_handshake, 3, [100, 100, 100]) == [2, 2, 2]  # sizes, then payload


def test_handshake_names_field_and_ranks_on_every_rank():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run(_handshake, 3, [100, 99, 100], timeout=20)
    assert time.monotonic() - start < 15
    failures = info.value.failures
    assert sorted(failures) == [0, 1, 2]
    for why in failures.values():
        assert "ConsistencyError" in why
        assert "vocab_size: rank 0,2 has 100; rank 1 has 99" in why


def _die_in_collective():
    if comm.rank() == 1:
        os._exit(3)
    comm.all_reduce(torch.ones(4))  # rank 1 never joins
    return "finished"


def test_dead_rank_is_reported_and_survivors_do_not_hang():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run(_die_in_collective, 3, timeout=5)
    elapsed = time.monotonic() - start
    assert "died (exit code 3)" in info.value.failures[1]
    assert set(info.value.failures) <= {0, 1, 2}
    assert elapsed < 25, elapsed


def _raise_on_rank(bad):
    if comm.rank() == bad:
        raise KeyError("boom")
    return comm.rank()


def test_exception_reraised_with_rank_and_traceback():
    with pytest.raises(LaunchError, match=r"rank 2: KeyError: 'boom'") as info:
        run(_raise_on_rank, 3, 2)
    assert "_raise_on_rank" in info.value.tracebacks[2]
    assert run(_raise_on_rank, 2, 5) == [0, 1]


def _rank_0_done_at_once():
    import torch.distributed as dist

    if comm.rank() == 0:  # returns before the others use the rendezvous and their connections
        return 0
    time.sleep(0.5)
    group = dist.new_group([1, 2], use_local_synchronization=True)
    return int(comm.all_reduce(torch.ones(1), group=group).item())


def test_a_finished_rank_stays_until_every_rank_has_reported():
    """A rank that returned early must not take the rendezvous (or its connections) away from
    peers still using it: with rank 0 hosting a TCP store, ranks 1 and 2 once failed here with
    ``DistNetworkError: Broken pipe``."""
    assert run(_rank_0_done_at_once, 3, timeout=20) == [0, 2, 2]


def test_run_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        run(_raise_on_rank, 0, 1)


def test_all_to_all_rejects_bad_splits():
    with pytest.raises(ValueError, match="splits"):
        comm.all_to_all(torch.zeros(3), [2], [3])


@pytest.mark.parametrize("kwargs", [{"timeout": 0}, {"timeout": -1.0}, {"timeout": float("nan")},
                                    {"timeout": float("inf")}, {"run_timeout": 0}, {"timeout": "10"}])
def test_run_rejects_bad_timeouts_before_spawning(kwargs, monkeypatch):
    import vocabpar.launch as launch

    monkeypatch.setattr(launch.mp, "get_context", lambda *a: pytest.fail("spawned"))
    with pytest.raises(ValueError, match="timeout must be a positive finite number of seconds"):
        run(_raise_on_rank, 2, 5, **kwargs)
