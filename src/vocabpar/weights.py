"""The rows of a [vocab, dim] matrix that one rank stores, and how they get there.

Shared by the embedding and the LM head (a tied head is a view of the embedding's table).
``table`` is ``[rows + 1, dim]``: this rank's rows in layout order (padding rows zero) followed by
one all-zero *sentinel* row, so a lookup can send every id this rank does not own to the
sentinel and fill zeros in the same gather pass. ``weight`` is ``table[:rows]``. Both are strided
views of ``storage``, whose rows are padded to a multiple of 32 bytes (aligned row starts);
lookups and matmuls use the strided views directly, never a compacted copy.
Quantized tables (int8 / fp8) carry one fp32 scale per row in ``scale``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vocabpar import comm
from vocabpar.layout import VocabLayout

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANT_DTYPES = (torch.int8, *FP8_DTYPES)


def quantize_rows(weight: torch.Tensor, dtype: torch.dtype,
                  first_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization to int8 or fp8: ``weight ≈ q.float() * scale[:, None]``.
    A row holding NaN or ±inf is rejected (``first_id``: the id of row 0, for the message)."""
    if dtype not in QUANT_DTYPES:
        raise ValueError(f"quantized storage must be one of {QUANT_DTYPES}, got {dtype}")
    w = weight.float()
    bad = (~w.isfinite()).any(1).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"cannot quantize: row {first_id + bad[0].item()} holds non-finite values "
                         f"({bad.numel()} such row(s) among ids {first_id}..{first_id + w.shape[0] - 1})")
    top = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    scale = w.abs().amax(dim=1) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = w / scale[:, None]
    q = q.round().clamp(-top, top) if dtype == torch.int8 else q.clamp(-top, top)
    return q.to(dtype), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_rows` into ``dtype`` (the same arithmetic on any row subset)."""
    return (q.float() * scale[..., None]).to(dtype)


class VocabShardedMatrix(nn.Module):
    """This rank's rows of a vocab-sized matrix, over the ranks of ``group``."""

    def __init__(self, layout: VocabLayout, dim: int, *, group: comm.ProcessGroup = None,
                 dtype: torch.dtype = torch.float32, quantized: bool = False,
                 compute_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 share_with: VocabShardedMatrix | None = None, **facts: object) -> None:
        super().__init__()
        if not isinstance(layout, VocabLayout):
            raise TypeError(f"layout must be a VocabLayout, got {type(layout).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if quantized and dtype not in QUANT_DTYPES:
            raise ValueError(f"quantized tables are stored as one of {QUANT_DTYPES}, got {dtype}")
        if not quantized and not (dtype.is_floating_point):
            raise ValueError(f"unquantized tables need a floating dtype, got {dtype}")
        comm.check_world(layout, group)
        me = comm.rank(group)
        self.layout, self.group, self.rank, self.dim = layout, group, me, dim
        self.shard = layout.shard(me)
        self.quantized = quantized
        self.compute_dtype = compute_dtype or (torch.bfloat16 if quantized else dtype)
        if share_with is not None:  # tied weights: the very same storage, no copy
            theirs = (share_with.layout, share_with.dim, share_with.storage.dtype, share_with.quantized)
            if theirs != (layout, dim, dtype, quantized):
                raise ValueError(f"cannot tie: (layout, dim, dtype, quantized) {theirs} != "
                                 f"{(layout, dim, dtype, quantized)}")
            self.storage = share_with.storage
        else:
            per_row = 32 // math.gcd(32, dtype.itemsize)  # elements per 32 bytes
            stride = -(-dim // per_row) * per_row
            self.storage = nn.Parameter(torch.zeros(self.shard.rows + 1, stride, dtype=dtype,
                                                    device=device), requires_grad=False)
        # rows not yet loaded (padding) dequantize to zero with scale 1; the sentinel's scale is 0,
        # so a non-owner's scale bytes are zero too and the bit-pattern sum stays exact
        scale = torch.ones(self.shard.rows + 1, device=device) if quantized else None
        if scale is not None:
            scale[-1] = 0.0
        self.register_buffer("scale", scale)
        comm.verify_consistent(group, **layout.describe(), dim=dim, dtype=str(dtype),
                               quantized=quantized, compute_dtype=str(self.compute_dtype),
                               kind=type(self).__name__, **facts)

    @property
    def table(self) -> torch.Tensor:
        """``[rows + 1, dim]`` strided view: this rank's rows, then the zero sentinel row."""
        return self.storage[:, : self.dim]

    @property
    def weight(self) -> torch.Tensor:
        """``[rows, dim]`` strided view of this rank's rows (without the sentinel row)."""
        return self.storage[: self.shard.rows, : self.dim]

    @property
    def sentinel(self) -> int:
        """Local row index of the all-zero row."""
        return self.shard.rows

    # ------------------------------------------------------------------ loading
    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Copy this rank's rows out of the full ``[vocab_size, dim]`` matrix. A quantized table
        takes either a float matrix (quantized here, row by row) or already-quantized rows in its
        storage dtype with their full per-row ``scale`` ``[vocab_size]``."""
        self._check_shape("weight", tuple(weight.shape), (self.layout.vocab_size, self.dim))
        self._check_scale("scale", None if scale is None else tuple(scale.shape))
        for start, end, local in self.shard.ranges:
            self._put(local, start, weight[start:end], None if scale is None else scale[start:end])

    @torch.no_grad()
    def load_safetensors(self, path: str, name: str, scale_name: str | None = None) -> None:
        """Read only this rank's row ranges of tensor ``name`` from a safetensors file. Every error
        names the file (and the tensor)."""
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                for wanted in (name, scale_name):
                    if wanted is not None and wanted not in f.keys():
                        raise KeyError(f"tensor {wanted!r} not in {path}; it has {sorted(f.keys())[:10]}")
                sliced = f.get_slice(name)
                self._check_shape(f"{name} in {path}", tuple(sliced.get_shape()),
                                  (self.layout.vocab_size, self.dim))
                scales = f.get_slice(scale_name) if scale_name else None
                self._check_scale(scale_name and f"{scale_name} in {path}",
                                  None if scales is None else tuple(scales.get_shape()))
                for start, end, local in self.shard.ranges:
                    self._put(local, start, sliced[start:end], None if scales is None else scales[start:end])
        except (KeyError, ValueError) as e:
            if str(path) in str(e):
                raise
            raise type(e)(f"{path}: {e}") from e
        except Exception as e:  # a missing, unreadable or corrupt file (OSError, SafetensorError)
            raise ValueError(f"cannot read safetensors file {path}: {type(e).__name__}: {e}") from e

    def _check_scale(self, what: str | None, shape: tuple | None) -> None:
        if shape is None:
            return
        if not self.quantized:
            raise ValueError(f"{what}: per-row scales given for an unquantized table (rank {self.rank})")
        self._check_shape(what, shape, (self.layout.vocab_size,))

    def _put(self, local: int, first_id: int, rows: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Store ``rows`` (token ids from ``first_id``) at local row ``local``, quantizing them
        when no scales are given."""
        if self.quantized and scale is None:
            if rows.dtype in QUANT_DTYPES:
                raise ValueError(f"already-quantized rows ({rows.dtype}) need their per-row scales")
            rows, scale = quantize_rows(rows, self.storage.dtype, first_id)
        elif scale is not None and rows.dtype != self.storage.dtype:
            raise ValueError(f"rows given with scales must already be {self.storage.dtype}, got "
                             f"{rows.dtype} (pass float rows without scales to quantize them)")
        if rows.shape[0]:
            self.table[local: local + rows.shape[0]] = rows.to(self.storage.dtype)
            if scale is not None:
                self.scale[local: local + rows.shape[0]] = scale.float()

    def _check_shape(self, what: str, found: tuple, expected: tuple) -> None:
        if found != expected:
            raise ValueError(f"{what}: expected shape {expected}, found {found} (rank {self.rank})")
