import itertools
import time

import pytest
import torch
import torch.nn.functional as F

from vocabpar import VocabLayout, comm
from vocabpar.embedding import VocabParallelEmbedding, exchange_costs
from vocabpar.launch import LaunchError, run
from vocabpar.weights import dequantize_rows, quantize_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
# (vocab, org_vocab, dim): divisible and not, added vocab, tiny vocab with empty uneven shards
SHAPES = [(50257, None, 12), (32001, 31990, 8), (1293, None, 7), (1026, 1010, 16), (5, None, 4)]


def full_table(vocab, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(vocab, dim, generator=g) * 3
    t[::7, 0] = -0.0  # signed zeros must survive the exchange bit for bit
    return t.to(dtype)


def reference_lookup(table, ids):
    """F.embedding on the full table; fp8 tables (no CPU kernel) by byte rows."""
    if table.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return table.view(torch.uint8)[ids].view(table.dtype)
    return F.embedding(ids, table)


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _exactness_sweep():
    """Each exchange's bits against the full table over shapes, schemes and dtypes; the agreement
    check is off (test_agreement covers it), so every collective here is the exchange itself."""
    n = comm.world_size()
    failures, modes = [], set()
    for (vocab, org, dim), scheme, dtype in itertools.product(SHAPES, ("padded", "uneven", "replicated"),
                                                             DTYPES):
        layout = VocabLayout(vocab, n, org_vocab_size=org, scheme=scheme)
        table = full_table(vocab, dim, dtype)
        g = torch.Generator().manual_seed(vocab + n)
        for exchange, shape in (("all_reduce", (3, 17)), ("owner_gather", (40,)), ("auto", (2, 3, 5)),
                                ("auto", (0,))):
            emb = VocabParallelEmbedding(layout, dim, dtype=dtype, exchange=exchange, check=False)
            emb.load_full_weight(table)
            ids = torch.randint(0, vocab, shape, generator=g)
            got = emb(ids)
            modes.add(emb.last_exchange)
            if not same_bits(got, reference_lookup(table, ids)):
                failures.append((vocab, scheme, str(dtype), exchange, shape))
    return failures, sorted(modes)


@pytest.mark.exact
@pytest.mark.parametrize("n", [pytest.param(n, marks=pytest.mark.once) for n in (1, 2)] + [3, 4])
def test_bit_exact_against_full_table(n):
    for failures, modes in run(_exactness_sweep, n, timeout=120):
        assert failures == []
        if n > 1:
            assert {"all_reduce", "owner_gather", "local"} <= set(modes)


def _special_cases():
    n, r = comm.world_size(), comm.rank()
    out = {}
    layout = VocabLayout(1000, n, org_vocab_size=990)
    table = full_table(1000, 16, torch.bfloat16)
    # out-of-range ids become zero rows in "zero" mode, both exchanges
    ids = torch.tensor([[5, -1, 999], [1000, 990, 123456]])
    expect = reference_lookup(table, ids.clamp(0, 999))
    expect[(ids < 0) | (ids >= 1000)] = 0
    for exchange in ("all_reduce", "owner_gather"):
        emb = VocabParallelEmbedding(layout, 16, dtype=torch.bfloat16, exchange=exchange, oob="zero")
        emb.load_full_weight(table)
        out[f"zero_{exchange}"] = same_bits(emb(ids), expect)
    # "error" mode names count and positions, on every rank, before any collective
    emb = VocabParallelEmbedding(layout, 16, dtype=torch.bfloat16)
    emb.load_full_weight(table)
    for bad, name in ((ids, "oob"), (ids.float(), "float"), (ids.to(torch.int16), "int16"), ([1, 2], "list")):
        try:
            emb(bad)
            out[name] = "no error"
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    # the module still works after rejected input
    ok_ids = torch.tensor([0, 999, 500])
    out["after_errors"] = same_bits(emb(ok_ids), reference_lookup(table, ok_ids))
    # quantized tables: equal to dequantizing the full table, then looking up
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        for scheme in ("padded", "uneven", "replicated"):
            qlayout = VocabLayout(1000, n, org_vocab_size=990, scheme=scheme)
            float_table = full_table(1000, 10, torch.float32)
            q, scale = quantize_rows(float_table, qdtype)
            for exchange in ("all_reduce", "owner_gather"):  # scales travel with the rows in both
                emb = VocabParallelEmbedding(qlayout, 10, dtype=qdtype, quantized=True,
                                             compute_dtype=torch.bfloat16, exchange=exchange)
                emb.load_full_weight(q, scale)
                ids = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(1))
                ref = F.embedding(ids, dequantize_rows(q, scale, torch.bfloat16))
                out[f"quant_{qdtype}_{scheme}_{exchange}"] = same_bits(emb(ids), ref)
            odd = VocabParallelEmbedding(qlayout, 3, dtype=qdtype, quantized=True)  # 3 B rows + 4 B scale
            odd.load_full_weight(float_table[:, :3])
            empty = odd(torch.empty(2, 0, dtype=torch.long))
            out[f"quant_empty_{qdtype}_{scheme}"] = empty.shape == (2, 0, 3)
            q3, scale3 = quantize_rows(float_table[:, :3], qdtype)
            for ids in (torch.tensor([5]), torch.tensor([999, 5])):  # one row: scale bytes at offset 3
                want = F.embedding(ids, dequantize_rows(q3, scale3, torch.bfloat16))
                out[f"quant_odd_{qdtype}_{scheme}_{ids.numel()}"] = same_bits(odd(ids), want)
    # replicated scheme: no collective at all
    comm.reset_traffic()
    emb = VocabParallelEmbedding(VocabLayout(1000, n, scheme="replicated"), 16, dtype=torch.bfloat16)
    emb.load_full_weight(table)
    emb(torch.arange(1000))
    out["replicated_traffic"] = comm.total_bytes()
    # byte counts of the two exchanges match their cost model (balanced ids, 16 bf16 = 32 B rows)
    emb = VocabParallelEmbedding(VocabLayout(1024, n, pad_to=1), 16, dtype=torch.bfloat16,
                                 exchange="owner_gather")
    emb.load_full_weight(full_table(1024, 16, torch.bfloat16))
    comm.reset_traffic()
    emb(torch.arange(1024))
    out["owner_gather_bytes"] = comm.total_bytes()
    # strided storage: the rows live in a row-padded buffer and are used in place
    out["strided"] = (VocabParallelEmbedding(layout, 7, dtype=torch.float16).table.stride(0), r)
    return out


