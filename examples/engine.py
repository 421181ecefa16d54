"""An inference engine that keeps its LM-head logits vocab-sharded, and samples, verifies and
scores them with vocabpar on its tensor-parallel group.

    torchrun --nproc-per-node 2 examples/engine.py     # one TP group of 2 ranks
    torchrun --nproc-per-node 4 examples/engine.py     # two TP groups of 2 (data parallel over them)

Each rank of a TP group computes only its own columns of the logits, in bf16, as vLLM does with
``skip_gather`` (its ``LogitsProcessor`` then never gathers) or Megatron with
``ColumnParallelLinear(gather_output=False)``. The engine knows its shard the way those engines
describe it -- the first and last vocabulary id on this rank and the rows it stores, padding
included -- and builds the matching :class:`vocabpar.VocabLayout` from that. It then hands the
shard to vocabpar on the TP group only: converted to FP32 to the functional ``sample``,
``verify`` and ``token_logprobs``, and in bf16 as it is to the same three of the engine
``Sampler`` (which upcasts inside the call), whose results come to the host in one copy with
their failure flags (``to_host()``). Each returns the same result on every rank of the group,
which this script checks against the single-process references on the gathered logits (gathered
here for the check only). Rank 0 prints one line per check; the exit status is 1 when any check
fails on any rank. It also runs as one process.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

import vocabpar
from vocabpar import (
    Sampler,
    SamplingParams,
    VocabLayout,
    comm,
    reference_sample,
    reference_verify,
    sample,
    token_logprobs,
    verify,
)

VOCAB, HIDDEN, PAD_TO = 1000, 64, 64  # vLLM pads the vocabulary to a multiple of 64, then splits it
TP = 2


@dataclass(frozen=True)
class ShardIndices:
    """What an engine knows about its shard of the vocabulary (vLLM's
    ``VocabParallelEmbedding.shard_indices``, Megatron's ``vocab_range``)."""

    vocab_start: int  # first id on this rank
    vocab_end: int  # one past the last id on this rank
    rows: int  # rows this rank stores, padding included


def layout_from_shard(vocab_size: int, tp_size: int, tp_rank: int, shard: ShardIndices) -> VocabLayout:
    """The layout whose shard ``tp_rank`` is exactly ``shard``: vLLM's padded split or
    TensorRT-LLM's uneven one. ``ValueError`` when neither matches (then the engine's columns are
    in an order vocabpar does not know)."""
    for scheme in ("padded", "uneven"):
        layout = VocabLayout(vocab_size, tp_size, pad_to=PAD_TO, scheme=scheme)
        s = layout.shard(tp_rank)
        if (s.org_start, s.org_end, s.rows) == (shard.vocab_start, shard.vocab_end, shard.rows):
            return layout
    raise ValueError(f"no vocabpar layout has {shard} at rank {tp_rank} of {tp_size}")


class Engine:
    """One TP rank of a toy engine: its bf16 rows of the LM head (zero rows for padding), and
    logits that stay sharded."""

    def __init__(self, tp_group: dist.ProcessGroup | None, device: torch.device, seed: int = 0) -> None:
        self.group = tp_group
        tp_size, tp_rank = comm.world_size(tp_group), comm.rank(tp_group)
        rows = -(-VOCAB // PAD_TO) * PAD_TO // tp_size  # vLLM: pad, then split evenly
        start = min(tp_rank * rows, VOCAB)
        self.shard = ShardIndices(start, min(start + rows, VOCAB), rows)
        full = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        self.weight = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device=device)
        self.weight[: self.shard.vocab_end - start] = full[start: self.shard.vocab_end]
        self.layout = layout_from_shard(VOCAB, tp_size, tp_rank, self.shard)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's bf16 logits ``[..., rows]``: the head's GEMM, never gathered."""
        return hidden.to(torch.bfloat16) @ self.weight.T

    def gathered(self, local: torch.Tensor) -> torch.Tensor:
        """The full FP32 logits ``[..., VOCAB]`` in token order (for the checks only)."""
        flat = local.reshape(-1, local.shape[-1])
        every = comm.all_gather(flat, self.group)  # [tp, T, rows]
        full = every.permute(1, 0, 2).reshape(flat.shape[0], -1)[:, self.layout.sharded_to_full()[:VOCAB]]
        return full.view(*local.shape[:-1], VOCAB)


def main() -> int:
    world = vocabpar.init()  # the default group from torchrun's environment; torn down at exit
    me = comm.rank()
    tp_size = TP if world % TP == 0 else 1
    # every rank takes part in making every group
    starts = range(0, world, tp_size)
    groups = [dist.new_group(list(range(r, r + tp_size))) if world > 1 else None for r in starts]
    tp, dp_rank = groups[me // tp_size], me // tp_size
    device = comm.device()  # the GPU under NCCL
    engine = Engine(tp, device)
    g = torch.Generator().manual_seed(100 + dp_rank)  # each TP group serves its own requests

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(device)

    B, k = 4, 3
    checks: list[tuple[str, bool]] = []

    # decode: one token per row, sampled from the sharded logits
    logits = engine.logits(randn(B, HIDDEN))  # bf16, as the head's GEMM gives them
    local = logits.float()  # the functional sample() takes FP32
    positions = torch.tensor([5, 9, 2, 7], device=device)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1234)
    out = sample(local, engine.layout, params, positions=positions, group=tp)
    full = engine.gathered(local)
    want = reference_sample(full, params, positions=positions)
    checks.append(("sample", torch.equal(out.tokens, want.tokens)))

    # the same step through the engine Sampler: built once (max_drafts=k sizes verify's stacked
    # rows, B·(2k+1) with draft logits), each batch prepared on the host, then a fixed script per
    # call with no host read; it takes the bf16 shard as it is
    sampler = Sampler(engine.layout, max_rows=B, max_drafts=k, max_top_n=3, group=tp)
    batch = sampler.prepare(params, positions=positions)
    step = sampler.sample(logits, batch).to_host()  # one device-to-host copy: the ids and the failure flags
    step.raise_if_failed()  # reads nothing more from the device
    checks.append(("Sampler.sample", torch.equal(step.tokens, out.tokens.cpu())))

    # speculative decoding: verify k drafts per row, with the draft model's (sharded) logits
    target_bf16 = engine.logits(randn(B, k + 1, HIDDEN))
    target = target_bf16.float()
    draft = target[:, :k] + randn(B, k, target.shape[-1])
    drafts = engine.gathered(draft).argmax(-1)  # the draft model's greedy proposals
    got = verify(target, engine.layout, params, drafts, positions=positions, draft_logits=draft, group=tp)
    expected = reference_verify(engine.gathered(target), params, drafts, positions=positions,
                                draft_logits=engine.gathered(draft))
    checks.append(("verify", torch.equal(got.tokens, expected.tokens)
                   and torch.equal(got.accepted, expected.accepted)))
    engine_got = sampler.verify(target_bf16, batch, drafts, draft).to_host()
    engine_got.raise_if_failed()
    checks.append(("Sampler.verify", torch.equal(engine_got.tokens, got.tokens.cpu())))

    # prompt scoring: log-probabilities of given tokens, never gathering [T, V]
    prompt = torch.randint(0, VOCAB, (9,), generator=g).to(device)
    scores_bf16 = engine.logits(randn(8, HIDDEN))
    scores = scores_bf16.float()
    lp = token_logprobs(scores, engine.layout, prompt[1:], top_n=3, group=tp)
    exact = torch.log_softmax(engine.gathered(scores).double(), -1)
    scored = exact.gather(1, prompt[1:, None])[:, 0]
    checks.append(("token_logprobs", torch.allclose(lp.logprobs.double(), scored, atol=1e-5)
                   # bf16 logits tie often, so the top lists are compared by value
                   and torch.allclose(lp.top_logprobs.double(), exact.topk(3).values, atol=1e-5)))
    scorer = Sampler(engine.layout, max_rows=8, max_top_n=3, group=tp)  # prompt chunks of up to 8 tokens
    engine_lp = scorer.token_logprobs(scores_bf16, prompt[1:], top_n=3).to_host()
    engine_lp.raise_if_failed()
    checks.append(("Sampler.token_logprobs", torch.allclose(engine_lp.logprobs, lp.logprobs.cpu())))

    failed = torch.tensor([int(not all(ok for _, ok in checks))], device=device)
    failed = comm.all_reduce_max(failed)  # a check failing on any rank fails every rank
    if me == 0:
        s = engine.shard
        print(f"{world} ranks, TP groups of {tp_size}: rank 0 holds ids [{s.vocab_start}, {s.vocab_end}) in "
              f"{s.rows} bf16 rows -> VocabLayout(scheme={engine.layout.scheme!r})")
        for name, ok in checks:
            print(f"{'ok  ' if ok else 'FAIL'} {name}")
        print("all checks passed" if not failed.item() else "SOME CHECKS FAILED")
    return int(failed.item())


if __name__ == "__main__":
    sys.exit(main())
