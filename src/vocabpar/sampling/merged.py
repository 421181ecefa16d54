"""Round one's candidates merged over the ranks, and the steps both schedules take from them.

After round one every rank holds the same ``[n, B, c]`` candidates. Everything the sampler
certifies without reading the shard again comes from them: the k-th largest value, the top-p
cut, the draw when a row's kept tokens were all sent. Both schedules (the adaptive ``sample()``
and the engine :class:`~vocabpar.sampling.engine.Sampler`) call these functions; they differ only
in which rows they run them on and what they send after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vocabpar.kernels.fused import best_kept, sample_keys
from vocabpar.sampling.params import Rows
from vocabpar.sampling.semantics import NEG_INF, PAD_KEY, key_value, mass_shift, order_key, z_floor


@dataclass(frozen=True)
class Merged:
    """Per row ``[B]``: ``temperature`` (1 where the row is not sampled), ``z_max`` (the row's max over
    ``t``, 0 where not sampled), the floor ``min_z`` (kept tokens have ``z >= min_z``:
    :func:`~vocabpar.sampling.semantics.z_floor`, min-p's) and the noise ``keys`` ``[B, 2]``. Per
    rank and row ``[n, B]``: ``last``, the c-th value it sent, and whether it holds tokens it did
    not send (``unsent`` ``[n, 1]``). Per candidate ``[B, n·c]``: value ``cand`` (float64,
    float32-exact), ``cand_id`` (-1: padding), ``cand_z = cand / t``, and the order keys sorted
    descending (``key_sorted``, padding last) with their positions ``key_order``. ``unsent_max``
    float64 ``[B]``: the largest value some rank held but did not send (-inf when nothing is
    unsent): every unsent token is ``<= unsent_max``. ``scale``: the masses' ``mass_shift``."""

    temperature: torch.Tensor
    z_max: torch.Tensor
    min_z: torch.Tensor
    keys: torch.Tensor
    last: torch.Tensor
    unsent: torch.Tensor
    cand: torch.Tensor
    cand_id: torch.Tensor
    cand_z: torch.Tensor
    key_sorted: torch.Tensor
    key_order: torch.Tensor
    unsent_max: torch.Tensor
    scale: int

    @property
    def nothing_unsent(self) -> torch.Tensor:
        """Bool ``[B]``: no rank holds a finite token it did not send."""
        return self.unsent_max == NEG_INF

    def take(self, sel: torch.Tensor) -> Merged:
        """The rows ``sel``."""
        per_row = [name for name in self.__dataclass_fields__ if name not in ("last", "unsent", "scale")]
        fields = {name: getattr(self, name)[sel] for name in per_row} | {"last": self.last[:, sel],
                                                                         "unsent": self.unsent}
        return Merged(**fields, scale=self.scale)

    def kth_value(self, k: torch.Tensor) -> torch.Tensor:
        """float32 ``[B]``: the ``k``-th largest candidate value (-inf where padding holds it);
        the row's k-th largest value wherever ``k <= c`` or nothing is unsent."""
        kth = self.key_sorted.gather(1, (k - 1).clamp(0, max(self.cand.shape[1] - 1, 0))[:, None])[:, 0]
        return torch.where(kth == PAD_KEY, NEG_INF, key_value(kth))

    def top_p_cut(self, cand_mass: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, how many candidates in value order come before the mass ``target`` is
        reached (``cand_mass`` int64 ``[B, n·c]``, ``target`` ``[B]``), and the value there
        (float32; the last candidate's when never reached): the top-p threshold wherever every
        token above it was sent."""
        reached = (cand_mass.gather(1, self.key_order).cumsum(1) < target[:, None]).sum(1)
        at = self.key_sorted.gather(1, reached.clamp(max=max(self.cand.shape[1] - 1, 0))[:, None])[:, 0]
        return reached, key_value(at)

    def mass_terms(self, sel: torch.Tensor | slice, lower: torch.Tensor,
                   min_z: torch.Tensor | None = None) -> tuple:
        """The :func:`~vocabpar.kernels.fused.masses` arguments after the logits for rows ``sel``
        counting ``x >= lower`` and ``z >= min_z`` (both ``[B]``; ``min_z`` by default the rows'
        own): float64 bounds, temperature, ``min_z``, ``z_max`` and ``scale``."""
        min_z = self.min_z if min_z is None else min_z
        return lower[sel].double(), self.temperature[sel], min_z[sel], self.z_max[sel], self.scale

    def best_candidate(self, thr: torch.Tensor,
                       wanted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gumbel-max over the candidates a row keeps (``>= thr``, ``z >= min_z``) for the rows
        ``wanted`` (all when None): the best score (float64 ``[B]``, -inf if none) and the lowest
        id reaching it (-1 if none). The row's draw wherever its kept tokens were all sent, a
        lower bound on its winner's score elsewhere."""
        lower = thr.double() if wanted is None else torch.where(wanted, thr.double(), float("inf"))
        return best_kept(self.cand, self.cand_id, lower, self.temperature, self.min_z, self.keys)


def side_by_side(per_rank: torch.Tensor) -> torch.Tensor:
    """``[n, B, c]`` as ``[B, n·c]``: each row's entries from every rank, in rank order (a
    concatenation, the same program for any ``B``, one row included)."""
    return torch.cat(per_rank.unbind(0), 1)


def merge_candidates(values: torch.Tensor, ids: torch.Tensor, rows: Rows, positions: torch.Tensor,
                     sampled: torch.Tensor, best: torch.Tensor, real_counts: tuple[int, ...],
                     vocab_size: int) -> Merged:
    """:class:`Merged` from round one's gathered candidates (``values`` float64 and ``ids``
    ``[n, B, c]``, each rank's in value order), the rows' parameters, which rows are
    ``sampled``, each row's max ``best`` ``[B]`` and each rank's count of real tokens."""
    n, B, c = values.shape
    t = torch.where(sampled, rows.temperature, 1.0)
    z_max = torch.where(sampled, best / t, 0.0)
    cand, cand_id = side_by_side(values), side_by_side(ids)
    keys = torch.where(cand_id >= 0, order_key(cand.float()), PAD_KEY)
    key_sorted, key_order = keys.sort(1, descending=True)
    unsent = torch.tensor([[c < count] for count in real_counts], device=values.device)
    last = values[:, :, c - 1] if c else values.new_full((n, B), NEG_INF)
    min_z, keys = z_floor(z_max, rows), sample_keys(rows.seed, positions)
    unsent_max = torch.where(unsent, last, NEG_INF).max(0).values
    return Merged(t, z_max, min_z, keys, last, unsent, cand, cand_id, cand / t[:, None], key_sorted,
                  key_order, unsent_max, mass_shift(vocab_size))