@pytest.fixture(scope="module", params=[1, 3])
def special(request):
    """One launch per world size shared by the named checks below."""
    return request.param, run(_special_cases, request.param)


def test_out_of_range_ids_become_zero_rows_in_zero_mode(special):
    assert all(out["zero_all_reduce"] and out["zero_owner_gather"] for out in special[1])


def test_error_mode_names_count_and_positions(special):
    for out in special[1]:
        assert out["oob"].startswith("ValueError: 3 token id(s) outside [0, 1000)")
        assert "(0, 1)=-1" in out["oob"] and "(1, 0)=1000" in out["oob"] and "(1, 2)=123456" in out["oob"]


def test_non_integer_ids_are_type_errors_and_state_survives(special):
    for out in special[1]:
        assert out["float"].startswith("TypeError: ids must be int32 or int64")
        assert out["int16"].startswith("TypeError") and out["list"].startswith("TypeError")
        assert out["after_errors"]


def test_quantized_tables_equal_dequantize_then_lookup(special):
    for out in special[1]:
        quant = {k: v for k, v in out.items() if k.startswith("quant_")}
        assert quant and all(quant.values()), quant


def test_replicated_scheme_sends_nothing(special):
    assert all(out["replicated_traffic"] == (0, 0) for out in special[1])


def test_owner_gather_bytes_match_cost_model(special):
    n, outs = special
    largest = max(s.num_org for s in VocabLayout(1024, n, pad_to=1).shards)
    assert all(out["owner_gather_bytes"] == ((n - 1) * largest * 32,) * 2 for out in outs)


def test_rows_are_stored_strided(special):
    assert all(out["strided"][0] == 16 for out in special[1])  # 7 fp16 = 14 B rows stored 32 B apart


def _mismatched(vocab_by_rank):
    layout = VocabLayout(vocab_by_rank[comm.rank()], comm.world_size())
    VocabParallelEmbedding(layout, 8)


def test_mismatched_configs_fail_on_every_rank():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run(_mismatched, 3, [100, 100, 101], timeout=20)
    assert time.monotonic() - start < 15
    assert sorted(info.value.failures) == [0, 1, 2]
    assert all("vocab_size" in why and "rank 2 has 101" in why for why in info.value.failures.values())


