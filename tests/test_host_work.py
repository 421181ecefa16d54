"""The planner's measured launch and host-read tables (src/vocabpar/plan/host_work.json, written by
scripts/count_launches.py) still describe vocabpar's code paths: a sample of the entries is counted
again on real gloo ranks (tests/host_probe.py) and compared with the file.

The compiled engine programs (the graph-mode tables): greedy's ``sample`` and ``verify`` are
compiled again on two ranks and compared with the same tolerance; every entry meets the kernel
budget the compiled step is held to.

The sample: greedy and three sampled keys that between them take every branch kind (top-k off,
within round one's candidates and a threshold search; top-p, min-p and top-n-sigma on and off), for the
functional sampler and verifier and the engine Sampler's sample and verify, on peaked rows
(typical) and on peaked, flat, Zipf and tied rows (worst); scoring and every collection strategy at
two and three ranks.

Tolerance: launches within 10 % or 3 launches of the file, whichever is larger; host reads exactly.
A launch is priced at a few microseconds, so a few launches more or fewer (an op added or fused
away, a torch release decomposing an op differently) move a step's price by less than one host
read; a real change to a path (a pass added or removed, a branch taken differently) moves tens of
launches. A host read is a synchronisation priced at ~20 us and decides whether a step can run as
a CUDA graph, and a changed count is always a changed path: reads must match exactly. When this
fails, regenerate the file with ``python scripts/count_launches.py``.
"""

import json

import host_probe
import pytest

from vocabpar.launch import run
from vocabpar.plan import DESIGNS, host
from vocabpar.wire import filters

SAMPLE = ("greedy", "min_p+top_n_sigma", "top_k=candidates+top_p", "top_k=search+top_p+min_p")
"""Greedy, and sampled keys that cover each top-k state, top-p, min-p and top-n-sigma on and off."""
WIDER = ("greedy", "top_k=candidates+top_p")
"""Keys measured again at another batch and world size."""


def close(measured: int, recorded: int) -> bool:
    """Launch counts agree: within 10 % or 3 launches, whichever is larger."""
    return abs(measured - recorded) <= max(3, 0.1 * recorded)


def agrees(measured: list[int] | tuple[int, ...], recorded: list[int] | tuple[int, ...]) -> bool:
    """``[launches, reads, ...]`` pairs agree: launches ``close``, reads equal."""
    return len(measured) == len(recorded) and all(
        close(m, r) if i % 2 == 0 else m == r for i, (m, r) in enumerate(zip(measured, recorded)))


@pytest.fixture(scope="module")
def two_ranks():
    return run(host_probe.measure, 2, host_probe.B, keys=SAMPLE, timeout=300, run_timeout=600)


@pytest.fixture(scope="module")
def three_ranks():
    return run(host_probe.measure, 3, 7, ("sample", "score", "collect"), WIDER, timeout=300, run_timeout=600)


def test_the_file_holds_every_entry_and_says_how_it_was_counted():
    data = host.load(host.DATA)
    assert {"torch", "command", "date", "compiled_date", "counting"} <= set(data["header"])
    assert "count_launches.py" in data["header"]["command"]
    names = list(filters.keys())
    verify_names = [host.verify_name(key, d) for key in names for d in (False, True)]
    for sampler in ("functional", "engine"):
        assert set(data[sampler]) == set(names), sampler
        assert set(data[f"{sampler}_verify"]) == set(verify_names), sampler
    assert set(data["score"]) == {host.score_name(0), host.score_name(5)}
    assert {d.strategy for d in DESIGNS} | {"none"} == set(data["collect"])
    assert set(data["engine_graph"]) == set(names) and set(data["engine_graph_verify"]) == set(verify_names)
    for table in host.MEASURED:
        for name, numbers in data[table].items():
            width = 3 if table in ("score", "collect") else 1 if table.startswith("engine_graph") else 4
            assert len(numbers) == width, (table, name)
            assert all(isinstance(n, int) and n >= 0 for n in numbers), (table, name)


def test_the_tolerance_is_3_launches_or_10_percent_and_reads_exact():
    assert agrees([104, 16, 104, 16], [101, 16, 107, 16]) and agrees([13, 2], [10, 2])
    assert not agrees([14, 2], [10, 2])
    assert agrees([440, 50], [400, 50]) and not agrees([441, 50], [400, 50])
    assert not agrees([104, 17, 104, 16], [104, 16, 104, 16]) and not agrees([104, 16], [104, 16, 104, 16])


def test_collection_is_fitted_per_rank_and_reads_that_grow_with_the_ranks_are_refused():
    def ranks(collect: dict) -> list[dict]:
        return [{"sample": {}, "verify": {}, "engine": {}, "score": {}, "collect": collect}]

    fitted = host_probe.tables(ranks({"gather": (8, 1), "all_gather_ids": (0, 0)}),
                               ranks({"gather": (10, 1)}))
    assert fitted["collect"] == {"gather": [4, 2, 1]}
    with pytest.raises(ValueError, match="collect 'gather' reads 1 times on two ranks, 2 on three"):
        host_probe.tables(ranks({"gather": (8, 1)}), ranks({"gather": (10, 2)}))


