"""The sampler's local passes over a shard, each one loop: plain torch, compiled where a compiler
is at hand (``torch.compile``: Inductor's C++ on CPU, Triton on CUDA), run op by op otherwise.

Compiled and eager give the same bits: the passes use only integer operations, comparisons and
correctly rounded float operations (:mod:`vocabpar.exactmath` supplies ``log`` and ``exp``), and
Inductor compiles without fusing a product and a sum into one rounding (``-ffp-contract=off`` in
C++, ``emulate_precision_casts`` for Triton). Each pass compiles once per calling convention with
every dimension dynamic (unbacked, so sizes 0 and 1 do not specialise it): changing the batch, the
positions or the parameters never recompiles; the compiled program is kept on disk
(:mod:`vocabpar.kernels.store`) and later processes load it in milliseconds; the first
compilation in a process says so in one line on rank 0 (:func:`notice_compiling`; :func:`quiet`
silences it). ``VOCABPAR_COMPILE=0`` (or :func:`compiling`) runs everything eager; a pass whose
compilation fails warns once and runs eager, and so does a calling convention past Dynamo's
recompile limit. Empty inputs run eager (compiled code never sees a size 0). Small inputs run compiled
too: a compiled call costs tens of microseconds, the eager ``log`` of :mod:`vocabpar.exactmath`
alone some thirty operations.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from vocabpar.kernels import store
from vocabpar.sampling.noise import gumbel, gumbel_bucket, row_keys
from vocabpar.sampling.semantics import (
    NEG_INF,
    accept_uniform,
    kept,
    keyed_residual_scores,
    order_key,
    rank_key,
    scaled_mass,
)

SWITCH = "VOCABPAR_COMPILE"
_on = [os.environ.get(SWITCH, "1") != "0"]
OPTIONS = {"emulate_precision_casts": True, "cpp.fallback_scatter_reduce_sum": False}
"""Inductor settings: no fused multiply-add under Triton; int32 scatter-adds generated in the
loop that computes them (exact in any order) rather than handed to ATen (int64 ones always are)."""
COMPILE_SECONDS: dict[str, float] = {}
"""Per pass, the seconds its first calls in each convention took in this process (compiling or
loading included)."""
NOTICE = ("vocabpar: compiling the sampler's passes, not yet in the store for this install and thread "
          "count: up to a minute and a half on 2 cores for the first calls, once; later processes "
          "load them in seconds. `vocabpar warm` compiles them ahead of time.")
"""The line rank 0 prints the first time in a process a pass has to be compiled rather than
loaded (:func:`notice_compiling`)."""
_noticed = [False]


def notice_compiling() -> None:
    """Print :data:`NOTICE` on stderr, once per process and on rank 0 only (the rank of the
    process group, else the ``RANK`` variable, else 0), unless :func:`quiet` said not to: called
    before a pass compiles, which takes seconds, so that a first call's minute is not silent."""
    if _noticed[0]:
        return
    _noticed[0] = True
    if (dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "0")) in (0, "0", ""):
        print(NOTICE, file=sys.stderr, flush=True)


def quiet() -> None:
    """No :data:`NOTICE` from this process (``vocabpar warm`` says what it compiles its own way)."""
    _noticed[0] = True


@contextlib.contextmanager
def compiling(on: bool) -> Iterator[None]:
    """Run the passes compiled (``True``, where possible) or eager inside the block."""
    before, _on[0] = _on[0], on
    try:
        yield
    finally:
        _on[0] = before


