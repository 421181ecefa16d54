import contextlib
import io
import json

import pytest

from vocabpar.demo import MODES, SPECULATIVE_DESIGNS
from vocabpar.demo import designs as demo_designs
from vocabpar.integrations.speculative import can_verify
from vocabpar.plan import DESIGNS

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def demo():
    """One small demo run (2 ranks, 3 prompts, 3 new tokens) through the CLI, as its --json data
    (in this process: ``python -m vocabpar`` itself is test_cli's)."""
    from vocabpar.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["demo", "--ranks", "2", "--batch", "3", "--tokens", "3", "--json", "--quiet"])
    return status, json.loads(out.getvalue())


def test_every_design_generates_the_reference_tokens(demo):
    _, data = demo
    assert (data["model"], data["vocab"], data["tied"], data["ranks"]) == ("gpt2", 50257, True, 2)
    designs = demo_designs()
    assert [d.name for d in designs] == [d.name for d in DESIGNS if not d.single_device] + ["vocabpar-auto"]
    assert [(r["design"], r["mode"]) for r in data["rows"]] == [
        (d.name, m.name) for d in designs for m in MODES
        if not m.spec_tokens or d.name in SPECULATIVE_DESIGNS]
    # the engine Sampler's step reads the host less than the functional sampler's, in every mode
    reads = {(r["design"], r["mode"]): r["host_reads"] for r in data["rows"]}
    for m in MODES:
        assert reads["vocabpar-engine", m.name] < reads["vocabpar-sharded", m.name], m.name
    assert all(can_verify(d.strategy) for d in designs if d.name in SPECULATIVE_DESIGNS)
    assert all(0 <= r["acceptance"] <= 1 for r in data["rows"] if r["mode"].startswith("spec"))
    assert [r["equal"] for r in data["rows"]] == [3] * len(data["rows"])
    assert data["tokens_agree"] and demo[0] == 0
    for r in data["rows"]:
        assert r["ms_per_step"] > 0 and r["peak_rss_mib"] > 0 and r["weights_mib"] > 0
    replicated = [r for r in data["rows"] if r["design"] == "deepinfer-replicated"]
    assert all(r["measured"] == 0 and r["id_bytes"] == 0 for r in replicated)


def _check_against_the_planner(rows: list[dict], ranks: int) -> None:
    """Every row has a prediction and every decode step lies within it: equal where the traffic
    does not depend on the data, within [typical, worst] for sampling on shards."""
    by = {(r["design"], r["mode"]): r for r in rows}
    for r in rows:
        assert r["planner_agrees"], r
        assert r["predicted"] <= r["measured"] <= r["predicted_worst"], r
        assert r["collectives_predicted"] <= r["collectives"] <= r["collectives_worst"], r
        if r["predicted"] == r["predicted_worst"]:
            assert r["measured"] == r["predicted"], r
        if r["collectives_predicted"] == r["collectives_worst"]:
            assert r["collectives"] == r["collectives_predicted"], r
    # only sampling on shards depends on the data
    ranged = {key for key, r in by.items() if r["predicted_worst"] > r["predicted"]}
    sharded_sampling = {("vocabpar-sharded", "sampled"), ("vocabpar-sharded", "spec-sampled")}
    assert ranged == (set() if ranks == 1 else sharded_sampling)
    calls = {key: r["collectives"] for key, r in by.items()}
    if ranks == 1:  # nothing crosses ranks
        assert set(calls.values()) == {0} and all(r["measured"] == r["predicted_worst"] == 0 for r in rows)
        return
    for mode in ("greedy", "sampled"):
        assert calls["deepinfer-replicated", mode] == 0 and by["deepinfer-replicated", mode]["measured"] == 0
        assert calls["vllm-all-gather", mode] == 2  # embedding all-reduce, logits all-gather
        assert calls["vllm-gather", mode] == 3  # ... and the broadcast of the ids
        assert calls["sglang-dp-gather-scatter", mode] == 5  # + row counts, hidden rows, ids
    # sampling on shards: the embedding exchange and one all-gather, typical for the demo's
    # parameters (top-k 200 within the candidates settles top-p), as for greedy
    assert calls["vocabpar-sharded", "greedy"] == calls["vocabpar-sharded", "sampled"] == 2
    assert by["vocabpar-sharded", "sampled"]["measured"] == by["vocabpar-sharded", "sampled"]["predicted"]
    # a greedy speculative step: the embedding exchange of the fed ids, one all-gather verifying
    # every (row, position); gather-then-verify moves the B·(k+1) full rows
    assert calls["vocabpar-sharded", "spec-greedy"] == 2
    spec = {name: by[name, "spec-greedy"]["measured"] for name in ("vocabpar-sharded", "vllm-all-gather")}
    assert spec["vocabpar-sharded"] < spec["vllm-all-gather"] / 100


