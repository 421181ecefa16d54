"""strategy="auto" on real gloo ranks: each step gathers the logits below the planner's crossover
batch and samples (or verifies) on shards from it on, for fixed prices of a collective, a byte, a
launch and a host read; the tokens equal the single-process model's either way."""

from dataclasses import replace

import pytest

from vocabpar import plan
from vocabpar.integrations.decode import planned_sampling
from vocabpar.launch import run

pytest.importorskip("transformers")

V, H, RANKS, NEW = 50257, 64, 2, 3  # the demo's GPT-2-shaped model


def _switch(bandwidth: float) -> plan.Switch:
    return plan.Switch(latency=25e-6, bandwidth=bandwidth, launch=5e-6, sync=20e-6)


GREEDY = _switch(3.75e8)  # greedy decode: gathering wins below 3 rows; verifying 2 drafts: below 2
SAMPLED = _switch(1.3e8)  # the demo's sampled step (top-k 200, top-p 0.95): below 3 rows (1.05e8-1.6e8)


def plan_greedy():
    from vocabpar import SamplingParams

    return SamplingParams(temperature=0.0)


def _params(sampled: bool, batch: int):
    from vocabpar.demo import sampling_params

    return sampling_params(batch) if sampled else None


CASES = {  # name: (switch, sampled, speculative, the two batches around the crossover)
    "greedy": (GREEDY, False, False, (2, 3)),
    "sampled": (SAMPLED, True, False, (2, 3)),
    "speculative": (GREEDY, False, True, (1, 2)),
}


def _rank_main() -> dict:
    from vocabpar import comm
    from vocabpar.demo import build_model, make_prompts
    from vocabpar.integrations.hf import parallelize
    from vocabpar.integrations.speculative import PromptLookup

    out = {}
    for name, (switch, sampled, speculative, batches) in CASES.items():
        lm = parallelize(build_model("gpt2"), strategy="auto", switch=switch, exchange="owner_gather")
        for batch in batches:
            prompts = make_prompts(batch, V)
            extra = {"draft": PromptLookup(), "num_draft_tokens": 2} if speculative else {}
            comm.reset_traffic()
            g = lm.generate(prompts, _params(sampled, batch), NEW, **extra)
            out[name, batch] = (g.tokens, g.strategies, [sum(r.values()) for r in g.step_received])
    return out


@pytest.fixture(scope="module")
def measured():
    return run(_rank_main, RANKS, timeout=180, run_timeout=600)


def test_the_switch_is_at_the_predicted_batch():
    for name, (switch, sampled, speculative, (below, at)) in CASES.items():
        params = _params(sampled, at)
        sampling = planned_sampling(params, at, V) if params else plan.Sampling()
        w = switch.workload(V, H, RANKS, at, sampling, spec_tokens=2 * speculative)
        step = "verify" if speculative else "decode"
        assert plan.crossover(w, step) == at, name
        assert switch.strategy(w, step) == "none"
        assert switch.strategy(replace(w, batch=below), step) == "all_gather"


@pytest.mark.parametrize("name", CASES)
def test_auto_switches_at_the_crossover_with_the_same_tokens(name, measured):
    from vocabpar.demo import build_model, make_prompts
    from vocabpar.integrations.hf import reference_generate

    switch, sampled, speculative, (below, at) = CASES[name]
    for batch, chosen in ((below, "all_gather"), (at, "none")):
        results = [r[name, batch] for r in measured]
        tokens, strategies, received = results[0]
        assert all(r[0] == tokens for r in results)  # every rank returns the same tokens
        # each step is decided for its own kind: the prefill samples, the later steps sample or verify
        assert set(strategies[1:]) == {chosen} and len(strategies) == len(received)
        first = switch.workload(V, H, RANKS, batch, planned_sampling(_params(sampled, batch) or
                                                                     plan_greedy(), batch, V))
        assert strategies[0] == switch.strategy(first)
        prompts = make_prompts(batch, V)
        ref = reference_generate(build_model("gpt2"), prompts, _params(sampled, batch), NEW)
        assert tokens == ref.tokens, (name, batch)
        gathered = (RANKS - 1) * batch * (V + 1) // RANKS * 4  # one logits all-gather of FP32 rows, at least
        steps = received[1:]  # the prefill apart
        if chosen == "all_gather":
            assert min(steps) >= gathered, (name, batch, steps)
        else:
            assert max(steps) < gathered / 20, (name, batch, steps)


def test_auto_needs_a_sharded_scheme_and_a_switch():
    from vocabpar.demo import build_model
    from vocabpar.integrations.hf import parallelize

    with pytest.raises(ValueError, match="needs a sharded scheme"):
        parallelize(build_model("gpt2"), strategy="auto", scheme="replicated")
    with pytest.raises(ValueError, match="switch must be a vocabpar.plan.Switch"):
        parallelize(build_model("gpt2"), strategy="auto", switch=25e-6)
    with pytest.raises(ValueError, match="unknown strategy 'autp'"):
        parallelize(build_model("gpt2"), strategy="autp")