class Fused:
    """A pass ``fn`` of tensors, compiled on first use in each calling convention when enabled;
    the same bits either way. ``options``: Inductor settings for this pass on top of
    :data:`OPTIONS`. A convention compiled before, in this process or another, is loaded from
    :mod:`vocabpar.kernels.store`."""

    def __init__(self, fn: Callable[..., object], options: dict[str, object] | None = None) -> None:
        self.fn, self.broken, self.full = fn, False, False
        self.programs: dict[str, list[store.Program]] = {}
        """Per calling convention (:func:`~vocabpar.kernels.store.convention`), its programs."""
        self.compiled = self.loaded = 0
        """How many of the programs this process compiled, and loaded from the store."""
        self.options = OPTIONS | (options or {})
        functools.update_wrapper(self, fn)

    def __call__(self, *args: object) -> object:
        args = tuple(_dense(a) if isinstance(a, torch.Tensor) else a for a in args)
        empty = any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in args)
        # eager: switched off, broken, empty, or a caller compiles the whole step (the pass joins its graph)
        if torch.compiler.is_compiling() or not _on[0] or self.broken or empty:
            return self.fn(*args)
        programs = self.programs.setdefault(store.convention(args), [])
        for program in programs:
            if program.guard_check(*args):
                return self._compiled_or_eager(program.fn, args)
        if sum(map(len, self.programs.values())) >= torch._dynamo.config.recompile_limit:
            return self._past_the_limit(args)
        start = time.perf_counter()
        made = self._compiled_or_eager(self._program, args)
        if self.broken:
            return made
        program, out = made
        programs.append(program)
        COMPILE_SECONDS[self.__name__] = COMPILE_SECONDS.get(self.__name__, 0.0) + time.perf_counter() - start
        return out

    def _program(self, *args: object) -> tuple[store.Program, object]:
        """A program of this pass that serves ``args`` (loaded from the store, else compiled and
        kept there) and its output on ``args``."""
        known = set(torch._inductor.list_options())  # a setting this torch lacks is left out, not fatal
        options = {k: v for k, v in self.options.items() if k in known}
        found = store.load(self.fn, args, options)
        if isinstance(found, Path):
            notice_compiling()
            found = store.compile_and_save(self.fn, args, options, found)
            self.compiled += 1
        else:
            self.loaded += 1
        return found, found.fn(*args)

    def _compiled_or_eager(self, run: Callable[..., object], args: tuple[object, ...]) -> object:
        """``run(*args)``, or the eager pass where that fails: a bad input then raises from the
        eager run, as it would without compilation; a failing compiler makes the pass eager from
        now on, with one warning."""
        try:
            return run(*args)
        except Exception as error:  # noqa: BLE001 -- a missing compiler surfaces as any of several types
            out = self.fn(*args)
            self.broken = True
            warnings.warn(f"vocabpar: compiling {self.__name__} failed, running it eager "
                          f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})",
                          RuntimeWarning, stacklevel=4)
            return out

    def _past_the_limit(self, args: tuple[object, ...]) -> object:
        """A convention past Dynamo's recompile limit runs eager (one warning per pass); the
        compiled ones stay."""
        if not self.full:
            self.full = True
            warnings.warn(f"vocabpar: {self.__name__} reached Dynamo's recompile limit: calling "
                          f"conventions it has not compiled yet run eager", RuntimeWarning, stacklevel=3)
        return self.fn(*args)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides (a copy only if it has others, e.g. a column of a matrix) and
    no view base (``detach`` shares the storage): compiled code is specialised on the stride
    pattern and on whether a tensor is a view."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.insert(0, step)
        step *= size
    return t.detach() if list(t.stride()) == expected else t.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------- the passes
def _flags(mask: torch.Tensor) -> torch.Tensor:
    """A pass's ``[F, R]`` mask as int32 0/1, for ``nonzero``: Inductor's C++ writes a bool
    tensor about five times slower than an int32 one (a quarter of the bytes notwithstanding)."""
    return mask.int()


def int32_sums(weight_bits: int, columns: int) -> bool:
    """Whether a histogram's bins fit int32 for ``columns`` tokens per row, each weighing below
    ``2**weight_bits``: counts do, masses do not."""
    return weight_bits + columns.bit_length() <= 31


def _bins(column: torch.Tensor, added: torch.Tensor, top: int, narrow: bool) -> torch.Tensor:
    """int64 ``[F, top + 1]``: per row, the weights ``added`` summed into their ``column``; exact
    in any order. Compiled with ``narrow`` (:func:`int32_sums`), the sums run in int32, which
    Inductor adds in the loop that computes the weights; an int64 scatter-add it hands to ATen
    through two ``[F, R]`` int64 temporaries (4.5 times the time for counts; for masses, three
    int32 pieces measured no faster than that, so they stay int64)."""
    if narrow and torch.compiler.is_compiling():
        return _int32_bins(column, added, top)
    return torch.zeros(column.shape[0], top + 1, dtype=torch.long, device=column.device).scatter_add_(
        1, column, added)


