import json
import math
import pathlib
import re
from dataclasses import replace

import pytest
import torch

from vocabpar import VocabLayout
from vocabpar import plan as P
from vocabpar.cli import main
from vocabpar.plan import host
from vocabpar.plan.cost import design_cost, host_work, path_time, path_traffic, sampler_key, step_time
from vocabpar.plan.crossover import GATHER, SEARCHED, SHARDS
from vocabpar.plan.model import (
    LATENCY,
    LAUNCH,
    LIMITS,
    SYNC,
    busiest_owner,
    embedding_exchange_bytes,
    greedy_sampling_bytes,
    head_flops,
    kv_tokens,
    logits_collection_bytes,
    logits_traffic,
    sampler_traffic,
    score_bytes,
    shard_rows,
    verify_traffic,
    weight_bytes,
)
from vocabpar.plan.recommend import winners
from vocabpar.plan.study import STUDY, study_figures
from vocabpar.plots import png_path
from vocabpar.presets import CLASS_DEFAULTS, load_config, preset
from vocabpar.wire.filters import FILTERS
from vocabpar.wire.traffic import Traffic, all_gather, all_reduce, exact, maybe

V, H = 129280, 5120  # DeepSeek-V4.1-Flash


def _workload(name: str, **kw) -> P.Workload:
    """A preset's workload with its own KV bytes per token and rank."""
    m = preset(name)
    tp = kw.get("ranks", 8) // kw.get("dp", 1)
    return P.Workload(vocab=m.vocab_size, hidden=m.hidden_size, tied=m.tied,
                      kv_bytes_per_token=m.kv_bytes_per_rank(tp), **kw)


BYTES_ONLY = {"launch": 0.0, "sync": 0.0}
"""Fixed costs other than collectives off: tests about bytes and collectives alone."""


def _costs(w: P.Workload) -> dict[str, P.DesignCost]:
    return {c.name: c for c in P.plan(w)}


# ---------------------------------------------------------------------- the study's figures
STUDY_FIGURES = {  # quantity -> (ours at the study's precision, the study's figure)
    "one BF16 matrix, V·H·2": ("1.23 GiB", "1.23 GiB"),
    "both matrices": ("2.47 GiB", "2.47 GiB"),
    "TP=8 shard of one matrix": ("157.8 MiB", "157.8 MiB"),
    "TP=8 shards of both": ("315.6 MiB", "315.6 MiB"),
    "saved per matrix per rank by sharding": ("1.08 GiB", "1.07 GiB"),
    "logits B=256 BF16": ("63.1 MiB", "63.1 MiB"),
    "logits B=256 FP32": ("126.2 MiB", "126.2 MiB"),
    "logits B=1024 FP32": ("505.0 MiB", "504.8 MiB"),
    "embedding payload M = T·H·2, T=8192": ("83.9 MB", "83.9 MB"),
    "ring all-reduce per rank, 2(n-1)/n·M": ("146.8 MB", "146.8 MB"),
    "embedding exchanges": ("1 per forward", "1 per layer"),
    "head FLOPs 2·B·V·H, B=256": ("338.9 GFLOP", "338.9 GFLOP"),
    "head FLOPs, B=512": ("677.8 GFLOP", "677.8 GFLOP"),
    "  B=256 at 600 TFLOP/s": ("0.56 ms", "0.56 ms"),
    "  B=512 at 600 TFLOP/s": ("1.13 ms", "1.13 ms"),
    "full BF16 logits B=256": ("66.2 MB", "66.2 MB"),
    "logits all-gather received per rank": ("57.9 MB", "57.9 MB"),
    "greedy pairs, study's B·2·n·4": ("16 KB", "16 KB"),
    "greedy received per rank, (n-1)·B·(8+8)": ("28.7 KB", None),
    "replication, extra per rank": ("2.16 GiB", "2.16 GiB"),
    "replication, extra over 8 ranks": ("17.3 GiB", "17.3 GiB"),
    "KV tokens in that extra per rank, 890 B/token": ("2.6 M tokens", "24k tokens"),
}


def test_study_figures_at_printed_precision():
    figures = study_figures()
    by_name = {f.quantity: f for f in figures}
    for quantity, (ours, study) in STUDY_FIGURES.items():
        assert (by_name[quantity].text, by_name[quantity].study) == (ours, study), quantity
    texts = [f.text for f in figures]
    assert texts.count("7.9 MiB") == 1 and texts.count("15.8 MiB") == 1  # TP=8 logits shards
    assert texts.count("63.1 MiB") == 2  # B=256 BF16 full, B=1024 FP32 shard
    assert texts.count("0.49 ms") == 1 and texts.count("193 µs") == 1


def test_study_disagreements_are_named():
    differs = {f.quantity for f in study_figures() if not f.agrees}
    assert differs == {"saved per matrix per rank by sharding", "logits B=1024 FP32",
                       "embedding exchanges", "KV tokens in that extra per rank, 890 B/token"}
    notes = " ".join(f.note for f in study_figures())
    assert "once per forward" in notes and "not 24k" in notes


def test_study_bytes_exact():
    assert weight_bytes(V, H, 2, 1) == 1_323_827_200
    assert shard_rows(V, 8) == V // 8  # 129280 is a multiple of 64·8: no padding
    assert weight_bytes(shard_rows(V, 8), H, 2, 1) == 165_478_400
    assert embedding_exchange_bytes("all_reduce", 8192, H, 8, 2) == 146_800_640
    assert logits_collection_bytes("all_gather", 256, V, 8, 2) == 57_917_440
    assert greedy_sampling_bytes(256, 8) == 7 * 256 * 16
    assert head_flops(256, V, H) == 338_899_763_200
    costs = _costs(STUDY)
    extra = costs["deepinfer-replicated"].weight_bytes - costs["vllm-all-gather"].weight_bytes
    assert extra == 2_316_697_600 and kv_tokens(extra, 890) == 2_603_031


# ---------------------------------------------------------------------- formulas
def test_comm_byte_model():
    """Same per-rank model as vocabpar.comm: ring all-reduce 2(n-1)/n·M, all-gather (n-1)·chunk."""
    M = 1000 * 64 * 2
    assert embedding_exchange_bytes("all_reduce", 1000, 64, 4, 2) == round(2 * 3 / 4 * M)
    assert embedding_exchange_bytes("all_reduce", 1000, 64, 1, 2) == 0
    # owner gather: an all-gather of owner blocks, half a ring all-reduce when balanced
    assert 2 * embedding_exchange_bytes("owner_gather", 8192, H, 8, 2) == \
        embedding_exchange_bytes("all_reduce", 8192, H, 8, 2)
    assert embedding_exchange_bytes("owner_gather", 10, 4, 3, 2, owned=7) == 2 * 7 * 4 * 2
    assert embedding_exchange_bytes("local", 10, 4, 3, 2) == 0
    with pytest.raises(ValueError, match="owned"):
        embedding_exchange_bytes("owner_gather", 10, 4, 3, 2, owned=11)
    with pytest.raises(ValueError, match="unknown embedding exchange"):
        embedding_exchange_bytes("psum", 10, 4, 3, 2)


