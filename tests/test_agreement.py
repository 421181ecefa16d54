"""Ranks that disagree on what must be replicated fail loudly and alike, on real gloo ranks.

One launch runs every scenario in turn on 2 ranks (each returns what every rank saw: a result or
the error text), so a scenario that left a rank behind in a collective would break the next ones.
Each test then checks one named behaviour."""

import pytest
import torch
import torch.distributed as dist

from vocabpar import (
    ParallelLMHead,
    SamplingParams,
    VocabLayout,
    VocabParallelEmbedding,
    broadcast_tokens,
    comm,
    compute_logits,
    sample,
    token_logprobs,
)
from vocabpar.launch import LaunchError, run
from vocabpar.wire.records import AGREE_WIDTH

V, H = 1000, 16


def _modules():
    g = torch.Generator().manual_seed(0)
    layout = VocabLayout(V, comm.world_size())
    table = torch.randn(V, H, generator=g)
    emb = {x: VocabParallelEmbedding(layout, H, exchange=x) for x in ("all_reduce", "owner_gather")}
    for e in emb.values():
        e.load_full_weight(table)
    head = ParallelLMHead(layout, H)
    head.load_full_weight(table)
    return layout, table, emb, head


def _shard(full, layout, rank):
    ids = layout.local_token_ids(rank)
    return torch.where(ids >= 0, full[:, ids.clamp(min=0)], 0.0)


def _scenarios():
    me = comm.rank()
    layout, table, emb, head = _modules()
    hidden = torch.randn(6, H, generator=torch.Generator().manual_seed(1))
    other = hidden.clone()
    other[3, 5] += 1.0
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(4)

    def sampled(full=logits, lay=layout, params=None, pos=positions):
        return sample(_shard(full, lay, me), lay, params or SamplingParams(), positions=pos).tokens

    scenarios = {
        "embedding_id_count_all_reduce": lambda: emb["all_reduce"](torch.arange(4 + me)),
        "embedding_id_count_owner_gather": lambda: emb["owner_gather"](torch.arange(4 + me)),
        "embedding_id_shape": lambda: emb["owner_gather"](torch.arange(6).reshape((2, 3) if me else (3, 2))),
        "embedding_id_content": lambda: emb["all_reduce"](torch.tensor([1, 2, 3 + me])),
        "embedding_bad_id_on_one_rank": lambda: emb["owner_gather"](torch.tensor([1, 2, V if me else 3])),
        "logits_row_count": lambda: compute_logits(head, hidden[: 4 + me], strategy="all_gather"),
        "logits_row_count_gather": lambda: compute_logits(head, hidden[: 4 + me], strategy="gather"),
        "logits_row_count_all_to_all": lambda: compute_logits(head, hidden[: 4 + 2 * me],
                                                              strategy="all_to_all"),
        "logits_hidden_content": lambda: compute_logits(head, other if me else hidden, strategy="all_gather"),
        "logits_strategy": lambda: compute_logits(head, hidden, strategy="gather" if me else "all_gather"),
        "logits_chunking": lambda: compute_logits(head, hidden, strategy="all_gather", chunk_rows=2 + me),
        "logits_bad_hidden_on_one_rank": lambda: compute_logits(head, hidden[:, : H - me],
                                                                strategy="all_gather"),
        "logits_dp_bad_hidden_on_one_rank": lambda: compute_logits(head, hidden[:, : H - me],
                                                                   strategy="dp_gather_scatter"),
        "logits_dp_chunking": lambda: compute_logits(head, hidden[: 1 + me], strategy="dp_gather_scatter",
                                                     chunk_rows=2 + me),
        "sample_batch": lambda: sampled(full=logits[: 3 + me], pos=positions[: 3 + me]),
        "sample_params": lambda: sampled(params=SamplingParams(top_p=0.9 if me else 0.8)),
        "sample_seed": lambda: sampled(params=SamplingParams(seed=me)),
        "sample_positions": lambda: sampled(pos=positions + me),
        "sample_layout": lambda: sampled(full=torch.randn(4, V + 20 * me), lay=VocabLayout(V + 20 * me, 2)),
        "sample_bad_width_on_one_rank": lambda: sample(torch.zeros(4, layout.shard(me).rows + me), layout,
                                                       SamplingParams(), positions=positions).tokens,
        "broadcast_rows": lambda: broadcast_tokens(torch.arange(3) if me == 0 else None, 3 + me),
        "score_token_ids": lambda: token_logprobs(_shard(logits, layout, me), layout, torch.arange(4) + me),
        "score_top_n": lambda: token_logprobs(_shard(logits, layout, me), layout, torch.arange(4), top_n=me),
        # after all of the above, every entry point still works and agrees with the reference
        "embedding_after": lambda: torch.equal(emb["owner_gather"](torch.arange(7)), table[:7]),
        "logits_after": lambda: torch.allclose(compute_logits(head, hidden, strategy="all_gather"),
                                               hidden @ table.T, rtol=1e-5, atol=1e-4),
        "sample_after": lambda: torch.equal(sampled(params=SamplingParams(temperature=0)), logits.argmax(1)),
    }
    out = {}
    for name, call in scenarios.items():
        try:
            out[name] = call()
        except ValueError as e:
            out[name] = f"ValueError: {e}"
    # with the check off, no agreement traffic; greedy sampling is then a single collective
    comm.reset_traffic()
    emb["owner_gather"].check = False
    emb["owner_gather"](torch.arange(9))
    compute_logits(head, hidden, strategy="all_gather", check=False)
    sample(_shard(logits, layout, me), layout, SamplingParams(temperature=0), positions=positions,
           check=False)
    out["unchecked_traffic"] = {k: v.calls for k, v in comm.traffic().items()}
    comm.reset_traffic()
    emb["all_reduce"](torch.arange(9))
    out["checked_traffic"] = {k: (v.calls, v.sent) for k, v in comm.traffic().items()}
    return out