def test_a_recount_of_the_sampler_entries_agrees_with_the_file(two_ranks, three_ranks):
    recount = host_probe.tables(two_ranks, three_ranks)
    compared = 0
    for table in ("functional", "functional_verify", "engine", "engine_verify"):
        for name, measured in recount[table].items():
            recorded = host.entry(table, name)
            assert agrees(measured, recorded), \
                f"{table} {name}: counted {measured}, the file says {recorded}: rerun `{host.REGENERATE}`"
            compared += 1
    assert compared == 2 * (len(SAMPLE) + 2 * len(SAMPLE) - 1)  # sample and verify, greedy without drafts


@pytest.mark.parametrize("ranks", [2, 3])
def test_scoring_and_collection_are_priced_as_measured(ranks, two_ranks, three_ranks):
    measured = two_ranks if ranks == 2 else three_ranks
    for top_n in (0, 5):
        work = host.score_work("functional", top_n, ranks, 1)
        measured_work = host_probe.busiest(measured, "score", top_n)
        assert agrees(measured_work, (work.launches, work.reads)), (top_n, measured_work, work)
    for strategy in ("all_gather", "gather", "all_to_all", "dp_gather_scatter", "none", "replicated"):
        work = host.collect_work(strategy, ranks)
        measured_work = host_probe.busiest(measured, "collect", strategy)
        assert agrees(measured_work, (work.launches, work.reads)), (strategy, measured_work, work)
    for ids in ("broadcast_ids", "all_gather_ids"):  # the collective alone
        assert host_probe.busiest(measured, "collect", ids) == (0, 0)


def test_counts_do_not_depend_on_the_batch(two_ranks, three_ranks):
    """The functional sampler's counts per call at 4 rows and 2 ranks equal those at 7 rows and 3
    ranks."""
    for key in WIDER:
        assert host_probe.busiest(three_ranks, "sample", (key, "peaked")) == \
            host_probe.busiest(two_ranks, "sample", (key, "peaked")), key


def test_the_engine_sampler_runs_one_script_whatever_the_logits(two_ranks):
    """The engine Sampler launches the same ops whatever the logits (a fixed script; ATen may
    add one copy on some inputs) and reads nothing on the host: the one read the planner charges
    it per step is the copy of its ids, which every design makes."""
    for key in SAMPLE:
        for draft in [()] + ([] if key == "greedy" else [(False,), (True,)]):
            seen = [host_probe.busiest(two_ranks, "engine", (key, *draft, family))
                    for family in host_probe.families()]
            assert max(s[0] for s in seen) - min(s[0] for s in seen) <= 1, (key, draft, seen)
            assert all(s[1] == 0 for s in seen), (key, draft, seen)
        assert host.sampler_work("engine", key).reads == 0 and host.IDS_TO_HOST.reads == 1
    with pytest.raises(ValueError, match="unknown sampler 'magic'"):
        host.sampler_work("magic", "greedy")


def test_a_missing_entry_or_file_names_it_and_the_script(tmp_path, monkeypatch):
    data = host.load(host.DATA)
    lacking = {**data, "engine": {n: v for n, v in data["engine"].items() if n != "top_k=search+min_p"}}
    partial = tmp_path / "host_work.json"
    partial.write_text(json.dumps(lacking))
    monkeypatch.setattr(host, "DATA", partial)
    assert host.sampler_work("engine", "temperature") == host.HostWork(*data["engine"]["temperature"])
    with pytest.raises(LookupError, match=r"no 'engine' entry 'top_k=search\+min_p'.*count_launches\.py"):
        host.sampler_work("engine", "top_k=search+min_p")
    monkeypatch.setattr(host, "DATA", tmp_path / "absent.json")
    with pytest.raises(FileNotFoundError, match=r"absent\.json.*count_launches\.py"):
        host.collect_work("gather", 2)
    no_score = tmp_path / "no_score.json"
    no_score.write_text(json.dumps({k: v for k, v in data.items() if k != "score"}))
    monkeypatch.setattr(host, "DATA", no_score)
    with pytest.raises(ValueError, match=r"lacks the table\(s\) score.*count_launches\.py"):
        host.score_work("functional", 0, 2, 1)


def test_the_one_read_an_engine_step_makes_is_the_copy_of_its_ids():
    """What the planner charges every design per step (``host.IDS_TO_HOST``) is what the engine
    Sampler's step reads: sampling reads nothing, ``to_host()`` copies the ids and the flags at
    once, and checking that copy reads nothing more (one process, measured with the counter)."""
    import torch

    from vocabpar import VocabLayout
    from vocabpar.host_reads import counting
    from vocabpar.sampling import Sampler

    layout, B = VocabLayout(host_probe.V, 1), host_probe.B
    sampler = Sampler(layout, max_rows=B, check=False)
    local = host_probe._shard(host_probe.families()["peaked"], layout)
    for key in ("greedy", "top_p+min_p"):
        batch = sampler.prepare(host_probe.params(key, B), positions=torch.arange(B))
        with counting() as sampling:
            out = sampler.sample(local, batch)
        with counting() as copying:
            copied = out.to_host()
        with counting() as checking:
            copied.raise_if_failed()
        reads = [sum(c.values()) for c in (sampling, copying, checking)]
        assert reads == [0, host.IDS_TO_HOST.reads, 0], (key, reads)


