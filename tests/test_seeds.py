"""A scalar seed seeds the batch, not every row alike; ``seed=None`` draws a fresh one; scalars
are checked when the parameters are built; tokens stay identical at 1-4 ranks."""

import pytest
import torch
import torch.distributed as dist

from vocabpar import SamplingParams, VocabLayout, comm, launch, reference_sample, sample
from vocabpar.integrations.decode import sample_rows
from vocabpar.sampling.params import row_seeds

V, B = 500, 8


def _identical_rows() -> torch.Tensor:
    """``B`` copies of one row: the logits of ``B`` identical prompts."""
    return torch.randn(1, V, generator=torch.Generator().manual_seed(3)).expand(B, V).contiguous()


def test_identical_prompts_with_one_scalar_seed_sample_differently_and_reproducibly():
    x, positions = _identical_rows(), torch.full((B,), 4)
    params = SamplingParams(temperature=1.0, seed=7)
    tokens = reference_sample(x, params, positions=positions).tokens
    assert len(set(tokens.tolist())) > 1
    assert torch.equal(reference_sample(x, params, positions=positions).tokens, tokens)  # the same call again
    pinned = reference_sample(x, SamplingParams(temperature=1.0, seed=[7] * B), positions=positions).tokens
    assert len(set(pinned.tolist())) == 1  # per-row seeds pin each row: equal seeds, equal rows


def test_row_seeds_are_distinct_non_negative_and_depend_on_seed_and_row_only():
    seeds = row_seeds(7, 4096)
    assert seeds.dtype == torch.int64 and seeds.unique().numel() == 4096 and bool((seeds >= 0).all())
    assert torch.equal(row_seeds(7, 10), seeds[:10])  # row b's seed does not depend on the batch size
    assert not torch.equal(row_seeds(8, 10), seeds[:10])
    assert row_seeds(7, 2).tolist() == [7467559544562464144, 1754682752732131093]  # the same in every version
    assert torch.equal(SamplingParams(seed=7).resolve(10, V).seed, seeds[:10])
    assert SamplingParams(seed=[5, 6]).resolve(2, V).seed.tolist() == [5, 6]  # per-row seeds are kept


def test_a_subset_of_rows_samples_as_within_its_batch():
    """The collecting designs sample the rows they own: each must get the seed it has in the batch."""
    x = torch.randn(B, V, generator=torch.Generator().manual_seed(5))
    params, positions = SamplingParams(temperature=1.0, top_k=50, seed=11), torch.arange(B)
    whole = reference_sample(x, params, positions=positions).tokens
    assert torch.equal(sample_rows(x[2:5], params, positions, None, slice(2, 5)), whole[2:5])
    assert torch.equal(params.with_row_seeds(B).resolve(B, V).seed, params.resolve(B, V).seed)


def test_seed_none_draws_a_fresh_seed_that_torch_manual_seed_reproduces():
    torch.manual_seed(0)
    first, second = SamplingParams(seed=None).seed, SamplingParams(seed=None).seed
    assert isinstance(first, int) and 0 <= first < 2**63 and first != second
    torch.manual_seed(0)
    assert SamplingParams(seed=None).seed == first


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -1}, r"temperature must be in \[0, 1e\+06\], got -1"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
    ({"top_k": 2.5}, r"top_k must be an integer in \[-2\*\*63, 2\*\*63\), got 2.5"),
    ({"seed": -1}, r"seed must be >= 0 \(None draws a fresh one\), got -1"),
    ({"min_p": float("nan")}, r"min_p must be in \[0, 1\], got nan"),
    ({"repetition_penalty": "high"}, r"repetition_penalty: expected a real number, got 'high'"),
    ({"logprobs": -2}, r"logprobs must be None, an int >= 0 or one such value per row, got -2"),
    ({"filter_order": "sglang"}, r"filter_order must be one of \('hf', 'vllm'\), got 'sglang'"),
])
def test_scalars_are_rejected_when_the_parameters_are_built(kwargs, message):
    with pytest.raises(ValueError, match="^SamplingParams: " + message) as caught:
        SamplingParams(**kwargs)
    assert "\n" not in str(caught.value)


def test_per_row_values_are_checked_when_resolved():
    params = SamplingParams(temperature=[0.5, -1.0])  # a list is checked against its batch later
    with pytest.raises(ValueError, match=r"^row 1: temperature must be in \[0, 1e\+06\], got -1.0$"):
        params.resolve(2, V)


def _tokens_at_every_rank_count(x: torch.Tensor, positions: torch.Tensor) -> dict[int, list[int]]:
    """Sample ``x`` on groups of 1, 2, 3 and 4 ranks (every rank takes part in making each)."""
    me, out = comm.rank(), {}
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=123)
    for n in (1, 2, 3, 4):
        group = dist.new_group(list(range(n)))
        if me < n:
            layout = VocabLayout(V, n, scheme="uneven" if n == 3 else "padded")
            ids = layout.local_token_ids(me)
            local = torch.where(ids >= 0, x[:, ids.clamp(min=0)], float("-inf"))
            out[n] = sample(local, layout, params, positions=positions, group=group).tokens.tolist()
    return out


def test_tokens_are_identical_at_one_to_four_ranks():
    x, positions = _identical_rows(), torch.arange(B)
    want = reference_sample(x, SamplingParams(temperature=0.9, top_p=0.95, seed=123), positions=positions)
    assert len(set(want.tokens.tolist())) > 1
    per_rank = launch.run(_tokens_at_every_rank_count, 4, x, positions)
    for me, got in enumerate(per_rank):
        assert sorted(got) == [n for n in (1, 2, 3, 4) if me < n]
        assert all(tokens == want.tokens.tolist() for tokens in got.values()), (me, got)
