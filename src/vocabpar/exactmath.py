"""``log`` and a fixed-point ``exp`` in float64 built from correctly rounded IEEE operations only.

``+``, ``-``, ``*``, ``/``, ``floor`` and bit moves give the same bits on every CPU, every ATen
kernel set, under Inductor's generated C++ (compiled with ``-ffp-contract=off``, so no product
and sum are fused into one rounding) and in eager mode, one op at a time. Library ``exp`` and
``log`` do not: vectorised and scalar implementations differ in the last bit for a few inputs in
a million, so a token's noise would depend on which code computed it. The sampler's noise and
masses are therefore defined by these functions. Both are within ~1 ulp of the true value.
"""

from __future__ import annotations

import math

import torch

LN2_HI = float.fromhex("0x1.62e42fee00000p-1")  # ln 2 with 21 low bits zero: k * LN2_HI is exact
LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")  # ln 2 - LN2_HI
MANTISSA = (1 << 52) - 1
SQRT2_MANTISSA = 0x6A09E667F3BCD  # the mantissa bits of sqrt(2)
LOG_TERMS = [1 / (2 * k + 1) for k in range(10, 0, -1)]  # atanh series, w**10 / 21 down to w / 3
EXP_TERMS = [1 / math.factorial(k) for k in range(13, 1, -1)]  # Taylor series, r**13 / 13! down to r**2 / 2


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float64 ``x``: ``x = m * 2**e`` with ``m`` in
    ``[sqrt(2)/2, sqrt(2))`` read from the bits, then ``log m = 2 atanh(s)``, ``s = (m-1)/(m+1)``,
    ``|s| < 0.172``, to ten terms."""
    bits = x.view(torch.int64)
    mantissa = bits & MANTISSA
    high = mantissa > SQRT2_MANTISSA  # m would be >= sqrt(2): halve it
    e = ((bits >> 52) - 1023 + high.long()).double()
    m = (mantissa | torch.where(high, 1022 << 52, 1023 << 52)).view(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    w = s * s
    series = LOG_TERMS[0] * w
    for term in LOG_TERMS[1:]:
        series = (series + term) * w
    return e * LN2_HI + (e * LN2_LO + (2.0 * (s * series) + 2.0 * s))


def exp_fixed(d: torch.Tensor, shift: int) -> torch.Tensor:
    """``floor(exp(d) * 2**shift)`` as int64 for float64 ``d <= 0`` (-inf gives 0) and
    ``shift <= 61``: ``d = k ln 2 + r`` with ``|r| <= ln(2)/2``, ``exp(r)`` to thirteen terms,
    then the exact power of two ``2**(k + shift)`` built from its bits."""
    d = d.clamp(min=-1100.0)
    k = torch.floor(d * (1 / math.log(2)) + 0.5)
    r = (d - k * LN2_HI) - k * LN2_LO
    series = EXP_TERMS[0] * r
    for term in EXP_TERMS[1:]:
        series = (series + term) * r
    e_r = (series + 1.0) * r + 1.0
    n = k.long() + shift
    scale = torch.where(n < -1022, 0, (n.clamp(min=-1022) + 1023) << 52).view(torch.float64)
    return torch.floor(e_r * scale).long()
