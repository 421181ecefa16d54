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
from common import QUICK_HELP, bytes_of, fmt_bytes, sized, timed  # noqa: E402

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
    print(f"### Embedding: {args.ranks} gloo ranks, T={args.tokens}, H={H}, V={V}, bf16\n")
    print("| local step (rank 0) | ms | vs fused |\n|---|---|---|")
    for name, sec in local.items():
        print(f"| {name} | {sec * 1e3:.2f} | {sec / local['fused']:.2f}x |")
    print(f"\nfused is {local['unfused'] / local['fused']:.2f}x faster than unfused; "
          f"{local['fused'] / local['F.embedding (full table)']:.2f}x the F.embedding floor\n")
    for kind, row in res["exchange"].items():
        ar = row["all_reduce"][0]
        print(f"**{kind} ids** (tokens owned per rank: {row['owned']})\n")
        print("| exchange | ms | vs all_reduce | sent / rank 0 | received / rank 0 | chose |")
        print("|---|---|---|---|---|---|")
        for mode in ("all_reduce", "owner_gather", "auto"):
            sec, (sent, recv), chose = row[mode]
            print(f"| {mode} | {sec * 1e3:.2f} | {ar / sec:.2f}x | {fmt_bytes(sent)} | {fmt_bytes(recv)} "
                  f"| {chose} |")
        dsec, ok = row["dtensor"]
        best = min(row[m][0] for m in ("all_reduce", "owner_gather", "auto"))
        print(f"| DTensor RowwiseParallel | {dsec * 1e3:.2f} | {ar / dsec:.2f}x | | | exact={ok} |")
        print(f"\nvocabpar auto vs DTensor: {dsec / row['auto'][0]:.2f}x faster "
              f"(best mode {dsec / best:.2f}x)\n")


if __name__ == "__main__":
    main()