def test_measured_traffic_agrees_with_the_planner(demo):
    _, data = demo
    _check_against_the_planner(data["rows"], data["ranks"])
    assert data["planner_agrees"]


GROUPS = ([0], [1, 2, 3], [4, 5, 6, 7])  # 1, 3 and 4 ranks side by side, then all 8 together


def _demo_in_groups(model: str, prompts: list[list[int]], tokens: int):
    """This rank's demo runs in its group of ``GROUPS``, then on the whole world (8 ranks)."""
    import torch.distributed as dist

    from vocabpar import comm
    from vocabpar.demo import rank_main

    groups = [dist.new_group(ranks) for ranks in GROUPS]  # every rank creates every group
    mine = next(g for g, ranks in zip(groups, GROUPS) if comm.rank() in ranks)
    return rank_main(model, prompts, tokens, False, group=mine), rank_main(model, prompts, tokens, False)


@pytest.fixture(scope="module")
def in_groups():
    """The demo on the untied llama model at 1, 3, 4 and 8 ranks, in one launch."""
    from vocabpar.demo import compare, reference
    from vocabpar.launch import run

    ref = reference("llama", 3, 3)
    # generous collective timeout: the world's first collective waits for the slowest group
    per_rank = run(_demo_in_groups, 8, "llama", ref.prompts, 3, timeout=300)
    results = {len(g): compare(ref, [per_rank[r][0] for r in g], len(g)) for g in GROUPS}
    return results | {8: compare(ref, [runs for _, runs in per_rank], 8)}


@pytest.mark.parametrize("ranks", [1, 3, 4, 8])
def test_measured_traffic_agrees_with_the_planner_at_any_rank_count(in_groups, ranks):
    """The 2-rank run above, and here 1, 3, 4 and 8 ranks: the reference tokens, and bytes and
    collectives of every design and mode within the planner's prediction."""
    result = in_groups[ranks]
    assert result.tokens_agree and result.ranks == ranks
    _check_against_the_planner(result.to_json()["rows"], ranks)


def test_bench_runs_each_script_and_reports_failures(tmp_path, capfd):
    from vocabpar.cli import main

    (tmp_path / "bench_a.py").write_text("print('table a')\n")
    (tmp_path / "bench_b.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "helper.py").write_text("raise SystemExit('not a benchmark')\n")
    assert main(["bench", "--dir", str(tmp_path), "--only", "a"]) == 0
    assert "table a" in capfd.readouterr().out
    assert main(["bench", "--dir", str(tmp_path)]) == 1
    assert "failed: bench_b.py" in capfd.readouterr().err
    assert main(["bench", "--dir", str(tmp_path), "--only", "c"]) == 2


def test_bench_writes_report_and_plots_the_demo_data(tmp_path, demo):
    from vocabpar.cli import main
    from vocabpar.demo import DemoResult, Row
    from vocabpar.plots import plot_demo

    (tmp_path / "bench_a.py").write_text("print('| a | 1 |')\n")
    out = tmp_path / "report.md"
    assert main(["bench", "--dir", str(tmp_path), "--out", str(out)]) == 0
    assert "| a | 1 |" in out.read_text() and "bench_a.py" in out.read_text()
    _, data = demo  # the measured rows of the demo run above, plotted
    fields = {f for f in Row.__dataclass_fields__}
    rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in data["rows"]]
    result = DemoResult(**{k: data[k] for k in DemoResult.__dataclass_fields__ if k != "rows"}, rows=rows)
    for name in ("demo", "demo.png"):  # the path written comes back: ".png" added when missing
        assert plot_demo(result, str(tmp_path / name)) == str(tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_a.py", "demo.png", "report.md"]