def test_ranks_not_dividing_vocab():
    # llama-2-7b at 3 ranks: padded to lcm(64, 3) = 192 -> 32064 rows; uneven ceil -> 10667
    assert shard_rows(32000, 3) == 32064 // 3 == VocabLayout(32000, 3).shard_width
    assert shard_rows(32000, 3, "uneven") == 10667
    costs = _costs(_workload("llama-2-7b", ranks=3, batch=5))
    assert costs["vllm-all-gather"].weight_bytes == 2 * 10688 * 4096 * 2
    assert costs["trtllm-uneven"].weight_bytes == 2 * 10667 * 4096 * 2
    assert costs["trtllm-uneven"].collection_bytes == 2 * 5 * 10667 * 2
    assert costs["sglang-all-to-all"].collection_bytes == 2 * 2 * 10688 * 2  # ceil(5/3) = 2 rows
    # uneven with an empty trailing shard: chunks padded to the largest (3 rows)
    assert logits_collection_bytes("all_gather", 2, 5, 4, 4, scheme="uneven") == 3 * 2 * 2 * 4
    assert logits_collection_bytes("gather", 2, 5, 4, 4, scheme="uneven") == 3 * 2 * 2 * 4


def test_tied_weights_are_one_matrix():
    w = _workload("gpt2", ranks=8)
    costs = _costs(w)
    assert w.matrices == 1
    assert costs["vllm-all-gather"].weight_bytes == 50304 // 8 * 768 * 2
    assert costs["trtllm-uneven"].weight_bytes == math.ceil(50257 / 8) * 768 * 2
    assert costs["deepinfer-replicated"].weight_bytes == 50257 * 768 * 2
    untied = _costs(replace(w, tied=False))
    assert untied["deepinfer-replicated"].weight_bytes == 2 * costs["deepinfer-replicated"].weight_bytes


def test_other_preset_per_design():
    w = _workload("qwen2.5-7b", ranks=8, dp=8, batch=64, tokens=100, logits_dtype_bytes=4)
    c = _costs(w)
    rows = 152064 // 8
    assert c["vllm-all-gather"].collection_bytes == 7 * 64 * rows * 4
    assert c["sglang-all-to-all"].collection_bytes == 7 * 8 * rows * 4
    assert c["sglang-dp-gather-scatter"].hidden_gather_bytes == 7 * (24 + 8 * 3584 * 2)
    assert c["vocabpar-sharded"].collection_bytes == 7 * 64 * 16
    assert c["vocabpar-sharded"].embedding_bytes == 7 * 13 * 3584 * 2  # (n-1)·ceil(T/n)·H·b
    assert c["deepinfer-replicated"].head_flops == 2 * 8 * 152064 * 3584  # own 8 rows, full vocab
    assert c["deepinfer-replicated"].step_bytes == 0
    assert c["llama.cpp"].ranks == 1 and c["llama.cpp"].weight_bytes == 152064 * 3584 * 2
    for cost in c.values():
        assert cost.memory_bytes == cost.weight_bytes + cost.logits_buffer_bytes
        assert cost.step_time_s == pytest.approx(cost.collectives * LATENCY + cost.step_bytes / 300e9
                                                 + cost.launches * LAUNCH + cost.host_reads * SYNC
                                                 + cost.head_time_s)
        cols = 152064 if cost.name in ("deepinfer-replicated", "llama.cpp") else rows
        assert cost.head_time_s == pytest.approx(max(cost.head_flops / 600e12, cols * 3584 * 2 / 3.35e12))
    # decode is memory-bound: the replicated head reads 8 times the bytes of a shard for its 8 rows
    assert c["deepinfer-replicated"].head_time_s == pytest.approx(152064 * 3584 * 2 / 3.35e12)
    assert c["vllm-all-gather"].head_time_s == pytest.approx(rows * 3584 * 2 / 3.35e12)
    assert min(x.extra_memory_bytes for x in c.values()) == 0
    kv = 28 * 2 * 4 * 128 * 2  # Qwen2.5-7B: 28 layers, K and V, 4 KV heads of 128, BF16; DP 8: whole per rank
    assert w.kv_bytes_per_token == kv
    assert c["deepinfer-replicated"].kv_tokens == c["deepinfer-replicated"].extra_memory_bytes // kv


def test_empty_batch_and_single_rank():
    for cost in P.plan(replace(STUDY, batch=0)):
        assert cost.step_bytes == cost.head_flops == cost.collection_bytes == 0
        assert cost.logits_buffer_bytes == 0
    assert P.recommend(P.plan(replace(STUDY, batch=0))).design
    for cost in P.plan(replace(STUDY, ranks=1)):
        assert cost.ranks == 1 and cost.step_bytes == cost.embedding_bytes == 0


def test_workload_validation():
    for bad in ({"vocab": -5}, {"hidden": 0}, {"ranks": 0}, {"batch": -1}, {"dp": 3},
                {"bandwidth": 0}, {"pad_to": 0}, {"kv_bytes_per_token": 1e-300}, {"flops": 1e300},
                {"bandwidth": math.nan}, {"vocab": 2**40}, {"ranks": 2**17}):
        with pytest.raises(ValueError):
            replace(STUDY, **bad)
    with pytest.raises(ValueError, match="unknown dtype"):
        P.dtype_bytes("fp7")
    with pytest.raises(ValueError, match="unknown strategy"):
        logits_collection_bytes("psum", 1, 10, 2, 4)


# ---------------------------------------------------------------------- recommendation
def test_recommendation_trades_memory_for_latency():
    """Bytes and collectives alone (no launch or host-read cost), the head priced by its FLOPs
    (weights read in no time): replication wins under DP attention when memory allows, sampling
    on shards when it does not or attention is TP. At an H100's memory bandwidth decode reads
    the replicated head's whole matrix per step (1.3 GB for the study's model, 395 us) where a
    shard reads an eighth: replication no longer wins."""
    study = replace(STUDY, **BYTES_ONLY, memory_bandwidth=1e18)
    dp = P.plan(replace(study, dp=8))
    rec = P.recommend(dp)
    assert rec.design == "deepinfer-replicated" and "KV cache" in rec.reason
    assert "llama.cpp" not in rec.ranking  # one device, not an 8-rank design
    tight = P.recommend(dp, headroom_bytes=1 * P.GiB)
    assert tight.design == "vocabpar-sharded"
    assert "deepinfer-replicated would take" in tight.reason and "headroom" in tight.reason
    assert P.recommend(P.plan(study)).design == "vocabpar-sharded"  # attention TP: no free rows
    for bad in (-1, math.inf, math.nan, 1e300):
        with pytest.raises(ValueError, match="headroom"):
            P.recommend(dp, headroom_bytes=bad)
    decode = {c.name: c for c in P.plan(replace(STUDY, **BYTES_ONLY, dp=8))}
    assert decode["deepinfer-replicated"].head_time_s == pytest.approx(129280 * 5120 * 2 / 3.35e12)
    assert decode["deepinfer-replicated"].step_time_s > decode["vocabpar-sharded"].step_time_s
    assert P.recommend(list(decode.values())).design != "deepinfer-replicated"


def test_recommendation_when_nothing_fits():
    """A 1-token vocabulary padded over many ranks: llama.cpp (one device) is the leanest, and no
    multi-rank design fits a zero headroom."""
    costs = P.plan(replace(STUDY, vocab=1, ranks=4096, pad_to=4095))
    with pytest.raises(ValueError, match="no 4096-rank design fits a headroom of 0 B.*than llama.cpp"):
        P.recommend(costs, headroom_bytes=0)
    assert P.recommend(costs).design


