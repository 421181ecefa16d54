"""The engine ``Sampler`` on real gloo ranks: tokens equal the single-device reference, zero host
reads per call, one fixed collective script per plan (the same for any logits and any batch
under ``max_rows``, equal to the planner's price), failures as flags that raise the same error
on every rank. One launch per world size runs every check; the main process compares."""

import dataclasses
import functools
import re

import pytest
import torch

from vocabpar import SamplingParams, VocabLayout, comm, reference_sample, reference_verify, sample
from vocabpar.host_reads import counting
from vocabpar.launch import run
from vocabpar.plan.machine import link
from vocabpar.sampling import Sampler, TokenCounts
from vocabpar.sampling.constraints import pack_bits
from vocabpar.sampling.scoring import TokenLogprobs
from vocabpar.wire.filters import FILTERS
from vocabpar.wire.scripts import (
    ENGINE_FACTS,
    calls,
    choose_search_bits,
    engine_plan,
    engine_sample_script,
    engine_score_script,
    engine_search_script,
    price,
    search_bits,
)

V, ORG, MAX_ROWS, K = 2500, 2490, 12, 3
SIZES = (7, 12)  # two batches under one max_rows
COUNTED = (2, 3)
"""World sizes at which host reads are counted and both batch sizes run (the counter's Python
hook doubles a launch's time): an even and an odd split of the vocabulary. 1 and 4 ranks check
tokens on the full batch; 4 ranks, rerun under the second kernel set, stay cheap there."""


def _layouts(n: int) -> list[VocabLayout]:
    return [VocabLayout(V, n, org_vocab_size=ORG, pad_to=8, scheme="padded"),
            VocabLayout(V, n, org_vocab_size=ORG, scheme="uneven"),
            VocabLayout(V, n, org_vocab_size=ORG, scheme="replicated")]


def _families() -> dict[str, torch.Tensor]:
    """Peaked, flat, Zipf and heavily tied rows (bf16-rounded values from a narrow range)."""
    g = torch.Generator().manual_seed(5)
    zipf = torch.stack([-1.1 * torch.log1p(torch.randperm(V, generator=g).float()) for _ in range(MAX_ROWS)])
    tied = (torch.randint(0, 6, (MAX_ROWS, V), generator=g).float() * 0.25).bfloat16().float()
    return {"peaked": torch.randn(MAX_ROWS, V, generator=g) * 5,
            "flat": torch.randn(MAX_ROWS, V, generator=g) * 0.5,
            "zipf": zipf + torch.randn(MAX_ROWS, V, generator=g) * 0.1, "tied": tied}


FAMILIES = _families()
CONFIGS = {
    "greedy": SamplingParams(temperature=0),
    "full": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
    "top-p 0.9": SamplingParams(top_p=0.9),
    "top-k 1000": SamplingParams(top_k=1000),
    "min-p 0.1": SamplingParams(min_p=0.1),
    "vllm order": SamplingParams(top_p=0.8, min_p=0.2, filter_order="vllm"),
    "top-k and top-p": SamplingParams(top_k=700, top_p=0.7),
    "logprobs raw": SamplingParams(top_p=0.9, logprobs=5),
    "logprobs processed": SamplingParams(temperature=0.7, top_k=40, logprobs=3, logprobs_of="processed"),
}
SEARCH_CASES = (((8, 8, 8, 8), "tied", "top-p 0.9"), ((8, 8, 8, 8), "flat", "top-k 1000"),
                ((6, 6, 5, 5, 5, 5), "flat", "top-p 0.9"), ((4,) * 8, "tied", "top-k 1000"))
"""Threshold-search rounds other than the default, on flat and tied rows: (rounds, family,
configuration)."""


def _params(config: str, B: int) -> SamplingParams:
    return dataclasses.replace(CONFIGS[config], seed=list(range(11, 11 + B)))


