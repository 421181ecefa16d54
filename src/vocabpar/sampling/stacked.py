"""Verification's stacked rows: the target's ``B·(k+1)`` (row ``b``, position ``i`` at ``b·(k+1)
+ i``), then the draft's ``k`` per drafted row, with the batch's parameters repeated at each
position, where ``min_tokens`` counts the tokens produced before the drafts plus the position.
The adaptive schedule drafts the sampled rows only (host lists); the fixed one every row (device
arithmetic on the batch's size, so one compiled program serves every size)."""

from __future__ import annotations

import torch

from vocabpar.sampling.constraints import check_output_lens
from vocabpar.sampling.params import Rows, SamplingParams


def stacked_rows(params: SamplingParams, batch: int, vocab_size: int, index: torch.Tensor,
                 offset: torch.Tensor, output_lens: torch.Tensor | None) -> Rows:
    """The rows of ``params`` (resolved for ``batch`` rows) at ``index``, each ``offset`` tokens
    further on: verification's stacked rows, whose ``min_tokens`` counts ``output_lens + offset``."""
    lens = None if output_lens is None else check_output_lens(output_lens, batch)[index.cpu()] + offset.cpu()
    return params.take(batch, vocab_size, index).resolve(index.numel(), vocab_size, lens)


def stacked_index(batch: int, k: int, drafted: list[int]) -> tuple[list[int], list[int]]:
    """Per stacked row, its batch row and its position offset, for ``k`` drafts per row and the
    rows ``drafted`` (ascending) whose draft logits join: host lists, so a schedule that reads
    nothing from the device builds them without a launch."""
    index = [b for b in range(batch) for _ in range(k + 1)] + [b for b in drafted for _ in range(k)]
    offset = [i for _ in range(batch) for i in range(k + 1)] + [i for _ in drafted for i in range(k)]
    return index, offset


def every_row_index(batch: int, k: int, drafted: bool,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`stacked_index` with every row drafted (``drafted``) or none, as int64 device tensors."""
    rows = torch.arange(batch, device=device)[:, None]
    blocks = (k + 1,) + (k,) * drafted  # the target's positions, then the draft's
    index = [rows.expand(batch, n).reshape(-1) for n in blocks]
    offset = [torch.arange(n, device=device).repeat(batch) for n in blocks]
    return torch.cat(index), torch.cat(offset)