BUDGET = {"greedy": 10, "top_k=candidates+top_p+min_p": 30}
"""Kernels per compiled call: greedy 10, the certified sampled plan 30, any other sampled plan
(the searches) and a plan with top-5 logprobs 48, ``verify`` 60."""


def test_the_compiled_engine_step_meets_its_kernel_budget():
    data = host.load(host.DATA)
    for name, (kernels,) in data["engine_graph"].items():
        assert kernels <= BUDGET.get(name, 48), (name, kernels)
    for name, (kernels,) in data["engine_graph_verify"].items():
        assert kernels <= 60, (name, kernels)
    assert set(data["engine_graph_score"]) == {"sample+logprobs", "token_logprobs+top_n"}
    scores = data["engine_graph_score"]
    assert all(kernels <= 48 for (kernels,) in scores.values()), scores
    for key in filters.keys():  # graph mode prices these kernels and no host read
        eager = host.sampler_work("engine", key)
        compiled = host.sampler_work("engine", key, compiled=True)
        assert compiled.reads == 0 and compiled.launches == data["engine_graph"][key][0] < eager.launches
        verify = host.verify_work("engine", key, True, compiled=True)
        assert verify.launches == data["engine_graph_verify"][host.verify_name(key, True)][0]


def test_a_recount_of_the_compiled_greedy_step_agrees_with_the_file():
    ranks = run(host_probe.measure_compiled, 2, host_probe.B, ("greedy",), timeout=300, run_timeout=600)
    for entry, table in (("greedy", "engine_graph"), (("greedy", False), "engine_graph_verify")):
        measured = max(rank["engine"][entry] for rank in ranks)
        recorded = host.entry(table, "greedy")[0]
        assert close(measured, recorded), (f"{table} greedy: counted {measured}, the file says {recorded}: "
                                           f"rerun `{host.REGENERATE} --compiled`")


def test_the_counting_script_compiles_only_the_keys_the_tables_lack_or_it_is_asked_to(tmp_path, monkeypatch,
                                                                                       capsys):
    """Without ``--compiled`` the script keeps the file's compiled tables, drops the names no key
    takes any more and compiles the keys whose sample or verify entries they lack (a filter added
    since) and those ``--recount`` names -- and only those, without the scoring programs; the
    eager tables are measured again (stood in for here: each is a minute of gloo ranks). A
    ``--recount`` of an unknown key, or beside ``--compiled``, is refused."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "count_launches.py"
    spec = importlib.util.spec_from_file_location("count_launches", script)
    counting = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counting)
    data = host.load(host.DATA)
    dropped = ("top_n_sigma", "top_k=search+top_p+top_n_sigma")  # the second one's verify entry only
    kept = {**data, "engine_graph": {k: v for k, v in data["engine_graph"].items() if k != dropped[0]},
            "engine_graph_verify": {**{k: v for k, v in data["engine_graph_verify"].items()
                                       if k != host.verify_name(dropped[1], True)}, "top_k=none": [1]}}
    out = tmp_path / "host_work.json"
    out.write_text(json.dumps(kept))
    asked = []

    def compiled_tables(keys, scores=True):
        asked.append((keys, scores))
        return {"engine_graph": {key: [99] for key in keys}, "engine_graph_verify": {},
                "engine_graph_score": {}}

    monkeypatch.setattr(counting, "compiled_tables", compiled_tables)
    monkeypatch.setattr(counting, "measure",
                        lambda compiled, date: {"header": {"compiled_date": date}, **compiled})
    assert counting.main(["--out", str(out)]) == 0
    assert asked == [(dropped, False)]
    written = json.loads(out.read_text())
    assert written["engine_graph"] == {**kept["engine_graph"], **{key: [99] for key in dropped}}
    assert "top_k=none" not in written["engine_graph_verify"]  # a name no key takes any more
    assert written["header"]["compiled_date"].startswith(data["header"]["compiled_date"] + "; 2 keys at ")
    assert "compiling the 2 keys asked for or lacking: top_n_sigma, top_k=search+top_p+top_n_sigma" in \
        capsys.readouterr().out
    asked.clear()
    out.write_text(json.dumps(data))
    assert counting.main(["--out", str(out)]) == 0 and asked == []  # nothing lacking: nothing compiled
    # --recount: the keys a change touched, counted again; the others kept
    out.write_text(json.dumps(data))
    assert counting.main(["--out", str(out), "--recount", "top_p", "temperature"]) == 0
    assert asked == [(("temperature", "top_p"), False)]
    assert json.loads(out.read_text())["engine_graph"]["top_k=search"] == data["engine_graph"]["top_k=search"]
    for bad in (["--recount", "top_q"], ["--compiled", "--recount", "top_p"]):
        with pytest.raises(SystemExit):
            counting.main(["--out", str(out), *bad])
        assert "--recount takes sampler keys" in capsys.readouterr().err
