"""Verification's stacked rows: a batch's parameters repeated at each draft position, where
``min_tokens`` counts the tokens produced before the drafts plus the position."""

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