# ---------------------------------------------------------------------- CLI
def test_cli_study_flag_reproduces_the_study(capsys):
    """The study's figures appear behind --study only, after one line saying what they are."""
    assert main(["plan", "--study"]) == 0
    out = capsys.readouterr().out
    for text in ("1.23 GiB", "157.8 MiB", "57.9 MB", "193 µs", "16 KB", "2.16 GiB", "2.6 M tokens",
                 "recommendation:", "vocabpar-sharded", "the study's figures: the reference workload"):
        assert text in out
    assert main(["plan"]) == 0
    assert "the study" not in capsys.readouterr().out
    assert main(["plan", "--preset", "gpt2", "--study"]) == 0
    assert "the study's figures" in capsys.readouterr().out


def test_cli_json_base_units(capsys):
    assert main(["plan", "--json", "--ranks", "4", "--vocab", "1000", "--hidden", "64", "--tied"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["bandwidth"] == 300e9 and data["workload"]["tied"] is True
    assert len(data["designs"]) == len(P.DESIGNS) and data["study"] == []
    assert data["recommendation"]["design"] in data["recommendation"]["ranking"]
    assert main(["plan", "--json", "--study"]) == 0
    study = json.loads(capsys.readouterr().out)["study"]
    assert {"quantity", "value", "unit", "study", "text", "agrees"} <= set(study[0])


EXTREMES = [(flag, value) for flag in ("--bandwidth", "--flops", "--kv-bytes-per-token", "--headroom")
            for value in ("1e300", "nan", "inf", "-inf", "-1", "-1e-300", "x")]
EXTREMES += [(flag, "1e-300") for flag in ("--bandwidth", "--flops", "--kv-bytes-per-token")]
EXTREMES += [(flag, value) for flag in ("--vocab", "--hidden", "--ranks", "--dp", "--batch", "--tokens",
                                        "--pad-to") for value in ("-1", "1e3", "1.5", "9" * 30)]
EXTREMES += [("--vocab", "0"), ("--hidden", "0"), ("--ranks", "0"), ("--dp", "0"), ("--pad-to", "0"),
             ("--ranks", "65537"), ("--bandwidth", "0"), ("--flops", "0"), ("--kv-bytes-per-token", "0")]
EXTREMES += [(flag, value) for flag in ("--temperature", "--top-p", "--min-p", "--skew")
             for value in ("1e300", "nan", "inf", "-inf", "-1", "-1e-300", "x")]
EXTREMES += [(flag, value) for flag in ("--top-k", "--spec-tokens", "--score-tokens", "--score-top-n")
             for value in ("-1", "1e3", "1.5", "9" * 30)]
EXTREMES += [("--top-p", "0"), ("--top-p", "1.01"), ("--min-p", "1.01"), ("--skew", "1.01"),
             ("--spec-tokens", "1025")]
EXTREMES += [(flag, value) for flag in ("--latency-us", "--launch-us", "--sync-us")
             for value in ("-1", "nan", "inf", "2e6", "x")]


@pytest.mark.parametrize("flag,value", EXTREMES)
def test_cli_rejects_out_of_range_numbers(flag, value, capsys):
    """Every numeric option: one line naming the option and the value, exit 2, nothing on stdout."""
    assert main(["plan", "--json", f"{flag}={value}"]) == 2  # "=": argparse reads "-inf" as an option
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"vocabpar plan: error: argument {flag}: ") and repr(value) in captured.err


@pytest.mark.parametrize("argv", [["--preset", "nope"], ["--weight-dtype", "fp7"], ["--dp", "3"],
                                  ["--vocab", "1", "--ranks", "4096", "--pad-to", "4095", "--headroom", "0"],
                                  ["--skew", "0.1"], ["--ranks", "3", "--skew", "0.33"]])
def test_cli_bad_input(argv, capsys):
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("vocabpar plan: error: ") and captured.err.count("\n") == 1


def _strict_json(text: str) -> dict:
    """Parse ``text`` rejecting NaN and Infinity, and check it re-serializes strictly."""
    def refuse(name: str) -> None:
        raise ValueError(f"non-finite JSON constant {name}")
    data = json.loads(text, parse_constant=refuse)
    json.dumps(data, allow_nan=False)
    return data


@pytest.mark.parametrize("end", [0, 1])
def test_cli_json_stays_finite_at_the_limits(end, capsys):
    """Every size at its lowest or highest accepted value, over the slowest links and compute:
    strict JSON, finite numbers."""
    sizes = {"--vocab": "vocab", "--hidden": "hidden", "--ranks": "ranks", "--batch": "batch",
             "--tokens": "tokens", "--pad-to": "pad_to", "--kv-bytes-per-token": "kv_bytes_per_token"}
    argv = [x for flag, name in sizes.items() for x in (flag, str(LIMITS[name][end]))]
    argv += ["--bandwidth", "1e-6", "--flops", "1e-6", "--headroom", "1e6", "--logits-dtype", "fp32"]
    assert main(["plan", "--json", *argv]) == 0, capsys.readouterr().err
    data = _strict_json(capsys.readouterr().out)
    assert all(math.isfinite(d["step_time_s"]) and d["kv_tokens"] >= 0 for d in data["designs"])
    assert main(["plan", *argv]) == 0 and "inf" not in capsys.readouterr().out.replace("deepinfer", "")


@pytest.mark.parametrize("name,written", [("out", "out.png"), ("out.png", "out.png"), ("a.b", None),
                                          ("out.pdf", None)])
def test_cli_plot_reports_the_file_written(name, written, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["plan", "--plot", str(tmp_path / name), "--json"]) == (0 if written else 2)
    captured = capsys.readouterr()
    if not written:
        assert captured.out == "" and captured.err.count("\n") == 1 and "--plot" in captured.err
        assert list(tmp_path.iterdir()) == []
        return
    _strict_json(captured.out)  # the plot message goes to stderr
    assert captured.err == f"wrote {tmp_path / written}\n"
    assert [p.name for p in tmp_path.iterdir()] == [written]
    assert (tmp_path / written).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_path():
    assert (png_path("a"), png_path("d/a.png"), png_path("A.PNG")) == ("a.png", "d/a.png", "A.PNG")
    for bad in ("a.pdf", "", "d/", ".", "a."):
        with pytest.raises(ValueError, match="not a .png file name"):
            png_path(bad)


@pytest.mark.parametrize("argv", [["--plot", "."], ["--plot", "missing/out.png"]])
def test_cli_plot_unwritable(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"argument --plot: cannot write {argv[1]!r}" in captured.err


def _designs_json(capsys, *argv: str) -> dict[str, dict]:
    assert main(["plan", "--json", *argv]) == 0
    return {d["name"]: d for d in json.loads(capsys.readouterr().out)["designs"]}


@pytest.mark.parametrize("sampling", [[], ["--top-p", "0.9"], ["--temperature", "0.8", "--top-k", "1000"]])
def test_latency_per_collective_prices_every_design(sampling, capsys):
    """Step time = collectives x latency + bytes / bandwidth + head time: moving the latency from
    0 to 50 us moves each design by exactly its collectives x 50 us (typical and worst case);
    replicated designs make none on the decode path. The engine sampler's threshold search takes
    the rounds that are fastest at the given latency (more of them, sending fewer bytes, when a
    collective is free): its step then moves by no more than its collectives at 0 us cost, and
    by at least its own."""
    fast, slow = (_designs_json(capsys, "--latency-us", latency, *sampling) for latency in ("0", "50"))
    engine = fast.pop("vocabpar-engine"), slow.pop("vocabpar-engine")
    moved = engine[1]["step_time_s"] - engine[0]["step_time_s"]
    assert engine[1]["collectives"] * 50e-6 - 1e-12 <= moved <= engine[0]["collectives"] * 50e-6 + 1e-12
    assert (engine[0]["collectives"] > engine[1]["collectives"]) == bool(sampling)
    for name, d in fast.items():
        assert (d["collectives"], d["collectives_worst"]) == (slow[name]["collectives"],
                                                              slow[name]["collectives_worst"])
        assert slow[name]["step_time_s"] - d["step_time_s"] == pytest.approx(
            d["collectives"] * 50e-6, rel=1e-9, abs=1e-15)
        assert slow[name]["step_time_worst_s"] - d["step_time_worst_s"] == pytest.approx(
            d["collectives_worst"] * 50e-6, rel=1e-9, abs=1e-15)
    for name in ("deepinfer-replicated", "llama.cpp"):
        assert fast[name]["collectives"] == fast[name]["collectives_worst"] == fast[name]["step_bytes"] == 0
    assert fast["vllm-gather"]["collectives"] == fast["vllm-all-gather"]["collectives"] + 1  # ids broadcast
    if not sampling:
        assert fast["vocabpar-sharded"]["collectives"] == 2  # owner gather + greedy round one


def test_sampled_steps_cost_at_least_greedy_on_shards(capsys):
    """--top-p (temperature 1 by default) prices the sampler's rounds: at least greedy's
    collectives and bytes; the collecting designs sample locally and do not change."""
    greedy = _designs_json(capsys)
    top_p = _designs_json(capsys, "--top-p", "0.9")
    sharded, base = top_p["vocabpar-sharded"], greedy["vocabpar-sharded"]
    assert base["collectives"] == base["collectives_worst"] == 2
    assert sharded["collectives"] >= base["collectives"] and sharded["step_bytes"] > base["step_bytes"]
    assert sharded["collectives_worst"] >= sharded["collectives"] and \
        sharded["step_bytes_worst"] > sharded["step_bytes"]
    # typical: round one with 512/8 = 64 candidates per rank, the top-p total; worst: + the search
    # (two rounds, the settle), a crowded settle's round more, the draw
    B, n = 256, 8
    round_one = (n - 1) * B * (2 + 2 * 64) * 8
    assert sharded["collection_bytes"] == round_one + round(2 * 7 / 8 * B * 8)
    assert (sharded["collectives"], sharded["collectives_worst"]) == (1 + 2, 1 + 7)
    for name in ("vllm-all-gather", "sglang-all-to-all", "deepinfer-replicated"):  # the same bytes
        assert {k: v for k, v in top_p[name].items() if "launches" not in k and "time" not in k} == \
            {k: v for k, v in greedy[name].items() if "launches" not in k and "time" not in k}
    greedy_again = _designs_json(capsys, "--top-p", "0.9", "--temperature", "0")
    assert greedy_again["vocabpar-sharded"] == base


def test_sampler_traffic_per_parameter():
    n, B, V, widest = 4, 16, 12000, 3000
    t = sampler_traffic(B, n, widest, V, P.Sampling(temperature=1.0, top_k=50))
    assert (t.collectives, t.bytes) == (1, 3 * B * (2 + 2 * 50) * 8)  # the top-k set is among the candidates
    assert (t.collectives_worst, t.bytes_worst) == (2, t.bytes + 3 * B * 16)  # + the draw's all-gather
    # top-k beyond the candidates: a threshold search (2 histograms, the settling all-gather draws)
    t = sampler_traffic(B, n, widest, V, P.Sampling(temperature=1.0, top_k=1000))
    hist = round(2 * 3 / 4 * B * 2049 * 8)
    assert (t.collectives, t.bytes) == (4, 3 * B * 4 * 8 + 2 * hist + 3 * B * 67 * 8)
    # every token among the candidates (a tiny vocabulary): nothing to search, total or spread
    tiny = sampler_traffic(B, n, 10, 40, P.Sampling(temperature=1.0, top_p=0.5))
    assert tiny.collectives == tiny.collectives_worst == 1
    assert sampler_traffic(B, 1, V, V, P.Sampling(temperature=1.0, top_p=0.5)) == Traffic()
    assert sampler_traffic(B, n, widest, V, P.Sampling(top_k=10)) == exact(1, 3 * B * 16)  # greedy
    with pytest.raises(ValueError, match="top_p"):
        P.Sampling(top_p=0)


def test_speculative_verification_per_design(capsys):
    """Gather-then-verify designs collect the B·(K+1) target rows; replicated ones verify
    locally; on shards it is the sampler's work on those rows (greedy: one all-gather of 16 B
    per row), with draft logits on B·(2K+1) rows plus two small collectives when sampling."""
    d = _designs_json(capsys, "--spec-tokens", "4")
    B, K, n, c = 256, 4, 8, 129280 // 8
    assert d["vllm-all-gather"]["verify_bytes"] == (n - 1) * B * (K + 1) * c * 2
    assert d["vllm-all-gather"]["verify_collectives"] == 1
    assert d["vllm-gather"]["verify_collectives"] == 2  # + the broadcast of accepted ids
    assert d["sglang-all-to-all"]["verify_bytes"] == (n - 1) * (B * (K + 1) // n) * c * 2
    assert d["deepinfer-replicated"]["verify_bytes"] == d["deepinfer-replicated"]["verify_collectives"] == 0
    sharded = d["vocabpar-sharded"]
    assert (sharded["verify_bytes"], sharded["verify_collectives"]) == ((n - 1) * B * (K + 1) * 16, 1)
    assert sharded["verify_bytes"] < 0.01 * d["vllm-all-gather"]["verify_bytes"]
    assert _designs_json(capsys)["vocabpar-sharded"]["verify_bytes"] == 0  # no drafts
    w = replace(STUDY, spec_tokens=K, draft_logits=True, sampling=P.Sampling(temperature=1.0))
    widest = shard_rows(STUDY.vocab, n)
    # the masses' all-reduce always; the corrections' all-gather (16 B per rejecting row) only
    # when some row rejects: none typically, every row at worst
    assert verify_traffic("none", w, n, "padded") == (
        sampler_traffic(B * (2 * K + 1), n, widest, STUDY.vocab, w.sampling)
        + all_reduce(B * K * 4 * 8, n) + maybe(all_gather(B * 2 * 8, n)))
    greedy = replace(w, sampling=P.Sampling())  # a greedy row ignores its draft logits
    assert verify_traffic("none", greedy, n, "padded") == exact(1, (n - 1) * B * (K + 1) * 16)
    assert verify_traffic("all_gather", w, n, "padded") == logits_traffic("all_gather", B * (K + 1), w, n,
                                                                              "padded")


def test_prompt_scoring_per_design(capsys):
    d = _designs_json(capsys, "--score-tokens", "1000", "--score-top-n", "5")
    n, c, T = 8, 129280 // 8, 1000
    assert d["vllm-all-gather"]["score_bytes"] == (n - 1) * T * c * 2
    assert d["vllm-all-gather"]["score_peak_bytes"] == T * c * 2 + T * n * c * 2  # shard + gathered [T, V]
    blocks = (256, 256, 256, 232)  # SCORE_ROWS per token_logprobs call
    assert d["vocabpar-sharded"]["score_bytes"] == sum((n - 1) * rows * (3 + 2 * 5) * 8
                                                       + round(2 * 7 / 8 * rows * 8) for rows in blocks)
    assert d["vocabpar-sharded"]["score_peak_bytes"] == 256 * c * 2  # one block of logits at a time
    assert d["deepinfer-replicated"]["score_bytes"] == 0


def test_skew_prices_the_owner_gather_and_flips_the_recommendation():
    """A vocabulary only twice the hidden size: with balanced ownership the owner gather wins;
    when one rank owns half the tokens or more it moves up to (n-1)·T rows, and a design with
    the ring all-reduce (which ownership does not change) wins."""
    w = P.Workload(vocab=16000, hidden=8192, ranks=8, latency=15e-6, **BYTES_ONLY)
    balanced, skewed = P.plan(w), P.plan(replace(w, skew=1.0))
    assert P.plan(replace(w, skew=1 / 8)) == balanced
    by = {c.name: c for c in skewed}
    assert by["vocabpar-sharded"].embedding_bytes == 7 * 8192 * 8192 * 2
    assert by["vocabpar-sharded"].step_bytes == 7 * 256 * 8192 * 2 + 7 * 256 * 16
    assert by["vllm-all-gather"] == {c.name: c for c in balanced}["vllm-all-gather"]  # all-reduce: no change
    assert P.recommend(balanced).design == "vocabpar-sharded"
    assert P.recommend(P.plan(replace(w, skew=0.25))).design == "vocabpar-sharded"
    for skew in (0.5, 1.0):
        assert P.recommend(P.plan(replace(w, skew=skew))).design == "sglang-all-to-all"
    assert busiest_owner(10, 3, 1 / 3) == 4 and busiest_owner(9, 3, 1 / 3) == 3
    assert busiest_owner(9, 3, 0.5) == 5 and busiest_owner(9, 3) == 3
    with pytest.raises(ValueError, match="skew must be in"):
        replace(w, skew=0.1)


def test_winner_map_over_latency_and_bandwidth():
    """Slow collectives favour the design with none (replication), fast links and cheap
    collectives the sharded sampler."""
    grid = winners(replace(STUDY, **BYTES_ONLY), [0.0, 1e-3], [1e9, 1e13])
    assert grid[1][0] == "deepinfer-replicated"
    assert grid[0][1] == "vocabpar-sharded"


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "2e6", "x"])
def test_latency_rejects_bad_values(value, capsys):
    assert main(["plan", "--latency-us", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--latency-us" in err[0]


# ---------------------------------------------------------------------- sampling, verification, scoring
def _family(name: str, B: int, V: int) -> torch.Tensor:
    """Peaked (LLM-like), flat and Zipf logit rows, as the sampler's benchmark draws them."""
    g = torch.Generator().manual_seed(3)
    if name == "peaked":
        return torch.randn(B, V, generator=g) * 5
    if name == "flat":
        return torch.randn(B, V, generator=g) * 0.5
    zipf = torch.stack([-1.1 * torch.log1p(torch.randperm(V, generator=g).float()) for _ in range(B)])
    return zipf + torch.randn(B, V, generator=g) * 0.1


# name -> (logit family, sampling, whether the family is the planner's typical case)
SAMPLED = {
    "greedy": ("peaked", P.Sampling(), True),
    "demo": ("peaked", P.Sampling(temperature=0.9, top_k=200, top_p=0.95), True),
    "top-p peaked": ("peaked", P.Sampling(temperature=1.0, top_p=0.9), True),
    "mixed": ("peaked", P.Sampling(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05), True),
    "top-k 1000": ("peaked", P.Sampling(temperature=1.0, top_k=1000), True),
    "temperature only": ("peaked", P.Sampling(temperature=0.7), True),
    "top-p flat": ("flat", P.Sampling(temperature=1.0, top_p=0.9), False),
    "top-p zipf": ("zipf", P.Sampling(temperature=1.0, top_p=0.9), False),
    "min-p flat": ("flat", P.Sampling(temperature=1.0, min_p=0.1), False),
    "top-k 1000 top-p flat": ("flat", P.Sampling(temperature=1.0, top_k=1000, top_p=0.9), False),
    "top-n-sigma": ("peaked", P.Sampling(temperature=1.0, top_n_sigma=1.0), True),
    "top-n-sigma top-p": ("peaked", P.Sampling(temperature=1.0, top_p=0.9, top_n_sigma=1.0), True),
    "top-n-sigma top-p zipf": ("zipf", P.Sampling(temperature=1.0, top_p=0.9, top_n_sigma=2.0), False),
}
B_SAMPLED, V_SAMPLED, SCORED_ROWS, SCORED_TOP_N = 16, 12000, 12, 3


def _measure_sampler_and_scorer():
    """Per layout scheme and sampling config: the collectives and bytes of one sample() call
    (agreement check off), and of one token_logprobs call."""
    from vocabpar import SamplingParams, comm, sample, token_logprobs

    n, me, out = comm.world_size(), comm.rank(), {}
    for scheme in ("padded", "uneven"):
        layout = VocabLayout(V_SAMPLED, n, scheme=scheme)
        ids = layout.local_token_ids(me)
        for name, (family, s, _) in SAMPLED.items():
            local = _family(family, B_SAMPLED, V_SAMPLED)[:, ids.clamp(min=0)]
            local[:, ids < 0] = float("-inf")
            filtered = {f.name: getattr(s, f.name) for f in FILTERS}
            params = SamplingParams(temperature=s.temperature, **filtered, seed=list(range(B_SAMPLED)))
            comm.reset_traffic()
            sample(local, layout, params, positions=torch.arange(B_SAMPLED), check=False)
            out[scheme, name] = (sum(c.calls for c in comm.traffic().values()), comm.total_bytes()[1])
        comm.reset_traffic()
        token_logprobs(local[:SCORED_ROWS], layout, torch.arange(SCORED_ROWS), top_n=SCORED_TOP_N,
                       check=False)
        out[scheme, "score"] = (sum(c.calls for c in comm.traffic().values()), comm.total_bytes()[1])
    return out


@pytest.fixture(scope="module")
def sampler_measured():
    from vocabpar.launch import run

    return run(_measure_sampler_and_scorer, 4, timeout=120)


def test_sampler_prediction_bounds_what_sample_sends(sampler_measured):
    """Real sample() calls on 4 gloo ranks: collectives and bytes lie within the planner's
    [typical, worst] range, and equal the typical case on the peaked rows it stands for."""
    for per_rank in sampler_measured:
        for (scheme, name), (calls, received) in per_rank.items():
            if name == "score":
                continue
            _, s, typical = SAMPLED[name]
            widest = min(shard_rows(V_SAMPLED, 4, scheme), V_SAMPLED)
            t = sampler_traffic(B_SAMPLED, 4, widest, V_SAMPLED, s)
            assert t.collectives <= calls <= t.collectives_worst, (scheme, name, calls, t)
            assert t.bytes <= received <= t.bytes_worst, (scheme, name, received, t)
            if typical:
                assert (calls, received) == (t.collectives, t.bytes), (scheme, name, calls, received, t)


def test_scoring_prediction_equals_what_token_logprobs_sends(sampler_measured):
    for per_rank in sampler_measured:
        for scheme in ("padded", "uneven"):
            w = replace(STUDY, vocab=V_SAMPLED, ranks=4, score_tokens=SCORED_ROWS, score_top_n=SCORED_TOP_N)
            assert per_rank[scheme, "score"] == (2, score_bytes("none", w, 4, scheme)[0])


# ---------------------------------------------------------------------- models from config.json
DATA = pathlib.Path(__file__).parent / "data"
CONFIGS = {  # shipped test data: the models' public config.json files (sources in presets.PRESET_CONFIGS)
    "llama-3.1-8b": (128256, 4096, False, 131072),  # Llama: 32 layers x 2 x 8 KV heads x 128 x 2 B
    "qwen3-8b": (151936, 4096, False, 147456),  # Qwen 3: 36 layers x 2 x 8 x 128 x 2 B
    "gemma-3-12b": (262208, 3840, True, 393216),  # multimodal: text_config, class defaults fill the rest
    "deepseek-v3": (129280, 7168, False, 70272),  # MLA: 61 layers x (512 + 64) latent x 2 B
}


@pytest.mark.parametrize("name", CONFIGS)
def test_config_json_gives_the_presets_model(name):
    model = load_config(DATA / name / "config.json")
    assert (model.vocab_size, model.hidden_size, model.tied, model.kv_bytes_per_token) == CONFIGS[name]
    assert load_config(DATA / name) == model  # a folder holding config.json
    same = {f: getattr(model, f) for f in ("vocab_size", "hidden_size", "tied", "layers", "kv_heads",
                                           "head_dim", "dtype", "kv_latent", "kv_bytes")}
    assert same == {f: getattr(preset(name), f) for f in same}


@pytest.mark.parametrize("name", CONFIGS)
def test_cli_config_numbers_equal_the_presets(name, capsys):
    def run(*model: str) -> dict:
        assert main(["plan", "--json", "--ranks", "4", "--batch", "32", "--top-p", "0.9", *model]) == 0
        data = json.loads(capsys.readouterr().out)
        del data["model"]["name"], data["model"]["source"]
        return data
    assert run("--config", str(DATA / name / "config.json")) == run("--preset", name)


def test_kv_bytes_come_from_the_model():
    """Llama 3.1 70B: 80 layers x 2 x 8 KV heads x 128 x 2 B = 327,680 B per token; at TP 8 each rank
    holds one KV head (40,960 B); beyond 8 ranks heads are replicated. A latent cache is whole on
    every rank; the study's quoted figure stays its own."""
    m = preset("llama-3.1-70b")
    assert m.kv_bytes_per_token == 327_680 and m.kv_bytes_per_rank(8) == 40_960
    assert m.kv_bytes_per_rank(16) == 40_960 and m.kv_bytes_per_rank(1) == 327_680
    assert preset("deepseek-v3").kv_bytes_per_rank(8) == 70_272
    assert preset("deepseek-v4.1-flash").kv_bytes_per_rank(8) == 890
    w = _workload("llama-3.1-70b", ranks=8)
    forgone = _costs(w)["deepinfer-replicated"]
    assert forgone.kv_tokens == forgone.extra_memory_bytes // 40_960
    assert P.plan(replace(w, kv_bytes_per_token=None))[0].kv_tokens is None  # unknown: no column


def test_presets_cover_the_large_vocabularies(capsys):
    for name in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "qwen3-8b", "qwen3-30b-a3b",
                 "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-120b", "gemma-3-27b", "glm-4.5", "gpt2",
                 "deepseek-v4.1-flash", "llama-2-7b", "qwen2.5-7b", "qwen2.5-0.5b", "llama-3-8b"):
        assert preset(name).source
    assert main(["plan", "--list-presets"]) == 0
    out = capsys.readouterr().out
    assert "gpt-oss-120b" in out and "201088" in out and "huggingface.co/openai/gpt-oss-120b" in out


def test_class_defaults_match_transformers():
    """Fields a released config may leave to its class: the table equals transformers' defaults."""
    transformers = pytest.importorskip("transformers")
    for model_type, fields in CLASS_DEFAULTS.items():
        config = transformers.AutoConfig.for_model(model_type)
        for field_name, value in fields.items():
            assert getattr(config, field_name) == value, (model_type, field_name)


@pytest.mark.parametrize("text,error", [
    ("{", "is not valid JSON"),
    ('{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "tie_word_embeddings": false}',
     "missing 'vocab_size'"),
    ('{"vocab_size": 0, "hidden_size": 64}', "vocab_size must be a positive integer, got 0"),
    ('{"vocab_size": 10, "hidden_size": "64"}', "hidden_size must be a positive integer, got '64'"),
    ('{"vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}',
     "missing 'tie_word_embeddings'"),
    ('{"vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, '
     '"tie_word_embeddings": false, "torch_dtype": "float7"}', "unknown dtype 'float7'"),
    ('{"text_config": [], "vocab_size": 10}', "text_config must be an object"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_config_is_one_clear_line(text, error, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(error)):
        load_config(path)
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and error in err and err.startswith("vocabpar plan: error: ")


def test_missing_config_is_one_clear_line(tmp_path, capsys):
    for path in (tmp_path / "nope.json", tmp_path):  # no file; a folder without config.json
        assert main(["plan", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "cannot read" in err
    assert main(["plan", "--config", str(DATA / "llama-3.1-8b"), "--preset", "gpt2"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_tied_override_and_nested_text_config(tmp_path):
    config = {"text_config": {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float16"},
              "vocab_size": 5, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    m = load_config(tmp_path)
    assert (m.vocab_size, m.tied, m.dtype, m.head_dim, m.kv_bytes_per_token) == (1000, True, "fp16", 16,
                                                                                  2 * 2 * 2 * 16 * 2)
    assert load_config(tmp_path, tied=False).tied is False


# ---------------------------------------------------------------------- honest columns
def test_speculative_step_time_includes_verification(capsys):
    """With drafts the step priced and recommended is a verification step: vllm-all-gather
    receives the B·(K+1) gathered target rows (289.6 MB at the study's shape, K = 4)."""
    plain = _designs_json(capsys)
    spec = _designs_json(capsys, "--spec-tokens", "4")
    gather = spec["vllm-all-gather"]
    assert gather["step"] == "verify" and plain["vllm-all-gather"]["step"] == "decode"
    assert gather["verify_bytes"] == 289_587_200
    assert gather["step_bytes"] >= gather["verify_bytes"]
    assert gather["step_time_s"] > gather["verify_bytes"] / 300e9 > 900e-6
    assert spec["vocabpar-sharded"]["head_flops"] == 5 * plain["vocabpar-sharded"]["head_flops"]
    assert main(["plan", "--spec-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "verify time" in out and "shortest estimated verification step" in out


def test_labels_fit_the_workload():
    tp = {c.name: c.summary for c in P.plan(replace(STUDY, dp=1))}
    dp = {c.name: c.summary for c in P.plan(replace(STUDY, dp=8))}
    for name in ("sglang-dp-gather-scatter", "sglang-all-to-all"):
        assert "DP attention:" not in tp[name] and dp[name].startswith("DP attention:")


# ---------------------------------------------------------------------- execution modes
def test_mode_sets_the_prices_and_names_its_sources(capsys):
    launches = {}
    for name, m in P.MODES.items():
        d = json.loads((main(["plan", "--json", "--mode", name]), capsys.readouterr().out)[1])
        assert (d["workload"]["latency"], d["workload"]["launch"], d["workload"]["sync"]) == \
            (m.latency, m.launch, m.sync)
        assert d["mode"]["name"] == name and "#" in d["mode"]["latency_source"]
        assert d["workload"]["compiled"] is m.compiled is (name == "graph")
        launches[name] = {x["name"]: x["launches"] for x in d["designs"]}
    # graph mode prices the engine step's compiled kernels; every other design's launches stay
    assert launches["graph"]["vocabpar-engine"] < launches["eager"]["vocabpar-engine"]
    assert {k: v for k, v in launches["graph"].items() if k != "vocabpar-engine"} == \
        {k: v for k, v in launches["eager"].items() if k != "vocabpar-engine"}
    assert P.MODES["graph"].latency < P.MODES["eager"].latency < P.MODES["multinode"].latency
    d = json.loads((main(["plan", "--json", "--mode", "graph", "--latency-us", "3", "--launch-us", "0.5",
                          "--sync-us", "40"]), capsys.readouterr().out)[1])
    assert (d["workload"]["latency"], d["workload"]["launch"], d["workload"]["sync"]) == \
        pytest.approx((3e-6, 0.5e-6, 40e-6))
    assert main(["plan", "--mode", "graph", "--latency-us", "3"]) == 0
    out = capsys.readouterr().out
    assert "graph mode" in out and "collective: given on the command line" in out and "#1259" not in out
    assert main(["plan", "--mode", "warp"]) == 2
    assert "--mode" in capsys.readouterr().err


def test_step_time_prices_launches_and_host_reads(capsys):
    """Step time = collectives·alpha + bytes/beta + launches·lambda + host reads·s + head time:
    each price moves each design by exactly its own count."""
    base = _designs_json(capsys, "--top-p", "0.9")
    for flag, count in (("--launch-us", "launches"), ("--sync-us", "host_reads")):
        moved = _designs_json(capsys, "--top-p", "0.9", flag, "105" if flag == "--launch-us" else "120")
        delta = 100e-6
        for name, d in base.items():
            assert moved[name]["step_time_s"] - d["step_time_s"] == pytest.approx(d[count] * delta, abs=1e-12)
    sharded, gather = base["vocabpar-sharded"], base["vllm-all-gather"]
    # every design copies its sampled ids to the host once per step: one read at least
    assert sharded["host_reads"] > gather["host_reads"] == host.IDS_TO_HOST.reads
    assert sharded["launches"] > gather["launches"]
    assert sharded["launches_worst"] >= sharded["launches"]
    assert sharded["host_reads_worst"] >= sharded["host_reads"]


def test_recommendation_changes_with_the_mode():
    """Llama 3.1 70B at TP 8, B=864 greedy: with collectives and launches in a CUDA graph the
    engine sampler's few bytes win; eagerly, its launches make the all-to-all faster; across
    nodes, its fewer collectives make it win again."""
    w = _workload("llama-3.1-70b", ranks=8, batch=864)
    picks = {name: P.recommend(P.plan(replace(w, latency=m.latency, launch=m.launch, sync=m.sync,
                                               compiled=m.compiled))).design
             for name, m in P.MODES.items()}
    assert picks == {"graph": "vocabpar-engine", "eager": "sglang-all-to-all",
                     "multinode": "vocabpar-engine"}


# ---------------------------------------------------------------------- the crossover
def test_crossover_is_where_shards_start_winning():
    w = _workload("llama-3.1-8b", ranks=4, sampling=P.Sampling(1.0, top_p=0.9))
    at = P.crossover(w)
    assert 1 < at < LIMITS["batch"][1]
    g, s = (next(d for d in P.DESIGNS if d.name == n) for n in (GATHER, SHARDS))
    assert path_time(s, replace(w, batch=at), "decode") <= path_time(g, replace(w, batch=at), "decode")
    below = replace(w, batch=at - 1)
    assert path_time(s, below, "decode") > path_time(g, below, "decode")
    assert P.crossover(replace(w, launch=0, sync=0, latency=0)) == 1  # no fixed costs: fewer bytes win
    slow_link = replace(w, bandwidth=1e3)
    assert P.crossover(slow_link) == 1
    with pytest.raises(ValueError, match="spec_tokens > 0"):
        P.crossover(w, "verify")
    with pytest.raises(ValueError, match="unknown step"):
        P.crossover(w, "prefill")


@pytest.mark.parametrize("step", ["decode", "verify", "score"])
def test_crossover_moves_with_alpha_lambda_and_the_sync_cost(step):
    """Raising a price moves the crossover up when sampling on shards pays more of that fixed cost
    than gathering, down when it pays less, and leaves it when both pay the same: the direction
    the counts imply."""
    w = _workload("qwen3-8b", ranks=8, sampling=P.Sampling(1.0, top_p=0.9), draft_logits=step == "verify",
                  spec_tokens=3 * (step == "verify"), score_tokens=4096 * (step == "score"))
    g, s = (next(d for d in P.DESIGNS if d.name == n) for n in (GATHER, SHARDS))
    traffic = {d.name: path_traffic(d, w, step) for d in (g, s)}
    work = {d.name: host_work(d, w, step) for d in (g, s)}
    extra = {"latency": traffic[s.name].collectives - traffic[g.name].collectives,
             "launch": work[s.name].launches - work[g.name].launches,
             "sync": work[s.name].reads - work[g.name].reads}
    assert extra["launch"] > 0 and extra["sync"] > 0
    before = P.crossover(w, step)
    for price, more in extra.items():
        after = P.crossover(replace(w, **{price: getattr(w, price) * 4 + 1e-6}), step)
        if more > 0:
            assert after is None or after > before, (price, before, after)
        elif more < 0:
            assert after < before, (price, before, after)
        else:
            assert after == before, (price, before, after)


def test_crossover_in_the_report_and_json(capsys):
    assert main(["plan", "--preset", "llama-3.1-8b", "--ranks", "4", "--batch", "16", "--json",
                 "--spec-tokens", "2", "--score-tokens", "1000"]) == 0
    data = json.loads(capsys.readouterr().out)
    steps = {c["step"]: c for c in data["crossovers"]}
    assert set(steps) == {"verify", "score"} and steps["score"]["size"] == 1000
    assert main(["plan", "--preset", "llama-3.1-8b", "--ranks", "4", "--batch", "16", "--json"]) == 0
    (c,) = json.loads(capsys.readouterr().out)["crossovers"]
    assert main(["plan", "--preset", "llama-3.1-8b", "--ranks", "4", "--batch", "16"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the lines unwrapped
    w = _workload("llama-3.1-8b", ranks=4, batch=16)
    g, s = (next(d for d in P.DESIGNS if d.name == c[side]) for side in ("gather", "shards"))
    assert c["batch"] == P.crossover(w, "decode", g.name, s.name, whole=True) > 16
    assert (c["gather_s"], c["shards_s"]) == (step_time(g, w, "decode"), step_time(s, w, "decode"))
    assert (f"{g.name} (collecting the logits) is faster below {c['batch']:,} rows, {s.name} (sampling on "
            f"shards) from {c['batch']:,} on") in out
    assert main(["plan", "--ranks", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["crossovers"] == []


def test_plot_marks_the_crossover(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["plan", "--preset", "llama-3.1-8b", "--ranks", "4", "--plot", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()


def test_switch_picks_the_crossover():
    """strategy="auto"'s choice: gathering below the planner's crossover, shards from it on."""
    switch = P.Switch(latency=25e-6, bandwidth=3e8, launch=5e-6, sync=20e-6)
    w = switch.workload(50257, 64, 2, 1, P.Sampling())
    at = switch.crossover(w)
    assert at == P.crossover(w) == 3
    assert [switch.strategy(replace(w, batch=b)) for b in (1, 2, 3, 4)] == ["all_gather"] * 2 + ["none"] * 2
    assert P.Switch.for_mode("graph").latency == P.MODES["graph"].latency
    with pytest.raises(ValueError, match="latency"):
        P.Switch(latency=-1.0)


# ---------------------------------------------------------------------- the report in a terminal
LLAMA_8B = str(DATA / "llama-3.1-8b" / "config.json")


def _report(capsys, monkeypatch, *argv: str, columns: int = 100) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["--config", LLAMA_8B], ["--mode", "graph"],
                                  ["--config", LLAMA_8B, "--mode", "graph", "--top-p", "0.9"],
                                  ["--spec-tokens", "4", "--draft-logits", "--top-p", "0.9", "--score-tokens",
                                   "1000", "--score-top-n", "5", "--skew", "0.5", "--study"]])
def test_report_fits_100_columns(argv, capsys, monkeypatch):
    """No line over COLUMNS; the table keeps the columns that decide the recommendation, the last
    line names those --wide adds, and the header keeps its facts (wrapped, not cut)."""
    out = _report(capsys, monkeypatch, *argv)
    lines = out.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    table = next(line for line in lines if line.lstrip().startswith("design "))
    step = "verify" if "--spec-tokens" in argv else "step"
    assert all(h in table for h in (f"{step} recv", "coll", "launches", "host reads", f"{step} time"))
    assert lines[-1].startswith("(--wide adds ranks, ") and "emb/fwd(8192)" in lines[-1]
    flat = " ".join(out.split())
    for fact in ("per host read", "(NVIDIA/nccl#1984, #1259)" if "graph" in argv else "#4812",
                 "recommendation:", "crossover, "):
        assert fact in flat


def test_report_follows_the_terminal_and_wide_keeps_every_column(capsys, monkeypatch):
    every = ["ranks", "weights", "logits", "emb/fwd(8192)", "step recv", "head/rank", "coll", "launches",
             "host reads", "step time", "KV forgone"]
    for out in (_report(capsys, monkeypatch, "--wide"), _report(capsys, monkeypatch, columns=300)):
        table = next(line for line in out.splitlines() if line.lstrip().startswith("design "))
        assert all(h in table for h in every) and "--wide adds" not in out
    narrow = _report(capsys, monkeypatch, columns=80)
    assert max(map(len, narrow.splitlines())) <= 80 and "--wide adds" in narrow
    monkeypatch.delenv("COLUMNS")  # not a terminal (captured), no COLUMNS: 100
    assert main(["plan"]) == 0
    assert max(map(len, capsys.readouterr().out.splitlines())) <= 100


def test_tp_is_ranks(capsys, monkeypatch):
    assert _report(capsys, monkeypatch, "--tp", "4") == _report(capsys, monkeypatch, "--ranks", "4")
    assert _report(capsys, monkeypatch, "--tp", "8", "--ranks", "8") == _report(capsys, monkeypatch)
    assert main(["plan", "--tp", "8", "--ranks", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("vocabpar plan: error: --tp 8 and --ranks 4 disagree")
    assert main(["plan", "--tp", "0"]) == 2 and "argument --tp: " in capsys.readouterr().err


def test_crossover_names_the_faster_sampler_and_says_when_shards_never_win(capsys, monkeypatch):
    """Llama 3.1 70B at TP 8 in graph mode, top-p 0.9, B=1024: the table's fastest design is the
    engine, and the crossover line names it against the fastest design collecting the logits
    (greedy, the compiled engine is the fastest at every batch: the line says so)."""
    greedy = ["--preset", "llama-3.1-70b", "--tp", "8", "--mode", "graph", "--batch", "1024"]
    assert "vocabpar-engine (sampling on shards) is at least as fast as sglang-all-to-all (collecting the " \
           "logits) at every batch" in " ".join(_report(capsys, monkeypatch, *greedy).split())
    argv = greedy + ["--temperature", "1", "--top-p", "0.9"]
    designs = _designs_json(capsys, *argv)
    fastest = min((d for d in designs.values() if d["applies"]), key=lambda d: d["step_time_s"])["name"]
    assert fastest == "vocabpar-engine"
    flat = " ".join(_report(capsys, monkeypatch, *argv).split())
    (c,) = json.loads((main(["plan", "--json", *argv]), capsys.readouterr().out)[1])["crossovers"]
    assert c["shards"] == "vocabpar-engine" and c["batch"] <= 1024 and c["gather"] == "sglang-all-to-all"
    assert (f"sglang-all-to-all (collecting the logits) is faster below {c['batch']:,} rows, vocabpar-engine "
            f"(sampling on shards) from {c['batch']:,} on") in flat
    # eager, a launch costing a second: the shards' extra launches never pay off
    flat = " ".join(_report(capsys, monkeypatch, *argv, "--mode", "eager", "--launch-us", "1000000").split())
    assert (f"(collecting the logits) is faster than vocabpar-engine (sampling on shards) at every batch "
            f"searched, {SEARCHED[0]} to {SEARCHED[1]:,} rows") in flat


def test_one_device_row_only_on_one_rank(capsys, monkeypatch):
    """llama.cpp (one device) is a row at --tp 1 only; --json keeps it, marked as not applying."""
    assert "llama.cpp" not in _report(capsys, monkeypatch, "--tp", "8")
    assert "\n               llama.cpp " in _report(capsys, monkeypatch, "--tp", "1")
    eight, one = _designs_json(capsys, "--tp", "8"), _designs_json(capsys, "--tp", "1")
    assert eight["llama.cpp"]["applies"] is False and one["llama.cpp"]["applies"] is True
    assert all(d["applies"] for name, d in eight.items() if name != "llama.cpp")


@pytest.mark.parametrize("sampling", [P.Sampling(), P.Sampling(1.0, top_p=0.9, min_p=0.05)])
def test_every_design_pays_one_copy_of_its_ids_and_the_engine_nothing_more(sampling):
    """A decode or verification step copies its ids to the host once, whatever the design; the
    engine Sampler's flags ride in that copy, so its step makes that one read only."""
    for spec in (0, 2):
        w = replace(STUDY, sampling=sampling, spec_tokens=spec, draft_logits=bool(spec))
        step = "verify" if spec else "decode"
        for d in P.DESIGNS:
            n = 1 if d.single_device else w.ranks
            key = sampler_key(w, n, min(shard_rows(w.vocab, n, d.scheme), w.vocab))
            own = (host.verify_work(d.sampler, key, True) if spec else host.sampler_work(d.sampler, key))
            reads = host.collect_work(d.strategy, n).reads + own.reads + host.IDS_TO_HOST.reads
            assert host_work(d, w, step).reads == reads == design_cost(d, w).host_reads, (d.name, spec)
        engine = next(d for d in P.DESIGNS if d.name == "vocabpar-engine")
        assert design_cost(engine, w).host_reads == host.IDS_TO_HOST.reads == 1


def test_graph_mode_note_keeps_the_engine_in_the_graph(capsys, monkeypatch):
    flat = " ".join(_report(capsys, monkeypatch, "--mode", "graph", "--top-p", "0.9").split())
    note = flat[flat.index("note: "):]
    assert "the step itself stays one CUDA graph" in flat and "failure flags ride in that copy" in flat
    assert "vocabpar-sharded" in note and "vocabpar-engine" not in note
