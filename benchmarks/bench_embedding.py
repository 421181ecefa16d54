"""Embedding benchmark: 4 gloo ranks, T=8192, H=1024, V=129280, bf16.

Prints, side by side from one run: fused local lookup vs an unfused mask/offset/gather/fill
sequence and vs plain F.embedding on a full table (the floor); all-reduce vs owner-gather
exchange (wall time, exact bytes per rank) on uniform and Zipf-skewed ids; and PyTorch DTensor's
RowwiseParallel embedding on the same inputs.

    .venv/bin/python benchmarks/bench_embedding.py [--ranks 4] [--tokens 8192] [--reps 10] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import QUICK_HELP, bottom_line, bytes_of, factor, fmt_bytes, ms, over, show, sized, table, timed  # noqa: E402

from vocabpar import VocabLayout, VocabParallelEmbedding, comm  # noqa: E402
from vocabpar.launch import run  # noqa: E402

V, H = sized((129280, 1024), (8192, 256))


def make_ids(kind: str, tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if kind == "uniform":
        return torch.randint(0, V, (tokens,), generator=g)
    weights = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** 1.1  # frequent tokens have low ids
    return torch.multinomial(weights, tokens, replacement=True, generator=g)


def bench(tokens: int, reps: int) -> dict:
    n, me = comm.world_size(), comm.rank()
    layout = VocabLayout(V, n)
    table = (torch.randn(V, H, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    results: dict = {}
    emb = {mode: VocabParallelEmbedding(layout, H, dtype=torch.bfloat16, exchange=mode)
           for mode in ("all_reduce", "owner_gather", "auto")}
    for module in emb.values():
        module.load_full_weight(table)
    shard = emb["all_reduce"]
    s = shard.shard
    ids = make_ids("uniform", tokens)

    def unfused():
        mask = (ids >= s.org_start) & (ids < s.org_end)
        local = ids - s.org_start
        local = local.masked_fill(~mask, 0)
        out = F.embedding(local, shard.weight)
        return out.masked_fill(~mask[:, None], 0)

    full_ids = ids.clone()
    results["local"] = {
        "fused": timed(lambda: shard.local_rows(ids), reps, sync=False),
        "unfused": timed(unfused, reps, sync=False),
        "F.embedding (full table)": timed(lambda: F.embedding(full_ids, table), reps, sync=False),
    }
    assert torch.equal(shard.unpack_rows(shard.local_rows(ids)), unfused())
    results["exchange"] = {}
    for kind in ("uniform", "zipf"):
        kind_ids = make_ids(kind, tokens)
        owned = torch.bincount(layout.owner(kind_ids), minlength=n).tolist()
        row = {"owned": owned}
        for mode, module in emb.items():
            step = lambda m=module, i=kind_ids: m(i)
            row[mode] = (timed(step, reps), bytes_of(step), module.last_exchange)
        row["dtensor"] = (_dtensor(table, kind_ids, reps))
        results["exchange"][kind] = row
    return results if me == 0 else {}


def _dtensor(table: torch.Tensor, ids: torch.Tensor, reps: int):
    """PyTorch's own vocab-parallel embedding: DTensor RowwiseParallel over a CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (comm.world_size(),))
    module = torch.nn.Embedding(V, H, dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(table)
    module = parallelize_module(module, mesh, RowwiseParallel(input_layouts=Replicate(),
                                                              output_layouts=Replicate()))
    with torch.no_grad():
        ok = torch.equal(module(ids), F.embedding(ids, table))
        seconds = timed(lambda: module(ids), reps)
    return seconds, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=sized(4, 2))
    parser.add_argument("--tokens", type=int, default=sized(8192, 1024))
    parser.add_argument("--reps", type=int, default=sized(10, 2))
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = parser.parse_args()
    res = run(bench, args.ranks, args.tokens, args.reps, timeout=600, run_timeout=1800)[0]
    local = res["local"]
    show(f"### Embedding: {args.ranks} gloo ranks, T={args.tokens}, H={H}, V={V}, bf16")
    table(["local step (rank 0)", "ms", "vs fused"],
          [[name, ms(sec, 2), over(sec, local["fused"], 2)] for name, sec in local.items()])
    show(f"fused is {over(local['unfused'], local['fused'], 2)} faster than unfused; "
         f"{over(local['fused'], local['F.embedding (full table)'], 2)} the F.embedding floor")
    for kind, row in res["exchange"].items():
        ar = row["all_reduce"][0]
        show(f"\n{kind} ids (tokens owned per rank: {row['owned']})")
        rows = []
        for mode in ("all_reduce", "owner_gather", "auto"):
            sec, (sent, recv), chose = row[mode]
            rows.append([mode, ms(sec, 2), over(ar, sec, 2), fmt_bytes(sent), fmt_bytes(recv), chose])
        dsec, ok = row["dtensor"]
        rows.append(["DTensor RowwiseParallel", ms(dsec, 2), over(ar, dsec, 2), "", "", f"exact={ok}"])
        table(["exchange", "ms", "vs all_reduce", "sent / rank 0", "received / rank 0", "chose"], rows)
        best = min(row[m][0] for m in ("all_reduce", "owner_gather", "auto"))
        show(f"vocabpar auto is {factor(row['auto'][0], dsec)} than DTensor (best mode {factor(best, dsec)})")
    uniform = res["exchange"]["uniform"]
    (ar, (ar_sent, _), _), (og, (og_sent, _), _) = uniform["all_reduce"], uniform["owner_gather"]
    bottom_line(f"fused lookup {factor(local['fused'], local['unfused'])} than unfused; on uniform ids "
                f"owner-gather sends {factor(og_sent, ar_sent, 'fewer bytes', 'more bytes')} than all-reduce "
                f"({factor(og, ar)}), auto is {factor(uniform['auto'][0], uniform['dtensor'][0])} than "
                f"DTensor RowwiseParallel")

if __name__ == "__main__":
    main()
