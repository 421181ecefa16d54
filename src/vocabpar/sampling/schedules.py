"""The two schedules of :class:`~vocabpar.sampling.steps.Steps`: which rows each step runs on and
what it sends. Neither computes a number of its own; both reach the same tokens bit for bit.

* :class:`Adaptive` (``sample()`` / ``verify()``): compacts the rows that need more, skips a
  collective no row needs, reads the host to decide, and records what it sent (its
  :class:`~vocabpar.wire.scripts.SamplePath` fields): the fewest bytes and collectives.
* :class:`Fixed` (the engine :class:`~vocabpar.sampling.engine.Sampler`): runs every row through
  every step its :class:`~vocabpar.wire.scripts.EnginePlan` holds, masked instead of compacted,
  every message padded to the plan's rows: no host read, one script per plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from vocabpar.kernels.fused import best_kept, int32_sums, logit_histogram, mass_totals, masses, scored
from vocabpar.sampling.candidates import unsent_mass
from vocabpar.sampling.dense import padded, threshold
from vocabpar.sampling.search import Draw, contenders, threshold_search, value_key
from vocabpar.sampling.semantics import (
    NEG_INF,
    PAD_KEY,
    check_rows,
    key_value,
    mass_bits,
    mass_shift,
    merge_argmax,
    row_argmax,
    top_p_target,
)
from vocabpar.sampling.steps import Steps
from vocabpar.wire.records import DRAW, TOTAL
from vocabpar.wire.scripts import EnginePlan, Search

MASS_BLOCK = 2**22
"""Logits per block when the adaptive schedule totals a shard's kept mass for many rows: bounds
the eager pass's float64 temporaries."""