def _penalised(B: int) -> tuple[SamplingParams, TokenCounts, torch.Tensor]:
    """Mixed per-row parameters (greedy rows among them) with penalties and a bitmask."""
    g = torch.Generator().manual_seed(9)
    params = SamplingParams(temperature=[0, 0.9, 1.2, 0.6] * (B // 4) + [1.0] * (B % 4),
                            top_k=[0, 30, 0, 900] * (B // 4) + [0] * (B % 4), top_p=0.9, min_p=0.02,
                            repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1,
                            seed=list(range(B)))
    history = [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(B)]
    counts = TokenCounts.from_history(history, [h[:2] for h in history])
    return params, counts, pack_bits(torch.rand(B, V, generator=g) < 0.7)


def _shard(full: torch.Tensor, layout: VocabLayout, junk: float = float("nan")) -> torch.Tensor:
    ids = layout.local_token_ids(0 if layout.scheme == "replicated" else comm.rank())
    return torch.where(ids >= 0, full[..., ids.clamp(min=0)], junk)


def _call(fn, *args, **kwargs):
    """(result, host reads (-1: not counted), (kind, bytes) of each collective) of one call."""
    if comm.world_size() not in COUNTED:
        with comm.recording() as sent:
            return fn(*args, **kwargs), -1, sent
    with counting() as reads, comm.recording() as sent:
        out = fn(*args, **kwargs)
    return out, sum(reads.values()), sent


def _sizes() -> tuple[int, ...]:
    return SIZES if comm.world_size() in COUNTED else SIZES[-1:]


def _engine_all():
    n = comm.world_size()
    out = {}
    for layout in _layouts(n):
        sampler = Sampler(layout, max_rows=MAX_ROWS, max_top_n=5)
        for family, full in FAMILIES.items():
            for config in CONFIGS:
                for B in _sizes():
                    batch = sampler.prepare(_params(config, B), positions=torch.arange(B) * 3)
                    local = _shard(full[:B], layout)
                    out["sample", layout.scheme, family, config, B] = _call(sampler.sample, local, batch)
        for B in _sizes():
            params, counts, mask = _penalised(B)
            batch = sampler.prepare(params, positions=torch.arange(B), token_counts=counts, bitmask=mask)
            local = _shard(FAMILIES["peaked"][:B], layout)
            out["penalised", layout.scheme, B] = _call(sampler.sample, local, batch)
        for top_n in (0, 5):
            ids = torch.arange(MAX_ROWS) * 197 % V
            local = _shard(FAMILIES["zipf"], layout)
            out["score", layout.scheme, top_n] = _call(sampler.token_logprobs, local, ids, top_n=top_n)
        verifier = Sampler(layout, max_rows=3 * (2 * K + 1))
        for family in ("peaked", "flat"):
            target = FAMILIES[family][:12].reshape(3, K + 1, V)
            draft, drafts = _drafts(target)
            for config in ("greedy", "full", "top-p 0.9"):
                for with_logits in (False, True):
                    batch = verifier.prepare(_params(config, 3), positions=torch.tensor([4, 9, 20]))
                    local_draft = _shard(draft, layout) if with_logits else None
                    out["verify", layout.scheme, family, config, with_logits] = _call(
                        verifier.verify, _shard(target, layout), batch, drafts, local_draft)
        out.setdefault("search bits", {})[layout.scheme] = sampler.search_bits
        for bits, family, config in SEARCH_CASES:  # any rounds give the same tokens, ties included
            chosen = Sampler(layout, max_rows=MAX_ROWS, search_bits=bits)
            batch = chosen.prepare(_params(config, 12), positions=torch.arange(12) * 3)
            out["bits", layout.scheme, bits, family, config] = _call(
                chosen.sample, _shard(FAMILIES[family], layout), batch)
        unchecked = Sampler(layout, max_rows=MAX_ROWS, check=False)
        batch = unchecked.prepare(_params("top-p 0.9", 12), positions=torch.arange(12) * 3)
        out["unchecked", layout.scheme] = _call(unchecked.sample, _shard(FAMILIES["flat"], layout), batch)
    out["failures"] = _failures(n)
    out["half precision"] = _half_precision(n)
    return out


def _half_precision(n: int) -> dict:
    """bf16 and fp16 shards (upcast inside the calls), through a sampler sized by ``max_drafts``."""
    layout = _layouts(n)[1]
    sampler = Sampler(layout, max_rows=3, max_top_n=5, max_drafts=K)
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        full = FAMILIES["flat"][:12].to(dtype)
        batch = sampler.prepare(_params("logprobs raw", 3), positions=torch.tensor([4, 9, 20]))
        out["sample", dtype] = sampler.sample(_shard(full[:3], layout), batch).to_host()
        target = full.reshape(3, K + 1, V)
        draft, drafts = _drafts(target.float())
        batch = sampler.prepare(_params("full", 3), positions=torch.tensor([4, 9, 20]))
        out["verify", dtype] = sampler.verify(_shard(target, layout), batch, drafts,
                                              _shard(draft.to(dtype), layout)).to_host()
        scored = sampler.token_logprobs(_shard(full[:3], layout), drafts[:, 0], top_n=5)
        out["score", dtype] = scored.to_host()
    return out


def _drafts(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits near the target's and draft tokens: the target's argmax, one unlikely one."""
    draft = FAMILIES["zipf"][:9].reshape(3, K, V) * 0.5 + target[:, :K] * 0.5
    drafts = target[:, :K].argmax(-1)
    drafts[1, 1] = 7
    return draft, drafts


def _failures(n: int) -> dict:
    """Bad input on one rank and bad rows: no exception inside the calls, the same message from
    ``raise_if_failed`` on every rank, and the next call still exact."""
    layout = _layouts(n)[0]
    sampler = Sampler(layout, max_rows=MAX_ROWS, max_top_n=2)
    verifier = Sampler(layout, max_rows=3 * (K + 1))
    me, B = comm.rank(), 6
    full = FAMILIES["peaked"][:B].clone()
    full[2, 40] = float("nan")
    full[4] = float("-inf")
    seen = {}

    def message(out) -> str:
        try:
            out.raise_if_failed()
            return "no error"
        except ValueError as e:
            return str(e)

    def copied(out) -> tuple[int, int, str]:
        """Host reads of ``to_host()``, then of raising from the copy, and the message."""
        with counting() as copy:
            host = out.to_host()
        with counting() as after:
            text = message(host)
        assert torch.equal(host.tokens, out.tokens) and host.tokens.device.type == "cpu"
        return sum(copy.values()), sum(after.values()), text

    last = me == n - 1
    batch = sampler.prepare(_params("top-p 0.9", B), positions=torch.arange(B))
    out = sampler.sample(_shard(full, layout), batch)
    seen["bad rows"] = message(out), out.tokens, copied(out)
    flat = _shard(FAMILIES["flat"][:B], layout)
    seen["float64"] = copied(sampler.sample(flat.double() if last else flat, batch))
    scored = torch.arange(B) * 7
    full_rows = FAMILIES["zipf"][:B] if me == 0 else _shard(FAMILIES["zipf"][:B], layout)
    seen["full rows"] = message(sampler.token_logprobs(full_rows, scored))
    seen["token id row"] = message(sampler.token_logprobs(flat, scored + (last and scored == 28)))
    shifted = torch.arange(B) + (1 if me == 1 else 0)
    batch = sampler.prepare(_params("full", B), positions=shifted)
    seen["positions"] = message(sampler.sample(flat, batch))
    top_p = [0.9] * B
    top_p[3] = 0.8 if last else 0.9
    batch = sampler.prepare(dataclasses.replace(_params("full", B), top_p=top_p), positions=torch.arange(B))
    seen["parameter row"] = message(sampler.sample(flat, batch))
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    batch = verifier.prepare(_params("top-p 0.9", 3), positions=torch.arange(3))
    target = _shard(FAMILIES["flat"][:12].reshape(3, K + 1, V), layout)
    seen["draft row"] = message(verifier.verify(target, batch, drafts + (last and drafts == 8)))
    if last:
        drafts[2, 1] = V + 5
    seen["draft id"] = message(verifier.verify(target, batch, drafts))
    drafting = Sampler(layout, max_rows=3, max_drafts=K)  # a greedy row's draft logits are not read
    batch = drafting.prepare(dataclasses.replace(_params("top-p 0.9", 3), temperature=[0.0, 0.9, 0.9]),
                             positions=torch.arange(3))
    draft = _shard(FAMILIES["flat"][:9].reshape(3, K, V), layout).clone()
    draft[0, 1, 0] = float("inf") if last else draft[0, 1, 0]
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    seen["greedy draft +inf"] = message(drafting.verify(target, batch, drafts, draft))
    draft[1, 0, 0] = float("inf") if last else draft[1, 0, 0]
    seen["sampled draft +inf"] = message(drafting.verify(target, batch, drafts, draft))
    # min_tokens state that only later draft positions read: row 1 produced 2 tokens, or 1 on the last rank
    held = dataclasses.replace(_params("top-p 0.9", 3), min_tokens=4, stop_token_ids=[5])
    lens = torch.tensor([0, 1 if last else 2, 0])
    batch = verifier.prepare(held, positions=torch.arange(3), output_lens=lens)
    seen["output_lens row"] = message(verifier.verify(target, batch, drafts))
    batch = sampler.prepare(_params("top-p 0.9", B), positions=torch.arange(B))
    seen["afterwards"] = sampler.sample(flat, batch).tokens
    return seen


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.once) for n in (1, 2, 3)] + [4])
def engine(request):
    """Every world size in the main run; the second kernel set reruns 4 ranks."""
    return request.param, run(_engine_all, request.param, timeout=120, threads_per_rank=1)


@functools.cache
def _reference(family: str, config: str, B: int):
    return reference_sample(FAMILIES[family][:B], _params(config, B), positions=torch.arange(B) * 3)


@functools.cache
def _reference_penalised(B: int):
    params, counts, mask = _penalised(B)
    return reference_sample(FAMILIES["peaked"][:B], params, positions=torch.arange(B), token_counts=counts,
                            bitmask=mask)


@functools.cache
def _reference_verify(family: str, config: str, with_logits: bool):
    target = FAMILIES[family][:12].reshape(3, K + 1, V)
    draft, drafts = _drafts(target)
    return reference_verify(target, _params(config, 3), drafts, positions=torch.tensor([4, 9, 20]),
                            draft_logits=draft if with_logits else None)


@pytest.mark.exact
def test_tokens_and_logprobs_equal_the_reference(engine):
    n, per_rank = engine
    for out in per_rank:
        sampled = [key for key in out if key[0] == "sample"]
        assert len(sampled) == 3 * len(FAMILIES) * len(CONFIGS) * (len(SIZES) if n in COUNTED else 1)
        for key in sampled:
            got, ref = out[key][0], _reference(*key[2:])
            got.raise_if_failed()
            assert torch.equal(got.tokens, ref.tokens), (n, key)
            if ref.logprobs is not None:
                _assert_logprobs(got, ref, (n, key))
        for key in (k for k in out if k[0] == "penalised"):
            assert torch.equal(out[key][0].tokens, _reference_penalised(key[2]).tokens), (n, key)
        chosen = [key for key in out if key[0] == "bits"]
        assert len(chosen) == 3 * len(SEARCH_CASES)
        for _, scheme, bits, family, config in chosen:
            got, _, sent = out["bits", scheme, bits, family, config]
            got.raise_if_failed()
            assert torch.equal(got.tokens, _reference(family, config, 12).tokens), (n, scheme, bits, config)
            searches = [m for m in got.script if m.record.name == "histogram"]
            assert len(searches) == len(bits), (n, scheme, bits, config)
            assert sent == calls(got.script, 1 if scheme == "replicated" else n), (n, scheme, bits, config)


def _assert_logprobs(got, ref, where) -> None:
    assert torch.equal(got.top_ids, ref.top_ids) and torch.equal(got.ranks, ref.ranks), where
    close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=0, equal_nan=True)
    close(got.logprobs, ref.logprobs)
    close(got.top_logprobs, ref.top_logprobs)


@pytest.mark.exact
def test_verification_equals_the_reference(engine):
    n, per_rank = engine
    for out in per_rank:
        for key, result in out.items():
            if key[0] != "verify":
                continue
            got, ref = result[0], _reference_verify(*key[2:])
            got.raise_if_failed()
            assert torch.equal(got.accepted, ref.accepted) and torch.equal(got.tokens, ref.tokens), (n, key)


def test_token_logprobs_equal_log_softmax(engine):
    n, per_rank = engine
    ids = torch.arange(MAX_ROWS) * 197 % V
    full = FAMILIES["zipf"].double()
    logp = torch.log_softmax(full, 1)
    for out in per_rank:
        for scheme in ("padded", "uneven", "replicated"):
            for top_n in (0, 5):
                got, _, _ = out["score", scheme, top_n]
                got.raise_if_failed()
                want = logp.gather(1, ids[:, None])[:, 0]
                torch.testing.assert_close(got.logprobs.double(), want, atol=2e-5, rtol=0)
                assert torch.equal(got.ranks, 1 + (full > full.gather(1, ids[:, None])).sum(1))
                assert torch.equal(got.top_ids, torch.sort(-full, dim=1, stable=True).indices[:, :top_n])


def test_no_host_read_in_any_call(engine):
    n, per_rank = engine
    if n not in COUNTED:
        pytest.skip(f"host reads are counted at {COUNTED} ranks")
    for out in per_rank:
        reads = {key: value[1] for key, value in out.items() if isinstance(key, tuple)}
        assert reads and not any(reads.values()), {k: r for k, r in reads.items() if r}


def test_one_fixed_script_per_plan_priced_as_the_planner_prices_it(engine):
    """Measured == the call's script, message for message; the script does not depend on the
    logits family or the batch size; it equals the planner's price of the configuration; the
    folded check costs no collective (checked == unchecked)."""
    n, per_rank = engine
    for out in per_rank:
        for layout in _layouts(n):
            scheme = layout.scheme
            ranks = 1 if scheme == "replicated" else n
            widest = min(max(s.num_org + s.num_added for s in layout.shards), V) if ranks > 1 else V
            bits = out["search bits"][scheme]
            assert bits == choose_search_bits(MAX_ROWS, ranks, *link("cpu")), (n, scheme, bits)
            for config, params in CONFIGS.items():
                scripts = set()
                for family in FAMILIES:
                    for B in SIZES if n in COUNTED else SIZES[-1:]:
                        got, _, sent = out["sample", scheme, family, config, B]
                        assert sent == calls(got.script, ranks), (n, scheme, family, config, B)
                        scripts.add(got.script)
                assert len(scripts) == 1, (n, scheme, config)
                values = {f.name: [getattr(params, f.name)] for f in FILTERS}
                top_n = 5 if params.logprobs is not None else None
                planned = engine_sample_script(engine_plan(
                    MAX_ROWS, ranks, widest, V, greedy=[params.temperature == 0], values=values, top_n=top_n,
                    search_bits=bits))
                assert price(planned, ranks) == price(scripts.pop(), ranks), (n, scheme, config)
            checked, _, sent_checked = out["sample", scheme, "flat", "top-p 0.9", 12]
            _, _, sent_unchecked = out["unchecked", scheme]
            assert len(sent_checked) == len(sent_unchecked) and sent_checked == sent_unchecked, scheme
            if ranks > 1:
                counts = {config: len(out["sample", scheme, "flat", config, 12][2]) for config in CONFIGS}
                assert counts["greedy"] == 1 and counts["full"] <= 2, counts
                searched = max(counts[c] for c in ("top-p 0.9", "top-k 1000", "min-p 0.1"))
                assert searched <= 2 + len(bits), counts


def test_scoring_reports_the_fixed_script_it_sends(engine):
    """``token_logprobs``'s ``script`` is the engine's scoring script for ``max_rows`` rows and the
    asked top-n, and it is what each rank measured, message for message (none on one rank)."""
    n, per_rank = engine
    for out in per_rank:
        for layout in _layouts(n):
            ranks = 1 if layout.scheme == "replicated" else n
            for top_n in (0, 5):
                got, _, sent = out["score", layout.scheme, top_n]
                assert got.script == engine_score_script(MAX_ROWS, top_n, ENGINE_FACTS), (n, layout.scheme)
                assert sent == calls(got.script, ranks), (n, layout.scheme, top_n)
                halves = [got.map(lambda t: t[:6]), got.map(lambda t: t[6:])]
                assert halves[0].script == got.script  # the rows of one call, from its collectives
                assert TokenLogprobs.concat(halves).script == got.script * 2  # both parts' collectives


def test_failures_are_flags_raised_alike_on_every_rank(engine):
    """The same message on every rank, from the device output or its host copy (one host read
    to copy, none to raise); a bad shard names the rank, what was expected and what came; a
    disagreement names the first rank and row that differ from rank 0's."""
    n, per_rank = engine
    layout = _layouts(n)[0]
    seen = [out["failures"] for out in per_rank]
    bad_rows = {s["bad rows"][0] for s in seen}
    assert len(bad_rows) == 1 and "rows [2] contain NaN logits" in bad_rows.pop()
    for s in seen:
        tokens = s["bad rows"][1]
        assert tokens[2] == -1 and tokens[4] == -1
        fine = [0, 1, 3, 5]
        params = dataclasses.replace(_params("top-p 0.9", 6), seed=[11 + b for b in fine])
        ref = reference_sample(FAMILIES["peaked"][fine], params, positions=torch.tensor(fine))
        assert torch.equal(tokens[fine], ref.tokens)
        assert "rows [4] have no allowed token" in s["bad rows"][0]
    for name, what, rank, row in (("positions", "positions", 1, 0),
                                  ("parameter row", "sampling parameters", n - 1, 3),
                                  ("draft row", "draft tokens", n - 1, 2),
                                  ("token id row", "token ids", n - 1, 4),
                                  ("output_lens row", "sampling parameters", n - 1, 1)):
        texts = {s[name] for s in seen}
        assert len(texts) == 1
        named = (f"ranks disagree on {what} (rank {rank} differs from rank 0 first at row {row}; they must "
                 f"be the same on every rank)")
        assert (named in texts.pop()) == (n > 1), name
    width = layout.shard(n - 1).rows
    expected = "must be float32, bfloat16 or float16 [6, {}] on the batch's device"
    assert {s["float64"] for s in seen} == {(1, 0, (
        f"Sampler.sample: rank {n - 1}: local_logits {expected.format(width)}, got "
        f"torch.float64(6, {width}): convert them with .float()"))}
    assert {s["bad rows"][2] for s in seen} == {(1, 0, seen[0]["bad rows"][0])}
    full_rows = {s["full rows"] for s in seen}
    columns = layout.shard(0).rows
    assert full_rows == {(
        f"Sampler.token_logprobs: rank 0: local_logits {expected.format(columns)}, got "
        f"torch.float32(6, {V}): these are full rows of the vocabulary ({V} ids) but the layout gives rank 0 "
        f"{columns} columns; pass each rank's shard (compute_logits(strategy='none')) or sample full rows "
        f"with reference_sample")}
    draft_id = {s["draft id"] for s in seen}
    assert len(draft_id) == 1 and f"rank {n - 1} passed a draft token outside" in draft_id.pop()
    assert {s["greedy draft +inf"] for s in seen} == {"no error"}
    infinite = {s["sampled draft +inf"] for s in seen}
    assert len(infinite) == 1
    assert f"rank {n - 1} passed draft logits holding +inf in a sampled row" in infinite.pop()
    ref = reference_sample(FAMILIES["flat"][:6], _params("top-p 0.9", 6), positions=torch.arange(6)).tokens
    assert all(torch.equal(s["afterwards"], ref) for s in seen)


@pytest.mark.exact
def test_bf16_and_fp16_shards_give_the_results_of_their_float32_upcast(engine):
    n, per_rank = engine
    positions = torch.tensor([4, 9, 20])
    for out in per_rank:
        for dtype in (torch.bfloat16, torch.float16):
            full = FAMILIES["flat"][:12].to(dtype).float()
            got = out["half precision"]["sample", dtype]
            got.raise_if_failed()
            ref = reference_sample(full[:3], _params("logprobs raw", 3), positions=positions)
            assert torch.equal(got.tokens, ref.tokens), (n, dtype)
            _assert_logprobs(got, ref, (n, dtype))
            target = full.reshape(3, K + 1, V)
            draft, drafts = _drafts(target)
            got = out["half precision"]["verify", dtype]
            got.raise_if_failed()
            ref = reference_verify(target, _params("full", 3), drafts, positions=positions,
                                   draft_logits=draft.to(dtype).float())
            assert torch.equal(got.accepted, ref.accepted) and torch.equal(got.tokens, ref.tokens), (n, dtype)
            got = out["half precision"]["score", dtype]
            got.raise_if_failed()
            want = torch.log_softmax(full[:3].double(), 1).gather(1, drafts[:, :1])[:, 0]
            torch.testing.assert_close(got.logprobs.double(), want, atol=2e-5, rtol=0)


def test_forced_token_rows_keep_logprobs_for_the_others():
    """A +inf row is a valid forced-token row: with logprobs it gets log_softmax's NaN and every
    other row stays exact (functional API, one rank)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = float("inf")
    layout = VocabLayout(50, 1, scheme="replicated")
    out = sample(logits, layout, SamplingParams(logprobs=2), positions=torch.arange(3))
    assert out.tokens[1] == 7 and out.logprobs[1].isnan()
    want = torch.log_softmax(logits.double(), 1).gather(1, out.tokens[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs[[0, 2]].double(), want[[0, 2]], atol=1e-5, rtol=0)


def test_construction_and_prepare_reject_bad_input_in_one_line():
    layout = VocabLayout(100, 1, scheme="replicated")
    for kwargs, message in ((dict(max_rows=0), "max_rows must be an int"),
                            (dict(max_rows=4, max_top_n=-1), "max_top_n must be an int"),
                            (dict(max_rows=4, max_top_n=101), "at most vocab_size=100"),
                            (dict(max_rows=4, search_bits=(11, 11, 11)), r"up to 32, got \(11, 11, 11\)"),
                            (dict(max_rows=4, search_bits=(16, 16)), "rounds of 4-11 bits"),
                            (dict(max_rows=4, bandwidth=0), "bandwidth must be a positive number, got 0"),
                            (dict(max_rows=4, latency="1us"), "latency must be a positive number")):
        with pytest.raises(ValueError, match=message):
            Sampler(layout, **kwargs)
    assert Sampler(layout, max_rows=4, search_bits=[8, 8, 8, 8]).search_bits == (8, 8, 8, 8)
    one_rank = Sampler(layout, max_rows=4096, latency=25e-6, bandwidth=300e9)
    assert one_rank.search_bits == (11, 11, 10)  # nothing on the wire: the fewest rounds
    sampler = Sampler(layout, max_rows=4, max_top_n=2)
    for params, positions, message in ((SamplingParams(), torch.arange(5), "exceeds max_rows=4"),
                                       (SamplingParams(logprobs=3), torch.arange(2), "max_top_n=2"),
                                       (SamplingParams(), torch.zeros(2, 2), "1-D"),
                                       (SamplingParams(top_p=[0.5, 0.7, 0.9]), torch.arange(2), "top_p")):
        with pytest.raises(ValueError, match=message):
            sampler.prepare(params, positions=positions)
    batch = sampler.prepare(SamplingParams(), positions=torch.arange(2))
    with pytest.raises(ValueError, match="top_n must be an int"):
        sampler.token_logprobs(torch.zeros(2, 100), torch.arange(2), top_n=3)
    out = sampler.sample(torch.zeros(2, 99), batch)  # a wrong width is a flag, not an exception
    with pytest.raises(ValueError, match=re.escape(
            "Sampler.sample: rank 0: local_logits must be float32, bfloat16 or float16 [2, 100] on the "
            "batch's device, got torch.float32(2, 99): the layout gives rank 0 100 columns of a 100-id "
            "vocabulary")):
        out.raise_if_failed()


def test_the_search_rounds_are_the_fastest_on_the_link():
    """More rounds send fewer bytes: few rows keep three rounds, many rows take more, and the
    choice is the cheapest of every width by the records' own price."""
    gpu = 8e-6, 300e9
    assert choose_search_bits(8, 8, *gpu) == (11, 11, 10)
    assert choose_search_bits(1024, 8, *gpu) == (6, 6, 5, 5, 5, 5)
    for rows, ranks, latency, bandwidth in ((64, 2, *link("cpu")), (256, 8, *gpu), (16, 4, 25e-6, 50e9)):
        seconds = {w: len(search_bits(w)) * latency
                   + price(engine_search_script(rows, search_bits(w)), ranks).bytes / bandwidth
                   for w in range(4, 12)}
        chosen = choose_search_bits(rows, ranks, latency, bandwidth)
        assert sum(chosen) == 32 and search_bits(max(chosen)) == chosen  # the widest round names it
        assert seconds[max(chosen)] == min(seconds.values()), (rows, ranks, chosen)


def test_each_per_row_argument_of_prepare_is_named_in_a_length_error():
    sampler = Sampler(VocabLayout(100, 1, scheme="replicated"), max_rows=8)
    for kwargs, message in ((dict(params=SamplingParams(temperature=[0.5] * 5)), "temperature has 5"),
                            (dict(params=SamplingParams(top_k=[1] * 5, seed=[1, 2, 3])),
                             "top_k has 5 and seed has 3"),
                            (dict(params=SamplingParams(logprobs=[1, 2])), "logprobs has 2"),
                            (dict(token_counts=TokenCounts.from_history([[1]] * 5)), "token_counts has 5"),
                            (dict(bitmask=torch.zeros(3, 4, dtype=torch.int32)), "bitmask has 3")):
        wanted = f"^positions has 4 rows but {message}: every per-row argument needs one value per row"
        with pytest.raises(ValueError, match=wanted):
            sampler.prepare(**{"params": SamplingParams(), **kwargs}, positions=torch.arange(4))


def test_verify_names_its_row_bound_and_max_drafts_sizes_it():
    layout = VocabLayout(100, 1, scheme="replicated")
    params, B, k = SamplingParams(seed=[1, 2, 3]), 3, 2
    target, draft = torch.randn(B, k + 1, 100), torch.randn(B, k, 100)
    drafts = torch.tensor([[1, 2], [3, 4], [5, 6]])
    small = Sampler(layout, max_rows=B * (k + 1))
    batch = small.prepare(params, positions=torch.arange(B))
    small.verify(target, batch, drafts).raise_if_failed()  # B·(k+1) rows fit without draft logits
    with pytest.raises(ValueError, match=re.escape(
            "Sampler.verify: B=3 rows with k=2 drafts and draft logits stack 3·(2+1) target rows + 3·2 "
            "draft rows = 15 rows, more than max_rows=9; verify needs B·(k+1) rows, B·(2k+1) with draft "
            "logits: build the Sampler with max_rows >= 15, or with max_rows=3 and max_drafts=2")):
        small.verify(target, batch, drafts, draft)
    sized = Sampler(layout, max_rows=B, max_drafts=k)
    assert sized.verify_rows == B * (2 * k + 1)
    got = sized.verify(target, sized.prepare(params, positions=torch.arange(B)), drafts, draft)
    want = reference_verify(target, params, drafts, positions=torch.arange(B), draft_logits=draft)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.accepted, want.accepted)
    with pytest.raises(ValueError, match=re.escape("more than max_rows·(2·max_drafts+1) = 5 (max_rows=1, "
                                                   "max_drafts=2)")):
        one = Sampler(layout, max_rows=1, max_drafts=2)  # k=3 drafts: 1·(3+1) + 1·3 = 7 rows
        one.verify(torch.zeros(1, 4, 100), one.prepare(SamplingParams(), positions=torch.arange(1)),
                   torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 100))
    with pytest.raises(ValueError, match=r"max_drafts must be an int in \[0, 2\*\*24\] or None, got -1"):
        Sampler(layout, max_rows=1, max_drafts=-1)
    with pytest.raises(ValueError, match=re.escape("draft_tokens must be int64 [3, k] (k drafts per row of "
                                                   "the batch), got torch.int32(3, 2)")):
        small.verify(target, batch, drafts.int())


def test_host_copy_and_deprecated_names():
    """``to_host()`` is one read and its tensors are the device output's; ``logprob`` / ``rank``
    still answer, with a ``DeprecationWarning``."""
    sampler = Sampler(VocabLayout(100, 1, scheme="replicated"), max_rows=4, max_top_n=2)
    batch = sampler.prepare(SamplingParams(logprobs=2), positions=torch.arange(3))
    out = sampler.sample(torch.randn(3, 100), batch)
    with counting() as reads:
        host = out.to_host()
    assert sum(reads.values()) == 1 and out.tokens.data_ptr() == out.packed.words.data_ptr()
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs", "ranks"):
        torch.testing.assert_close(getattr(host, name), getattr(out, name), rtol=0, atol=0, equal_nan=True)
    for old, new in (("logprob", "logprobs"), ("rank", "ranks")):
        with pytest.warns(DeprecationWarning, match=f"SampleOutput.{old} is deprecated: use "
                                                    f"SampleOutput.{new}"):
            assert getattr(out, old) is getattr(out, new)
