"""One short end-to-end check on the ranks torchrun starts: NCCL on GPUs, gloo on CPUs.

    torchrun --nproc-per-node 2 scripts/smoke_distributed.py

Every rank builds the same seeded tensors on its device, then checks against single-device
references computed on that device: the embedding (bit-exact, every dtype, both exchanges), every
logits collection strategy (deterministic head: bit-exact), and the sharded sampler (tokens equal
``reference_sample``). Rank 0 prints one line per check and the script exits non-zero on any
mismatch. This is the check to run first on a machine with accelerators.
"""

from __future__ import annotations

import sys

import torch

from vocabpar import (
    ParallelLMHead,
    SamplingParams,
    VocabLayout,
    VocabParallelEmbedding,
    comm,
    compute_logits,
    launch,
    reference_logits,
    reference_sample,
    sample,
)


def main() -> int:
    if not launch.under_torchrun():
        print("smoke_distributed.py runs on the ranks torchrun starts: "
              "torchrun --nproc-per-node 2 scripts/smoke_distributed.py", file=sys.stderr)
        return 2
    launch.init(timeout=120)
    n, me = comm.world_size(), comm.rank()
    device = comm.device()
    g = torch.Generator().manual_seed(0)
    results = []

    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        for scheme in ("padded", "uneven"):
            layout = VocabLayout(50257, n, org_vocab_size=50200, scheme=scheme)
            table = torch.randn(50257, 64, generator=g).to(dtype)
            ids = torch.randint(0, 50257, (4, 33), generator=g).to(device)
            want = table.to(device).view(torch.uint8)[ids]
            for exchange in ("all_reduce", "owner_gather"):
                emb = VocabParallelEmbedding(layout, 64, dtype=dtype, exchange=exchange, device=device)
                emb.load_full_weight(table)
                got = emb(ids).view(torch.uint8)
                results.append((f"embedding {dtype} {scheme} {exchange}", torch.equal(got, want)))

    layout = VocabLayout(50257, n, scheme="uneven")
    weight = (torch.randn(50257, 64, generator=g) / 8).to(device)
    hidden = torch.randn(4 * n, 64, generator=g).to(device)
    head = ParallelLMHead(layout, 64, deterministic=True, device=device)
    head.load_full_weight(weight)
    ref = reference_logits(hidden, weight, True)
    rows = slice(me * 4, me * 4 + 4)
    for strategy, want in (("all_gather", ref), ("all_to_all", ref[rows])):
        got = compute_logits(head, hidden, strategy=strategy)
        results.append((f"logits {strategy}", torch.equal(got, want)))
    got = compute_logits(head, hidden[rows], strategy="dp_gather_scatter")
    results.append(("logits dp_gather_scatter", torch.equal(got, ref[rows])))
    got = compute_logits(head, hidden, strategy="gather", dst=0)
    results.append(("logits gather", torch.equal(got, ref) if me == 0 else got is None))

    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=list(range(4 * n)),
                            logprobs=3)
    positions = torch.arange(4 * n, device=device)
    sharded = compute_logits(head, hidden, strategy="none")
    out = sample(sharded.logits, layout, params, positions=positions)
    want = reference_sample(ref, params, positions=positions)
    results.append(("sample tokens", torch.equal(out.tokens, want.tokens)))
    results.append(("sample top ids", torch.equal(out.top_ids, want.top_ids)))

    failed = torch.tensor([not all(passed for _, passed in results)], dtype=torch.int32, device=device)
    failed = bool(comm.all_reduce_max(failed).item())  # any rank failing fails every rank
    if me == 0:
        for name, passed in results:
            print(f"{'ok  ' if passed else 'FAIL'} {name}")
        print(f"{n} ranks on {device}: {'SOME CHECKS FAILED' if failed else 'all checks passed'}")
    launch.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
