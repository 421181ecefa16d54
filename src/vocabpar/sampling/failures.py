"""Failures of an engine call, kept on the device as flags and read once, when the caller asks.

An engine call never raises from inside and never reads a device value: a bad row (NaN
logits, nothing allowed), a rank whose input was bad (logits of the wrong shape, a draft or
token id out of range) and ranks that disagree on what must be replicated become flags in the
output. Every flag is computed from gathered data, so every rank holds the same ones, and
:meth:`Failures.raise_if_failed` raises the same ``ValueError`` on every rank. The other rows'
results are exact; the next call starts clean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_PROBLEMS = {1: "contain NaN logits", 2: "have no allowed token (all -inf)"}
"""Per-row codes (0: the row is fine)."""

RANK_PROBLEMS = {1: "passed logits of the wrong dtype or shape",
                 2: "passed a draft token outside [0, vocab_size)",
                 3: "passed a token id outside [0, vocab_size)",
                 4: "passed draft logits holding +inf"}
"""Per-rank codes of the folded check (0: the rank's input was fine)."""


@dataclass(frozen=True)
class Failures:
    """``rows``: int64 ``[B]`` row codes; ``problems`` / ``problem_rows``: int64 ``[n]``, each
    rank's code and the row it concerns (-1: none); ``disagree``: bool ``[len(fact_names)]``,
    the facts on which some ranks differ. ``where``: the call, for the message."""

    where: str
    rows: torch.Tensor
    problems: torch.Tensor
    problem_rows: torch.Tensor
    disagree: torch.Tensor
    fact_names: tuple[str, ...]

    def failed(self) -> torch.Tensor:
        """bool ``[B]`` on the device: rows whose result is not valid (every row when a rank's
        input was bad or the ranks disagree). No host read."""
        call = (self.problems != 0).any() | self.disagree.any()
        return (self.rows != 0) | call

    def raise_if_failed(self) -> None:
        """Raise one ``ValueError`` naming every failure; nothing when all is well. The one host
        read of an engine call (all flags are copied at once)."""
        flags = torch.cat([self.rows, self.problems, self.problem_rows, self.disagree.long()]).tolist()
        B, n = self.rows.numel(), self.problems.numel()
        rows, problems = flags[:B], flags[B:B + n]
        problem_rows, disagree = flags[B + n:B + 2 * n], flags[B + 2 * n:]
        parts = [f"rank {r} {RANK_PROBLEMS.get(code, f'had problem {code}')}"
                 + (f" at row {problem_rows[r]}" if problem_rows[r] >= 0 else "")
                 for r, code in enumerate(problems) if code]
        differing = [name for name, bad in zip(self.fact_names, disagree) if bad]
        if differing:
            parts.append("ranks disagree on " + ", ".join(differing) + " (must be the same on every rank)")
        for code, what in ROW_PROBLEMS.items():
            bad = [b for b, c in enumerate(rows) if c == code]
            if bad:
                parts.append(f"rows {bad} {what}")
        if parts:
            raise ValueError(f"{self.where}: " + "; ".join(parts))
