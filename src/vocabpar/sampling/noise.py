"""Counter-based Gumbel noise: G(seed, position, token id), independent of everything else.

The hash is pure integer arithmetic on 32-bit values held in int64 tensors (every product stays
below 2**49, so nothing relies on signed-overflow behaviour), hence bit-identical on every
platform and for any tensor shape. The only floating-point step is ``-log(-log(u))`` in float64
with :func:`vocabpar.exactmath.log` (correctly rounded IEEE operations only): elementwise and the
same bits eager or compiled, on any kernel set, so the noise of a token never depends on the batch
row, the batch composition, the number of ranks or which code path computed it.
"""

from __future__ import annotations

import functools

import torch

from vocabpar import exactmath
from vocabpar.hashing import M32
from vocabpar.hashing import fmix32 as _fmix32

STREAMS = {"sample": 0, "accept": 1, "residual": 2}
"""Independent noise streams under one (seed, position): the sampler's Gumbel draws; the uniform
that accepts or rejects a draft token; the Gumbel draws of a rejected draft's correction."""


def row_keys(seed: torch.Tensor, position: torch.Tensor, stream: str = "sample") -> torch.Tensor:
    """Two 32-bit keys per row, int64 ``[..., 2]``, from non-negative int64 seeds and positions
    and a noise stream (one of :data:`STREAMS`)."""
    parts = (seed & M32, seed >> 32, position & M32, position >> 32)
    keys = []
    for start in (0x9E3779B9, 0x7F4A7C15):
        k = torch.full_like(seed, start ^ (STREAMS[stream] * 0x2545F491 & M32))
        for p in parts:
            k = _fmix32(k ^ p)
        keys.append(k)
    return torch.stack(keys, -1)


def gumbel_bucket(key: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The top 16 bits of the ``u`` behind :func:`gumbel` (one hash instead of two), from the
    rows' first key ``key`` (``keys[..., 0]``), broadcast against ``ids``."""
    return _fmix32(ids ^ key) >> 16


@functools.cache
def gumbel_bound() -> torch.Tensor:
    """``bound[h]`` > every Gumbel value whose ``u`` has top 16 bits ``h`` (float64, with a margin
    far above rounding error; +inf for the last bucket)."""
    upper = (torch.arange(1, 2**16 + 1, dtype=torch.float64) * 2.0 ** -16).clamp(max=1.0)
    return -torch.log(-torch.log(upper)) + 1e-6


def uniform(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniform noise (float64) in (0, 1) for token ``ids`` under row ``keys`` (``[..., 2]``,
    broadcast against ``ids``): 52 hashed bits give ``u = (2m + 1) / 2**53``."""
    hi = _fmix32(ids ^ keys[..., 0]) >> 12
    lo = _fmix32(ids ^ keys[..., 1])
    return (((hi << 32) + lo) * 2 + 1).double() * 2.0 ** -53


def gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise (float64) ``-log(-log(u))`` of :func:`uniform`."""
    return -exactmath.log(-exactmath.log(uniform(keys, ids)))
