"""32-bit integer mixing on int64 tensors, bit-identical on every platform and device.

Values are 32-bit unsigned integers held in int64 tensors; every product stays below 2**49, so
nothing relies on signed-overflow behaviour. Used for the sampler's keyed noise and for the
fingerprints that let ranks check they hold the same replicated input.
"""

from __future__ import annotations

import zlib

import torch

M32 = 0xFFFFFFFF
MASK62 = (1 << 62) - 1


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` without any int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection with full avalanche."""
    h = h ^ (h >> 16)
    h = mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


DTYPE_WORDS = {dtype: zlib.crc32(str(dtype).encode()) for dtype in vars(torch).values()
               if isinstance(dtype, torch.dtype)}
"""Each dtype's word in a fingerprint's header, hashed once here (a compiled caller then traces
a table look-up, not ``zlib``)."""
FINGERPRINT_BLOCK = 1 << 20  # words hashed per step: bounds the int64 temporaries to ~8 MiB each


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """0-dim int64 hash (on ``t``'s device, no host sync) of ``t``'s dtype, shape and bytes in
    row-major order: equal tensors give equal hashes everywhere; a changed, moved or added
    element changes it with probability ~1 - 2**-32. One pass over ``t``."""
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    header = torch.tensor([DTYPE_WORDS[t.dtype], t.dim(), *t.shape], device=t.device)
    total = _mixed_sum(header, -header.numel())  # negative positions: the header's own
    for start in range(0, words.numel(), FINGERPRINT_BLOCK):
        total = (total + _mixed_sum(words[start: start + FINGERPRINT_BLOCK], start)) & MASK62
    return total


def _mixed_sum(words: torch.Tensor, start: int) -> torch.Tensor:
    """Sum of each 32-bit word hashed together with its position ``start + i``."""
    w = words.long() & M32
    where = torch.arange(start, start + w.numel(), device=w.device) & M32
    return fmix32(w ^ fmix32(where)).sum()
