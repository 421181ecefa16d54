import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vocabpar import VocabLayout
from vocabpar.layout import SCHEMES


def test_vllm_documented_example():
    layout = VocabLayout(1026, 2, org_vocab_size=1010, pad_to=64)
    assert [s.rows for s in layout.shards] == [544, 544]
    s0, s1 = layout.shards
    assert (s0.org_start, s0.org_end, s0.num_org_padding) == (0, 512, 0)
    assert (s0.added_start, s0.added_end, s0.num_added_padding) == (1010, 1026, 16)
    assert (s1.org_start, s1.org_end, s1.num_org_padding) == (512, 1010, 14)
    assert (s1.added_start, s1.added_end, s1.num_added_padding) == (1026, 1026, 32)
    rows, owned = layout.local_ids(torch.arange(1010, 1026), 0)
    assert owned.all() and rows.tolist() == list(range(512, 528))
    assert not layout.local_ids(torch.arange(1010, 1026), 1)[1].any()
    assert layout.padded_vocab_size == 1088


def test_lcm_quantum_allows_any_world_size():
    for vocab, n in ((32000, 3), (129280, 24), (50257, 7)):
        layout = VocabLayout(vocab, n)
        assert layout.padded_vocab_size % n == 0 and layout.padded_vocab_size % 64 == 0
        assert len({s.rows for s in layout.shards}) == 1


def test_uneven_has_empty_trailing_shards():
    layout = VocabLayout(10, 4, scheme="uneven")  # c = 3: 3, 3, 3, 1
    assert [s.rows for s in layout.shards] == [3, 3, 3, 1]
    layout = VocabLayout(5, 4, scheme="uneven")  # c = 2: 2, 2, 1, 0
    assert [s.rows for s in layout.shards] == [2, 2, 1, 0]
    assert layout.local_token_ids(3).numel() == 0
    assert layout.owner(torch.arange(5)).tolist() == [0, 0, 1, 1, 2]


def test_replicated_owns_everything():
    layout = VocabLayout(100, 4, org_vocab_size=90, scheme="replicated")
    for r in range(4):
        rows, owned = layout.local_ids(torch.tensor([0, 89, 90, 99, 100, -1]), r)
        assert owned.tolist() == [True] * 4 + [False] * 2
        assert rows.tolist() == [0, 89, 90, 99, 0, 0]
    assert torch.equal(layout.sharded_to_full(), torch.arange(100))


def test_owner_out_of_range_and_no_added_identity():
    layout = VocabLayout(1000, 3)
    assert layout.owner(torch.tensor([-5, -1, 1000, 10**9])).tolist() == [-1] * 4
    perm = layout.sharded_to_full()
    assert torch.equal(perm, torch.arange(layout.padded_vocab_size))


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=0, world_size=1), "vocab_size must be positive"),
    (dict(vocab_size=10, world_size=0), "world_size must be positive"),
    (dict(vocab_size=10, world_size=2, pad_to=-1), "pad_to must be positive"),
    (dict(vocab_size=10, world_size=2, org_vocab_size=11), "org_vocab_size must be in"),
    (dict(vocab_size=10, world_size=2, org_vocab_size=0), "org_vocab_size must be in"),
    (dict(vocab_size=10, world_size=2, scheme="striped"), "unknown scheme"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VocabLayout(kwargs.pop("vocab_size"), kwargs.pop("world_size"), **kwargs)


def test_bad_types_and_ranks():
    with pytest.raises(TypeError):
        VocabLayout(10.0, 2)
    layout = VocabLayout(10, 2)
    for bad in (-1, 2, True, 1.0):
        with pytest.raises(ValueError, match="rank must be"):
            layout.shard(bad)
    with pytest.raises(TypeError, match="integer tensor"):
        layout.owner(torch.tensor([1.0]))


def test_layout_is_immutable_and_hashable():
    layout = VocabLayout(10, 2)
    with pytest.raises(AttributeError):
        layout.vocab_size = 11
    assert layout == VocabLayout(10, 2) and hash(layout) == hash(VocabLayout(10, 2))


@settings(max_examples=150, deadline=None)
@given(vocab=st.integers(2, 200_000), added=st.integers(0, 1024), n=st.integers(1, 9),
       scheme=st.sampled_from(SCHEMES), pad_to=st.sampled_from([1, 8, 64, 128]))
def test_random_layouts_are_consistent(vocab, added, n, scheme, pad_to):
    added = min(added, vocab - 1)
    layout = VocabLayout(vocab, n, org_vocab_size=vocab - added, pad_to=pad_to, scheme=scheme)
    shards = layout.shards
    if scheme == "replicated":
        assert all(s.rows == vocab and s.num_org == vocab - added for s in shards)
        return
    # base and added ranges are contiguous, disjoint and cover the vocabulary in rank order
    assert shards[0].org_start == 0 and shards[-1].org_end == vocab - added
    assert all(a.org_end == b.org_start for a, b in zip(shards, shards[1:]))
    assert shards[0].added_start == vocab - added and shards[-1].added_end == vocab
    assert all(a.added_end == b.added_start for a, b in zip(shards, shards[1:]))
    assert sum(s.num_org + s.num_added for s in shards) == vocab
    assert sum(s.rows for s in shards) == layout.padded_vocab_size
    assert layout.shard_width == max(s.rows for s in shards)
    if scheme == "padded":
        assert layout.padded_vocab_size % layout.quantum == 0
        assert len({s.rows for s in shards}) == 1
    # owner / local_ids agree on a sample of ids, including out-of-range ones
    ids = torch.cat([torch.randint(0, vocab, (300,)), torch.tensor([0, vocab - 1, vocab - added,
                                                                     -1, vocab, vocab + 7])])
    ids = ids[(ids >= -1)]
    owner = layout.owner(ids)
    for r in range(n):
        rows, owned = layout.local_ids(ids, r)
        assert torch.equal(owned, owner == r)
        assert torch.equal(layout.local_token_ids(r)[rows[owned]], ids[owned])
    # sharded_to_full restores token order with padding last
    concat = torch.cat([layout.local_token_ids(r) for r in range(n)])
    perm = layout.sharded_to_full()
    restored = concat[perm]
    assert torch.equal(restored[:vocab], torch.arange(vocab))
    assert (restored[vocab:] == -1).all()
    if added == 0:
        assert torch.equal(perm, torch.arange(layout.padded_vocab_size))