@pytest.fixture(scope="module")
def seen():
    return run(_scenarios, 2, timeout=30)


def _same_error(seen, name, *fragments):
    errors = [per_rank[name] for per_rank in seen]
    assert all(isinstance(e, str) and e.startswith("ValueError") for e in errors), errors
    assert errors[0] == errors[1], errors
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.parametrize("exchange", ["all_reduce", "owner_gather"])
def test_embedding_id_count(seen, exchange):
    _same_error(seen, f"embedding_id_count_{exchange}", "VocabParallelEmbedding",
                "rank 0 has 4 ids, rank 1 has 5 ids")


def test_embedding_id_shape_and_content(seen):
    _same_error(seen, "embedding_id_shape", "the content of token ids differs between ranks {0} and {1}")
    _same_error(seen, "embedding_id_content", "the content of token ids differs")


def test_embedding_bad_id_on_one_rank_fails_every_rank(seen):
    assert "outside [0, 1000) (rank 1)" in seen[1]["embedding_bad_id_on_one_rank"]
    assert "rank(s) [1] rejected their input" in seen[0]["embedding_bad_id_on_one_rank"]


@pytest.mark.parametrize("strategy", ["", "_gather"])
def test_logits_row_count(seen, strategy):
    _same_error(seen, f"logits_row_count{strategy}", "rank 0 has 4 rows, rank 1 has 5 rows")


def test_logits_row_count_all_to_all(seen):
    _same_error(seen, "logits_row_count_all_to_all", "rank 0 has 4 rows, rank 1 has 6 rows")


def test_logits_hidden_content_strategy_and_chunking(seen):
    _same_error(seen, "logits_hidden_content", "the content of hidden differs between ranks {0} and {1}")
    _same_error(seen, "logits_chunking", "rank 0 has chunk_rows=2, rank 1 has chunk_rows=3")
    for per_rank, other in zip(seen, ("'gather'", "'all_gather'")):
        assert "strategy" in per_rank["logits_strategy"] and other not in per_rank["logits_strategy"]


@pytest.mark.parametrize("name", ["logits_bad_hidden_on_one_rank", "logits_dp_bad_hidden_on_one_rank"])
def test_logits_bad_hidden_on_one_rank_fails_every_rank(seen, name):
    assert "hidden size 15 does not match the head's 16 (rank 1)" in seen[1][name]
    assert "rank(s) [1] rejected their input" in seen[0][name]


def test_dp_rows_may_differ_but_chunking_may_not(seen):
    _same_error(seen, "logits_dp_chunking", "rank 0 has chunk_rows=2, rank 1 has chunk_rows=3")


def test_sample_batch_and_layout(seen):
    _same_error(seen, "sample_batch", "rank 0 has 3 rows, rank 1 has 4 rows")
    _same_error(seen, "sample_layout", "rank 0 has vocab_size=1000, rank 1 has vocab_size=1020")


@pytest.mark.parametrize("name,what", [("sample_params", "sampling parameters"),
                                       ("sample_seed", "sampling parameters"),
                                       ("sample_positions", "positions")])
def test_sample_replicated_inputs(seen, name, what):
    _same_error(seen, name, f"the content of {what} differs between ranks {{0}} and {{1}}")


def test_sample_bad_width_on_one_rank_fails_every_rank(seen):
    assert "local logits must be float32" in seen[1]["sample_bad_width_on_one_rank"]
    assert "rank(s) [1] rejected their input" in seen[0]["sample_bad_width_on_one_rank"]


def test_broadcast_rows(seen):
    _same_error(seen, "broadcast_rows", "rank 0 has 3 rows, rank 1 has 4 rows")


def test_scoring_token_ids_and_top_n(seen):
    _same_error(seen, "score_token_ids", "token_logprobs", "the content of token ids differs")
    _same_error(seen, "score_top_n", "rank 0 has top_n=0, rank 1 has top_n=1")


def test_entry_points_still_work_after_rejected_input(seen):
    for per_rank in seen:
        assert per_rank["embedding_after"] is True
        assert per_rank["logits_after"] is True
        assert per_rank["sample_after"] is True


def test_check_cost_and_switch(seen):
    for per_rank in seen:
        # off: embedding owner gather (1), all-gather of logits (1), greedy round one (1)
        assert per_rank["unchecked_traffic"] == {"all_gather": 3}
        # on: one 256-byte all-gather per call, booked apart from the design's traffic
        assert per_rank["checked_traffic"]["agreement"] == (1, AGREE_WIDTH * 8)
        assert per_rank["checked_traffic"]["all_reduce"][0] == 1


def _die_before_collective():
    dist.barrier()  # both ranks past connecting: a peer dying during gloo's connection is another error
    if comm.rank() == 1:
        raise SystemExit(3)
    comm.all_reduce(torch.ones(4))
    return "finished"


def test_survivor_of_a_failed_peer_names_the_collective():
    with pytest.raises(LaunchError) as info:
        run(_die_before_collective, 2, timeout=10)
    why = info.value.failures[0]
    assert "CollectiveError: all_reduce of 16 bytes on the world group failed at rank 0 of 2" in why
    assert "a peer probably failed or called a different collective" in why
