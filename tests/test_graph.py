"""An engine compiles its whole step: ``torch.compile(sampler.sample, fullgraph=True)``,
``verify`` and ``token_logprobs`` trace as one graph with no break (``fullgraph=True`` raises at
a break), give the eager call's ids, logprobs and flags, and a second batch of the same plan with
other values and another size reuses the program (the caller marks its logits' rows dynamic, as
an engine whose batch changes does; ``Sampler.prepare`` marks the batch's own tensors). One
process (the collectives of a group trace alike: ``scripts/graph_breaks.py`` checks 2 ranks and
prints every break where one is left, ``test_fused`` runs 2-4 ranks compiled whole); Dynamo's
eager backend, so nothing compiles to C++ here."""

import pytest
import torch

from vocabpar import Sampler, SamplingParams, VocabLayout
from vocabpar.kernels import fused

V, B, OTHER_B = 4096, 6, 3
PLANS = {"greedy": {}, "top-p search": {"temperature": 1.0, "top_p": 0.9},
         "certified": {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "min_p": 0.05},
         "greedy with logprobs": {"logprobs": 3},
         "constraints": {"temperature": 1.0, "top_p": 0.9, "logit_bias": {5: 2.0, 9: -1.0},
                         "allowed_token_ids": list(range(0, V, 3))},
         "top-n-sigma": {"temperature": 1.0, "top_n_sigma": 1.0, "top_k": 20}}


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    return Sampler(VocabLayout(V, 1), max_rows=8, max_top_n=3)


def _batch(sampler: Sampler, params: dict, seed: int, rows: int = B, **given):
    params = SamplingParams(seed=[seed + b for b in range(rows)], **params)
    return sampler.prepare(params, positions=torch.arange(rows), **given)


def _any_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The caller's side of "any batch size": its inputs' rows marked dynamic."""
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)
    return tensors


@pytest.mark.parametrize("plan", PLANS)
def test_sample_is_one_graph_equal_to_eager(sampler, plan):
    torch._dynamo.reset()
    logits, = _any_rows(torch.randn(B, V, generator=torch.Generator().manual_seed(0)))
    batch = _batch(sampler, PLANS[plan], 0)
    with fused.compiling(False):
        compiled = torch.compile(sampler.sample, fullgraph=True, backend="eager")
        assert torch.equal(compiled(logits, batch).packed.words, sampler.sample(logits, batch).packed.words)
        # other seeds, another size, and a list per row where the first batch gave one value
        per_row = {name: [value] * OTHER_B if isinstance(value, int | float) else value
                   for name, value in PLANS[plan].items()}
        other = _batch(sampler, per_row, 7, OTHER_B)
        logits2, = _any_rows(torch.randn(OTHER_B, V, generator=torch.Generator().manual_seed(1)))
        with torch._dynamo.config.patch(error_on_recompile=True):  # the same program
            got = compiled(logits2, other).packed.words
        assert torch.equal(got, sampler.sample(logits2, other).packed.words)


def test_token_logprobs_is_one_graph_equal_to_eager(sampler):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)

    def score(logits: torch.Tensor, ids: torch.Tensor):
        return sampler.token_logprobs(logits, ids, top_n=3)

    with fused.compiling(False):
        compiled = torch.compile(score, fullgraph=True, backend="eager")
        for rows in (B, OTHER_B):  # another size: the same program
            ids = torch.randint(0, V, (rows,), generator=g)
            logits, ids = _any_rows(torch.randn(rows, V, generator=g), ids)
            with torch._dynamo.config.patch(error_on_recompile=rows != B):
                got = compiled(logits, ids)
            assert torch.equal(got.packed.words, score(logits, ids).packed.words)


@pytest.mark.parametrize("with_draft_logits", [False, True])
def test_verify_is_one_graph_equal_to_eager(with_draft_logits):
    """With draft logits, min_tokens also holds back some rows' stop ids, at some positions only."""
    torch._dynamo.reset()
    k = 2
    sampler = Sampler(VocabLayout(V, 1), max_rows=B, max_drafts=k)
    g = torch.Generator().manual_seed(4)

    def verify(target: torch.Tensor, batch, drafts: torch.Tensor, draft_logits: torch.Tensor | None):
        return sampler.verify(target, batch, drafts, draft_logits)

    with fused.compiling(False):
        compiled = torch.compile(verify, fullgraph=True, backend="eager")
        for rows in (B, OTHER_B):  # another size and another mix of greedy rows: the same program
            target = torch.randn(rows, k + 1, V, generator=g)
            draft_logits = target[:, :k] + torch.randn(rows, k, V, generator=g) if with_draft_logits else None
            drafts = torch.randint(0, V, (rows, k), generator=g)
            _any_rows(target, drafts, *[draft_logits] * with_draft_logits)
            temperature = [0.0 if (b + rows) % 3 == 0 else 0.8 for b in range(rows)]
            held = {"min_tokens": 3, "stop_token_ids": [5, 9]} if with_draft_logits else {}
            lens = {"output_lens": torch.arange(rows) % 4} if with_draft_logits else {}
            batch = _batch(sampler, {**PLANS["certified"], "temperature": temperature, **held}, rows, rows,
                           **lens)
            assert (batch.held is not None) == with_draft_logits
            with torch._dynamo.config.patch(error_on_recompile=rows != B):
                got = compiled(target, batch, drafts, draft_logits)
            assert torch.equal(got.packed.words, verify(target, batch, drafts, draft_logits).packed.words)


def test_one_row_reuses_the_program_where_sizes_are_size_oblivious(sampler):
    """PyTorch specialises a size of 1 unless told to reason size-obliviously
    (``backed_size_oblivious``): then a 1-row batch reuses the program of a 6-row one, for
    ``sample`` (a search plan with logprobs) and for ``verify`` with draft logits."""
    import torch.fx.experimental._config as shapes

    torch._dynamo.reset()
    k, g = 2, torch.Generator().manual_seed(5)
    drafting = Sampler(VocabLayout(V, 1), max_rows=B, max_drafts=k)
    plan = {"temperature": 1.0, "top_p": 0.9, "logprobs": 2}

    def verify(target: torch.Tensor, batch, drafts: torch.Tensor, draft_logits: torch.Tensor):
        return drafting.verify(target, batch, drafts, draft_logits)

    with fused.compiling(False), shapes.patch(backed_size_oblivious=True):
        step = torch.compile(sampler.sample, fullgraph=True, backend="eager")
        check = torch.compile(verify, fullgraph=True, backend="eager")
        for rows in (B, 1):
            with torch._dynamo.config.patch(error_on_recompile=rows != B):
                logits, = _any_rows(torch.randn(rows, V, generator=g))
                batch = _batch(sampler, plan, rows, rows)
                eager = sampler.sample(logits, batch).packed.words
                assert torch.equal(step(logits, batch).packed.words, eager)
                target = torch.randn(rows, k + 1, V, generator=g)
                draft_logits, drafts = target[:, :k] + 1.0, torch.randint(0, V, (rows, k), generator=g)
                _any_rows(target, draft_logits, drafts)
                batch = _batch(drafting, {**plan, "logprobs": None}, rows, rows)
                want = verify(target, batch, drafts, draft_logits).packed.words
                assert torch.equal(check(target, batch, drafts, draft_logits).packed.words, want)