def test_local_construction_errors():
    layout = VocabLayout(100, 1)
    with pytest.raises(ValueError, match="exchange must be one of"):
        VocabParallelEmbedding(layout, 8, exchange="ring")
    with pytest.raises(ValueError, match="oob must be one of"):
        VocabParallelEmbedding(layout, 8, oob="clip")
    with pytest.raises(ValueError, match="layout is for 2 ranks but the world group has 1"):
        VocabParallelEmbedding(VocabLayout(100, 2), 8)
    with pytest.raises(ValueError, match="dim must be a positive int"):
        VocabParallelEmbedding(layout, 0)
    with pytest.raises(ValueError, match="quantized tables are stored as one of"):
        VocabParallelEmbedding(layout, 8, dtype=torch.bfloat16, quantized=True)
    emb = VocabParallelEmbedding(layout, 8)
    with pytest.raises(ValueError, match=r"expected shape \(100, 8\), found \(99, 8\)"):
        emb.load_full_weight(torch.zeros(99, 8))
    with pytest.raises(ValueError, match="scales given for an unquantized table"):
        emb.load_full_weight(torch.zeros(100, 8), torch.ones(100))
    quantized = VocabParallelEmbedding(layout, 8, dtype=torch.int8, quantized=True)
    with pytest.raises(ValueError, match="rows given with scales must already be torch.int8"):
        quantized.load_full_weight(torch.full((100, 8), 0.7), torch.full((100,), 0.01))
    with pytest.raises(ValueError, match="need their per-row scales"):
        quantized.load_full_weight(torch.zeros(100, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"expected shape \(100,\)"):
        quantized.load_full_weight(torch.zeros(100, 8, dtype=torch.int8), torch.ones(99))
    for bad in (float("nan"), float("inf")):
        weight = torch.ones(100, 8)
        weight[42, 3] = bad
        with pytest.raises(ValueError, match="cannot quantize: row 42 holds non-finite values"):
            quantized.load_full_weight(weight)


def test_safetensors_loading_reads_only_own_rows(tmp_path):
    from safetensors.torch import save_file

    table = full_table(1026, 6, torch.bfloat16)
    path = str(tmp_path / "emb.safetensors")
    save_file({"embed": table}, path)
    layout = VocabLayout(1026, 1, org_vocab_size=1010)
    emb = VocabParallelEmbedding(layout, 6, dtype=torch.bfloat16)
    emb.load_safetensors(path, "embed")
    ids = torch.arange(1026)
    assert same_bits(emb(ids), table)
    with pytest.raises(KeyError, match="'missing' not in"):
        emb.load_safetensors(path, "missing")
    save_file({"embed": table[:1000]}, path)
    with pytest.raises(ValueError, match="expected shape") as info:
        emb.load_safetensors(path, "embed")
    assert path in str(info.value)
    missing = str(tmp_path / "nowhere.safetensors")
    with pytest.raises(ValueError, match=f"cannot read safetensors file {missing}"):
        emb.load_safetensors(missing, "embed")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=f"cannot read safetensors file {corrupt}"):
        emb.load_safetensors(str(corrupt), "embed")
    quantized = VocabParallelEmbedding(layout, 6, dtype=torch.int8, quantized=True)
    with pytest.raises(KeyError, match=f"'no_scale' not in {path}"):
        quantized.load_safetensors(path, "embed", scale_name="no_scale")


def test_exchange_cost_model_prefers_all_reduce_under_skew():
    balanced = exchange_costs([256, 256, 256, 256], 1024)
    assert balanced["owner_gather"] == 768 < balanced["all_reduce"] == 1536
    skewed = exchange_costs([700, 200, 100, 24], 1024)
    assert skewed["owner_gather"] == 2100 > skewed["all_reduce"]
    assert exchange_costs([1024], 1024) == {"all_reduce": 0, "owner_gather": 0}


def test_exchange_costs_are_the_planners_formula():
    """``auto`` chooses with the planner's byte formula, scaled to rows."""
    from vocabpar.plan.model import embedding_exchange_bytes

    counts, H, b = [700, 200, 100, 24], 64, 2
    for mode, rows in exchange_costs(counts, 1024).items():
        assert embedding_exchange_bytes(mode, 1024, H, 4, b, owned=max(counts)) == round(rows * H * b)