class Adaptive:
    """Compacted rows, collectives only when some row needs them, decisions read from the host.
    Records the collectives it sent: ``top_k`` and ``top_p`` (the searches), ``total_rows`` (the
    rows whose top-p total was all-reduced) and ``draw_rows`` (the rows the draw gathered)."""

    def __init__(self, row_name: Callable[[int], str] | None = None) -> None:
        self.row_name = row_name
        self.top_k: Search | None = None
        self.top_p: Search | None = None
        self.total_rows = self.draw_rows = 0

    def any(self, rows: torch.Tensor) -> bool:
        return bool(rows.any())

    def failed(self, nan_rows: torch.Tensor, best: torch.Tensor) -> None:
        """Raise the same ``ValueError`` on every rank for NaN rows and rows with nothing allowed
        (``best`` -inf), named by ``row_name``."""
        check_rows(nan_rows, (best == NEG_INF) & ~nan_rows, self.row_name)

    @staticmethod
    def _draw_for(s: Steps, sel: torch.Tensor) -> Draw:
        return Draw(s.rows_of(sel), s.ids, s.m.take(sel))

    @staticmethod
    def _drawn(s: Steps) -> torch.Tensor:
        """The tokens searches drew (-1: none yet), made on the first draw."""
        if s.drawn is None:
            s.drawn = torch.full_like(s.sampled, -1, dtype=torch.long)
        return s.drawn

    def top_k_search(self, s: Steps, search: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
        """A listed threshold search (2-4 collectives) of the rows ``search`` between the
        candidates' k-th value and ``unsent_max``; it also draws them when no row of it has top-p."""
        sel = search.nonzero().flatten()
        if not sel.numel():
            return kappa
        m, k, n = s.m, s.rows.top_k[sel], s.m.cand.shape[1]
        # at least the merged candidates' k-th; at most unsent_max, since fewer than k candidates lie
        # above it (else the candidates would certify it)
        kth = m.key_sorted[sel, (k - 1).clamp(max=n - 1)]
        lo = torch.where((k <= n) & (kth != PAD_KEY), kth + 2**31, 0)
        draw = None if (s.rows.top_p[sel] < 1).any() else self._draw_for(s, sel)
        v, token, self.top_k = threshold_search(s.rows_of(sel), s.ids >= 0, None, k, lo,
                                                value_key(m.unsent_max[sel]), s.ranks, draw)
        if draw is not None:
            self._drawn(s)[sel] = token
        kappa[sel] = key_value(v - 2**31)
        return kappa

    def pool_totals(self, s: Steps, incomplete: torch.Tensor, cand_mass: torch.Tensor, total: torch.Tensor,
                    kappa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``incomplete`` rows' pool totals: one all-reduce of 8 bytes per row, or -- where
        the candidates above ``unsent_max`` would fall short of the target even against half the
        guessed unsent mass -- the search's first round (``folded``); once one row searches, every
        incomplete row does (a search after the all-reduce would cost a collective more). Either
        way is exact: the guess only picks the cheaper."""
        m = s.m
        above_unsent = torch.where(m.cand > m.unsent_max[:, None], cand_mass, 0).sum(1)
        unsent = unsent_mass(s.sent, m.temperature, m.z_max, s.ranks, s.V)
        short = incomplete & (above_unsent < s.rows.top_p * (total + unsent / 2))
        folded = incomplete if bool(short.any()) else short
        missing = (incomplete & ~folded).nonzero().flatten()
        if missing.numel():
            local = mass_totals(s.rows_of(missing), *m.mass_terms(missing, kappa, s.pool_min_z))
            total[missing] = TOTAL.unpack(s.ranks.sum(TOTAL.pack(mass=local))).mass
            self.total_rows = missing.numel()
        return total, folded

    def top_p_search(self, s: Steps, search: torch.Tensor, folded: torch.Tensor, found: torch.Tensor,
                     cut: torch.Tensor, target: torch.Tensor, kappa: torch.Tensor,
                     tau: torch.Tensor) -> torch.Tensor:
        """A listed threshold search on masses (2-4 collectives) of the rows ``search``, which
        also draws them; a ``folded`` row's first round measures its total."""
        sel = search.nonzero().flatten()
        if not sel.numel():
            return tau
        m = s.m
        q = masses(s.rows_of(sel), *m.mass_terms(sel, kappa, s.pool_min_z))
        # at least the cut where the candidates reach the target, else the value below which
        # masses are 0; at most unsent_max (the candidates above it fall short)
        floor_x = m.temperature * (m.z_max - mass_shift(s.V) * math.log(2) - 1)
        lo = value_key(torch.where(found, cut.double(), floor_x)[sel])
        fold, known, p = folded[sel], target[sel], s.rows.top_p[sel]
        need = lambda measured: torch.where(fold, top_p_target(measured, p), known)  # noqa: E731
        v, self._drawn(s)[sel], self.top_p = threshold_search(
            s.rows_of(sel), s.ids >= 0, q, need, lo, value_key(m.unsent_max[sel]), s.ranks,
            self._draw_for(s, sel), mass_bits(s.V))
        tau[sel] = key_value(v - 2**31)
        return tau

    def drawn_locally(self, s: Steps, wanted: torch.Tensor) -> torch.Tensor:
        """The rows whose kept tokens all lie in round one's candidates."""
        return wanted & s.all_sent()

    def spread_draw(self, s: Steps, spread: torch.Tensor, floor_score: torch.Tensor | None,
                    tokens: torch.Tensor) -> torch.Tensor:
        """One all-gather of :data:`~vocabpar.wire.records.DRAW` for the ``spread`` rows: each
        rank's best (score, id) among its kept tokens that can beat ``floor_score``."""
        sel = spread.nonzero().flatten()
        if not sel.numel():
            return tokens
        m = s.m
        r, col, z = contenders(s.rows_of(sel), s.ids, s.thr[sel], m.temperature[sel], m.min_z[sel],
                               floor_score[sel], m.keys[sel])
        rows, ids = sel[r], s.ids[col]
        score, arg = row_argmax(rows, ids, scored(z, m.keys[rows], ids), spread.shape[0])
        got = DRAW.unpack(s.ranks.gather(DRAW.pack(score=score[sel], id=arg[sel])))
        _, tokens[sel] = merge_argmax(got.score, got.id)
        self.draw_rows = sel.numel()
        return tokens

    def kept_total_and_at(self, s: Steps, sel: torch.Tensor, cols: torch.Tensor,
                          terms: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Steps.kept_total_and_at` (``terms``: the rows' mass terms) without copying the
        rows: a row whose kept tokens all lie in round one's candidates sums the candidates this
        rank sent (the same integers); the others read the shard, ``MASS_BLOCK`` logits at a
        time. One host read."""
        lower, t, min_z, z_max, scale = terms
        sent = s.all_sent()[sel]
        count = int(sent.sum())
        order = torch.argsort(~sent, stable=True)  # the rows whose kept tokens were all sent first
        head, tail = order[:count], order[count:]
        total = torch.empty(sel.shape[0], dtype=torch.long, device=sel.device)
        mine = s.sent[s.ranks.me, sel[head]]  # [count, c]: the candidates this rank sent
        total[head] = masses(mine, lower[head], t[head], min_z[head], z_max[head], scale).sum(1)
        block = max(1, MASS_BLOCK // max(s.x.shape[1], 1))
        for part in tail.split(block):
            total[part] = mass_totals(s.rows_of(sel[part]), *s.m.mass_terms(sel[part], s.thr))
        return total, masses(s.x[sel, cols][:, None], *terms)[:, 0]


class Fixed:
    """Every row through every step of ``plan``, masked; every message ``plan.rows`` rows."""

    def __init__(self, plan: EnginePlan) -> None:
        self.plan = plan

    def any(self, rows: torch.Tensor) -> bool:
        return True  # a mask, not a read: the rows it does not hold ignore what follows

    def failed(self, nan_rows: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        """Per-row failure codes: 1 NaN, 2 nothing allowed (``best`` -inf), 0 fine."""
        return torch.where(nan_rows, 1, torch.where(best == NEG_INF, 2, 0))

    def _histogram(self, s: Steps, lower: torch.Tensor, pool_z: torch.Tensor, unit: bool):
        """This shard's histogram of the tokens with ``x >= lower``, ``z >= pool_z``, counted
        (``unit``) or weighed by mass."""
        m, x = s.m, s.x
        narrow = int32_sums(1 if unit else mass_bits(s.V), x.shape[1])
        return lambda shift, bits, prefix, top: logit_histogram(
            x, s.ids, lower, m.temperature, pool_z, m.z_max, m.scale, shift, bits, prefix, top, unit, narrow)

    def _search(self, s: Steps, lower: torch.Tensor, pool_z: torch.Tensor, unit: bool, need) -> torch.Tensor:
        """The plan's histogram rounds over every row (rows with ``lower = inf`` count nothing)."""
        plan = self.plan
        v = threshold(self._histogram(s, lower, pool_z, unit), s.x.shape[0], need, s.ranks, plan.rows,
                      s.x.device, plan.search_bits)
        return key_value(v - 2**31)

    def top_k_search(self, s: Steps, search: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
        if not self.plan.top_k_search:
            return kappa
        no_min = torch.full_like(s.m.min_z, NEG_INF)
        v = self._search(s, torch.where(search, no_min, float("inf")), no_min, True, s.rows.top_k)
        return torch.where(search, v, kappa)

    def pool_totals(self, s: Steps, incomplete: torch.Tensor, cand_mass: torch.Tensor, total: torch.Tensor,
                    kappa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return total, incomplete  # the search's first round measures every incomplete row's total

    def top_p_search(self, s: Steps, search: torch.Tensor, folded: torch.Tensor, found: torch.Tensor,
                     cut: torch.Tensor, target: torch.Tensor, kappa: torch.Tensor,
                     tau: torch.Tensor) -> torch.Tensor:
        if not self.plan.top_p_search:
            return tau
        v = self._search(s, torch.where(search, kappa.double(), float("inf")), s.pool_min_z, False,
                         lambda measured: top_p_target(measured, s.rows.top_p))
        return torch.where(search, v, tau)

    def drawn_locally(self, s: Steps, wanted: torch.Tensor) -> torch.Tensor | None:
        """Every row, where no rank holds unsent tokens; else none: the plan's all-gather draws
        them all (a plan draws by all-gather exactly when some rank holds unsent tokens)."""
        return None if self.plan.draw else wanted

    def spread_draw(self, s: Steps, spread: torch.Tensor, floor_score: torch.Tensor | None,
                    tokens: torch.Tensor) -> torch.Tensor:
        if not self.plan.draw:
            return tokens
        m, B = s.m, spread.shape[0]
        score, arg = best_kept(s.x, s.ids, torch.where(spread, s.thr.double(), float("inf")), m.temperature,
                               m.min_z, m.keys)
        got = DRAW.unpack(s.ranks.gather(padded(DRAW.pack(score=score, id=arg), self.plan.rows))[:, :B])
        return torch.where(spread, merge_argmax(got.score, got.id)[1], tokens)

    def kept_total_and_at(self, s: Steps, sel: torch.Tensor, cols: torch.Tensor,
                          terms: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Steps.kept_total_and_at` from one copy of the rows."""
        x = s.x[sel]
        return mass_totals(x, *terms), masses(x.gather(1, cols[:, None]), *terms)[:, 0]