def _int32_bins(column: torch.Tensor, added: torch.Tensor, top: int) -> torch.Tensor:
    """:func:`_bins` summed in int32 (the caller guarantees no bin overflows)."""
    out = torch.zeros(column.shape[0], top + 1, dtype=torch.int32, device=column.device)
    return out.scatter_add(1, column, added.int()).long()


INLINE = {"realize_reads_threshold": 2**31, "realize_opcount_threshold": 2**31,
          "realize_acc_reads_threshold": 2**31}
"""Inductor settings for the passes that weigh each token by its exact mass (and ``members``):
Inductor stores a value that later steps read more than a few times (the fixed-point ``exp``'s
reduced argument, read by each of its thirteen Horner steps; a mass read by two sums) in an
``[F, R]`` float64 or int64 buffer, and reads it back in a second loop; kept in registers within
one loop instead, ``[256, 32320]`` on one thread: ``mass_totals`` 130 → 55 ms, ``masses`` 154 →
85 ms, ``members`` 43 → 26 ms, ``logit_histogram`` of masses 282 →
200 ms (of counts 69 → 76 ms). The hashing passes keep the default: inlined, their code
generation did not finish in minutes."""
inlined = functools.partial(Fused, options=INLINE)


def _masses(x: torch.Tensor, lower: torch.Tensor, temperature: torch.Tensor, min_z: torch.Tensor,
            z_max: torch.Tensor, scale: int) -> torch.Tensor:
    """int64 ``[F, R]``: the exact mass of each token with ``x >= lower`` and ``z = x / t >=
    min_z``, 0 elsewhere. ``x``: float32 ``[F, R]``; ``scale``: ``mass_shift`` of the vocabulary;
    the rest float64 ``[F]``."""
    z, keep = kept(x, lower, temperature, min_z)
    return torch.where(keep, scaled_mass(z, z_max[:, None], scale), 0)


masses = inlined(_masses)


@inlined
def mass_totals(x: torch.Tensor, lower: torch.Tensor, temperature: torch.Tensor, min_z: torch.Tensor,
                z_max: torch.Tensor, scale: int) -> torch.Tensor:
    """int64 ``[F]``: the row sums of :func:`masses` (same arguments), without writing ``[F, R]``
    (a third less time)."""
    return _masses(x, lower, temperature, min_z, z_max, scale).sum(1)


