"""The engine sampler's draw with its failures as flags, and verification's masses on the fixed
schedule (:class:`~vocabpar.sampling.schedules.Fixed`): every row through every step the plan
holds, masked instead of compacted, every message of the plan's rows, no host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vocabpar.layout import VocabLayout
from vocabpar.sampling.acceptance import DraftMasses
from vocabpar.sampling.dense import padded
from vocabpar.sampling.failures import Check
from vocabpar.sampling.ranks import Ranks
from vocabpar.sampling.steps import Drawn, Steps
from vocabpar.wire.scripts import EnginePlan


@dataclass(frozen=True)
class Flagged:
    """An engine call's draw: this shard's ``raw`` logits, the folded
    :class:`~vocabpar.sampling.failures.Check`, the :class:`Drawn` rows (their failures as
    ``codes``) and the ``tokens`` (-1 for failed rows)."""

    raw: torch.Tensor
    check: Check
    drawn: Drawn
    tokens: torch.Tensor

    @classmethod
    def of(cls, raw: torch.Tensor, check: Check, drawn: Drawn) -> Flagged:
        return cls(raw, check, drawn, torch.where(drawn.codes > 0, -1, drawn.tokens))

    @property
    def codes(self) -> torch.Tensor:
        return self.drawn.codes

    @property
    def sampled(self) -> torch.Tensor:
        return self.drawn.sampled

    @property
    def steps(self) -> Steps | None:
        return self.drawn.steps


def fixed_draft_masses(choice: Flagged, layout: VocabLayout, ranks: Ranks, plan: EnginePlan,
                       positions: torch.Tensor, drafts: torch.Tensor) -> DraftMasses:
    """Verification's masses on ``plan``'s fixed schedule: every (row, draft position) pair
    weighed, each row's draft rows stacked after the targets in row order, messages of
    ``plan.rows`` rows. ``drafts``: int64 ``[B, k]``; ``positions``: ``[B]``."""
    B, k = drafts.shape
    weighed = choice.sampled[: B * (k + 1)].view(B, k + 1)[:, :k]
    return DraftMasses(choice.steps, layout, ranks, drafts, positions, weighed, None,
                       torch.arange(B, device=drafts.device),
                       lambda t: ranks.sum(padded(t, plan.rows))[: B * k],
                       lambda t: ranks.gather(padded(t, plan.rows))[:, :B])