@Fused
def best_kept(x: torch.Tensor, ids: torch.Tensor, lower: torch.Tensor, temperature: torch.Tensor,
              min_z: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the Gumbel-max over the kept tokens (``x >= lower``, ``z = x / t >= min_z``): the
    best ``z + G`` (float64 ``[F]``, -inf if none) and the lowest id reaching it (-1 if none).
    ``x``: float32 ``[F, R]`` with ``ids`` ``[R]`` (a shard), or float64 with ids per entry
    ``[F, R]`` (merged candidates); -1: padding, never kept; ``keys``: ``[F, 2]``; the rest
    float64 ``[F]``."""
    z, keep = kept(x, lower, temperature, min_z)
    keep = keep & (ids >= 0)
    score = torch.where(keep, z + gumbel(keys[:, None, :], ids.clamp(min=0)), NEG_INF)
    return _first_max(score, torch.where(keep, ids, -1))


def _first_max(score: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the max of ``score`` ``[F, R]`` and the lowest of ``ids`` (``[R]`` or ``[F, R]``,
    -1 = none) reaching it: float64 ``[F]`` (-inf for an empty row) and int64 ``[F]`` (-1 when
    no id reaches it)."""
    big = torch.iinfo(torch.long).max
    if not (torch.compiler.is_compiling() or score.shape[1]):  # compiled code never sees R = 0
        return score.new_full(score.shape[:1], NEG_INF), torch.full(score.shape[:1], -1, device=score.device)
    best = score.amax(1)
    arg = torch.where((score == best[:, None]) & (ids >= 0), ids, big).amin(1)
    return best, torch.where(arg == big, -1, arg)


first_max = Fused(_first_max)


@Fused
def nan_and_ties(raw: torch.Tensor, x: torch.Tensor, real: torch.Tensor,
                 cut: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What round one checks on this shard besides its max, in one read of it: per row, whether
    ``raw`` holds a NaN on a real column, and how many real tokens of ``x`` equal ``cut`` (the
    c-th candidate's value; None: nothing is cut, 0). ``raw``, ``x``: float32 ``[F, R]`` (raw and
    processed logits); ``real``: bool ``[R]``; ``cut``: float64 ``[F]``."""
    has_nan = (raw.isnan() & real).any(1)
    if cut is None:
        return has_nan, torch.zeros(has_nan.shape, dtype=torch.long, device=has_nan.device)
    return has_nan, ((x == cut[:, None]) & real).sum(1)


@Fused
def scored(z: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``z + G`` (float64 ``[N]``) of listed tokens: ``z`` float64 ``[N]``, their rows' noise
    ``keys`` ``[N, 2]`` and ``ids`` ``[N]``."""
    return z + gumbel(keys, ids)


@Fused
def reachable(x: torch.Tensor, ids: torch.Tensor, lower: torch.Tensor, temperature: torch.Tensor,
              min_z: torch.Tensor, floor: torch.Tensor, key: torch.Tensor,
              bound: torch.Tensor) -> torch.Tensor:
    """int32 ``[F, R]``, 1 for the kept tokens (``x >= lower``, ``z = x / t >= min_z``, real) whose noise
    bound (``bound``: :func:`~vocabpar.sampling.noise.gumbel_bound`, indexed by the top 16 bits of
    their uniform) lets ``z + G`` reach ``floor``. The bound is conservative: no possible winner
    is dropped. ``x``: float32 ``[F, R]``; ``ids``: ``[R]``; ``key``: each row's first noise key
    ``[F]``; the rest float64 ``[F]``."""
    z, keep = kept(x, lower, temperature, min_z)
    noise_bound = bound[gumbel_bucket(key[:, None], ids.clamp(min=0))]
    return _flags(keep & (ids >= 0) & (z + noise_bound >= floor[:, None]))


residual_pass = Fused(keyed_residual_scores)
""":func:`~vocabpar.sampling.semantics.keyed_residual_scores` as one pass (``p``, ``q`` int64
``[F, R]``; totals ``[F]``, keys ``[F, 2]``; ``ids`` ``[R]``): the rows' keys are hashed
outside it, once per row (inlined per token, they made the pass take a minute to compile)."""


def residual(p: torch.Tensor, p_total: torch.Tensor, q: torch.Tensor, q_total: torch.Tensor,
             seed: torch.Tensor, positions: torch.Tensor,
             ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The correction's Gumbel-max from ``(p - q)+`` per row: the scores' pass, then
    :func:`first_max` (two passes compile in a fraction of the time one fused pass takes)."""
    keys = residual_keys(seed, positions)
    return first_max(residual_pass(p, p_total, q, q_total, keys, ids), ids)


KEY_OPTIONS = {"realize_opcount_threshold": 8, "realize_cpu_opcount_threshold": 8}
"""Inductor settings for the passes that hash per row (sixteen chained rounds): Inductor inlines
every intermediate value into the expressions that read it, and for these chains that took it
40 s to generate the code; these settings make it store the intermediates instead (a few bytes
per row), which takes 4 s. Eager, each chain is some 150 launches."""


def _sample_keys(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rows' noise keys ``[F, 2]`` on the sampler's stream, from seeds and positions ``[F]``."""
    return row_keys(seed, positions)


def _residual_keys(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rows' noise keys ``[F, 2]`` on the correction's stream, from seeds and positions ``[F]``."""
    return row_keys(seed, positions, "residual")


sample_keys = Fused(_sample_keys, options=KEY_OPTIONS)
residual_keys = Fused(_residual_keys, options=KEY_OPTIONS)
accept_uniforms = Fused(accept_uniform, options=KEY_OPTIONS)
""":func:`~vocabpar.sampling.semantics.accept_uniform` as one pass (seeds and positions ``[P]``,
one per (row, draft position))."""


def _digits(keys: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor | int, bits: torch.Tensor | int,
            prefix: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One histogram round's columns: per token, its digit of ``bits`` bits below ``shift`` when
    its key lies in the bucket ``prefix`` (``keys >> shift == prefix``), else ``top``; the weight
    it adds (0 below the bucket); whether it is inside."""
    high = keys >> shift
    inside = high == prefix
    digit = torch.where(inside, (keys >> (shift - bits)) & ((1 << bits) - 1), top)
    return digit, torch.where(inside | (high > prefix), weight, 0), inside


digits = Fused(_digits)
""":func:`_digits` of listed tokens: every argument but ``top`` per token ``[N]``."""


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """Unsigned order keys in ``[0, 2**32)`` of float32 values (any shape): the same order."""
    return order_key(x) + 2**31


order_keys = Fused(_order_keys)


def _shard_keys(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """:func:`_order_keys` of a shard's tokens, -1 where not ``real`` (padding). ``x``: float32
    ``[F, R]``; ``real``: bool ``[R]``."""
    return torch.where(real, _order_keys(x), -1)


def _real_weight(real: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """int64 ``[F, R]``: ``weight`` (1 when None) on real tokens, 0 on padding."""
    return torch.where(real, 1 if weight is None else weight, 0)


@Fused
def histogram(x: torch.Tensor, real: torch.Tensor, weight: torch.Tensor | None, shift: torch.Tensor,
              bits: torch.Tensor, prefix: torch.Tensor, top: int, narrow: bool) -> torch.Tensor:
    """int64 ``[F, top + 1]``: per row, the weight of each ``bits``-bit digit below ``shift`` of
    the shard's order keys in the bucket ``prefix``, then (column ``top``) the weight above the
    bucket; one read of the shard, nothing ``[F, R]``-sized written. ``x``: float32 ``[F, R]``;
    ``real``: bool ``[R]``; ``weight``: int64 ``[F, R]``, or None for 1 per real token;
    ``shift``, ``bits``, ``prefix``: per row ``[F]``; ``narrow``: :func:`int32_sums` of the
    weights."""
    shifts = (shift[:, None], bits[:, None], prefix[:, None])
    column, added, _ = _digits(_shard_keys(x, real), _real_weight(real, weight), *shifts, top)
    return _bins(column, added, top, narrow)


@inlined
def logit_histogram(x: torch.Tensor, ids: torch.Tensor, lower: torch.Tensor, temperature: torch.Tensor,
                    min_z: torch.Tensor, z_max: torch.Tensor, scale: int, shift: int, bits: int,
                    prefix: torch.Tensor, top: int, unit: bool, narrow: bool) -> torch.Tensor:
    """:func:`histogram` of this shard's order keys weighted by 1 (``unit``) or by the exact mass
    of each token with ``x >= lower`` and ``z = x / t >= min_z`` (0 elsewhere), computed from the
    logits in the same loop: one read of ``x`` per round, nothing ``[F, R]``-sized written.
    ``x``: float32 ``[F, R]``; ``ids``: ``[R]`` (-1: padding, weight 0); ``prefix`` and the
    rest per row ``[F]``; ``narrow``: :func:`int32_sums` of the weights."""
    keys = _shard_keys(x, ids >= 0)
    z, keep = kept(x, lower, temperature, min_z)
    weight = torch.where(keep & (ids >= 0), 1 if unit else scaled_mass(z, z_max[:, None], scale), 0)
    column, added, _ = _digits(keys, weight, shift, bits, prefix[:, None], top)
    return _bins(column, added, top, narrow)


@inlined
def members(x: torch.Tensor, real: torch.Tensor, weight: torch.Tensor | None, low: torch.Tensor,
            high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``[F, R]``, 1 for the tokens whose order key lies in ``[low, high)`` and whose weight
    is positive, and their count per row (int64 ``[F]``, from the same loop: an eager sum of the
    flags is a second, slower pass). ``x``, ``real``, ``weight`` as in :func:`histogram`; ``low``,
    ``high``: ``[F]``."""
    keys = _shard_keys(x, real)
    flags = _flags((keys >= low[:, None]) & (keys < high[:, None]) & (_real_weight(real, weight) > 0))
    return flags, flags.sum(1)


rank_keys = Fused(rank_key)
""":func:`~vocabpar.sampling.semantics.rank_key` of a shard as one pass (``x``: float32 ``[F, R]``,
``ids``: ``[R]``): the keys a top-n ranks (eager, its integer steps write five ``[F, R]`` int64
tensors)."""
