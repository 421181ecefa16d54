"""The LM head: this rank's rows of the output matrix, and the local FP32 logits step.

Invariant: ``local_logits(h)[b, j]`` is the FP32 logit of the token stored at local row ``j``
(``layout.local_token_ids(rank)[j]``), or ``-inf`` where that row is padding.
"""

from __future__ import annotations

import torch

from vocabpar import comm
from vocabpar.layout import VocabLayout
from vocabpar.weights import VocabShardedMatrix

COLUMN_BLOCK = 4096  # weight rows per GEMM call (bounds the FP32 temporary of a bf16 weight)
ROW_BLOCK = 64  # hidden rows per GEMM call in deterministic mode


def matmul_logits(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                  deterministic: bool = False) -> torch.Tensor:
    """``out = hidden @ weight.T`` in FP32, one block of ``COLUMN_BLOCK`` weight rows at a time.

    ``deterministic``: every GEMM call gets the same fixed shape ``[ROW_BLOCK, H] x
    [H, COLUMN_BLOCK]`` (inputs copied into zero-padded buffers), so a logit's bits depend only
    on its hidden row and weight row -- not on the batch, the chunking, the shard or the
    position. Without it, BLAS picks kernels and reduction blocking by shape, and results agree
    with any other split only to FP32 rounding (~1e-6 relative)."""
    h = hidden.float()
    rows, cols = h.shape[0], weight.shape[0]
    if not deterministic:
        for c in range(0, cols, COLUMN_BLOCK):
            w = weight[c: c + COLUMN_BLOCK]
            out[:, c: c + w.shape[0]] = h @ (w if w.dtype == torch.float32 else w.float()).T
        return out
    hb = h.new_zeros(ROW_BLOCK, h.shape[1])
    wb = h.new_zeros(COLUMN_BLOCK, h.shape[1])
    for c in range(0, cols, COLUMN_BLOCK):
        k = min(COLUMN_BLOCK, cols - c)
        wb[:k] = weight[c: c + k]
        wb[k:] = 0
        for r in range(0, rows, ROW_BLOCK):
            m = min(ROW_BLOCK, rows - r)
            hb[:m] = h[r: r + m]
            hb[m:] = 0
            out[r: r + m, c: c + k] = (hb @ wb.T)[:m, :k]
    return out


def reference_logits(hidden: torch.Tensor, weight: torch.Tensor, deterministic: bool = False,
                     bias: torch.Tensor | None = None, softcap: float | None = None,
                     logit_scale: float = 1.0) -> torch.Tensor:
    """Single-device oracle: FP32 ``hidden @ weight.T`` (+ bias, soft-cap, scale) on the full
    ``[vocab_size, H]`` matrix, with the same arithmetic as the sharded head."""
    out = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device)
    return _finish(matmul_logits(hidden, weight, out, deterministic), bias, softcap, logit_scale)


def _finish(logits: torch.Tensor, bias: torch.Tensor | None, softcap: float | None,
            logit_scale: float) -> torch.Tensor:
    """Bias, then tanh soft-cap, then scale (vLLM's order), in place."""
    if bias is not None:
        logits += bias
    if softcap is not None:
        torch.tanh(logits / softcap, out=logits)
        logits *= softcap
    if logit_scale != 1.0:
        logits *= logit_scale
    return logits


class ParallelLMHead(VocabShardedMatrix):
    """Vocab-sharded output projection. Its weights belong to the logits step
    (:func:`vocabpar.compute_logits` or :meth:`local_logits`), so calling it like a layer is an
    error. ``tie_to``: an embedding whose shard this head shares (tied word embeddings)."""

    def __init__(self, layout: VocabLayout, hidden_size: int, *, group: comm.ProcessGroup = None,
                 dtype: torch.dtype = torch.float32, tie_to: VocabShardedMatrix | None = None,
                 bias: bool = False, logit_scale: float = 1.0, softcap: float | None = None,
                 deterministic: bool = False, device: torch.device | str | None = None) -> None:
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be positive or None, got {softcap}")
        if tie_to is not None and tie_to.quantized:
            raise ValueError("a head cannot be tied to a quantized embedding table")
        super().__init__(layout, hidden_size, group=group, dtype=dtype, device=device,
                         share_with=tie_to, bias=bias, logit_scale=logit_scale, softcap=softcap,
                         deterministic=deterministic)
        self.hidden_size, self.logit_scale, self.softcap = hidden_size, float(logit_scale), softcap
        self.deterministic = deterministic
        self.bias = torch.nn.Parameter(torch.zeros(self.shard.rows, device=device),
                                       requires_grad=False) if bias else None
        self.register_buffer("padding_columns", torch.nonzero(layout.local_token_ids(self.rank) < 0)
                             .flatten().to(device), persistent=False)

    @torch.no_grad()
    def load_full_bias(self, bias: torch.Tensor) -> None:
        """Copy this rank's entries of the full ``[vocab_size]`` bias."""
        if self.bias is None:
            raise ValueError("this head was built with bias=False")
        self._check_shape("bias", tuple(bias.shape), (self.layout.vocab_size,))
        for start, end, local in self.shard.ranges:
            self.bias[local: local + end - start] = bias[start:end].float()

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("ParallelLMHead is not a layer: its weights are consumed by the logits "
                           "step. Use vocabpar.compute_logits(head, hidden, strategy=...) or "
                           "head.local_logits(hidden).")

    def check_hidden(self, hidden: torch.Tensor) -> None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
            raise ValueError(f"hidden must be a [rows, hidden_size] tensor, got "
                             f"{getattr(hidden, 'shape', type(hidden).__name__)} (rank {self.rank})")
        if hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden size {hidden.shape[1]} does not match the head's "
                             f"{self.hidden_size} (rank {self.rank})")

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """FP32 ``[B, rows]`` logits for this rank's rows: a view into a buffer whose row stride
        is a multiple of 32 bytes (8 floats)."""
        self.check_hidden(hidden)
        stride = -(-max(self.shard.rows, 1) // 8) * 8
        buffer = torch.empty(hidden.shape[0], stride, dtype=torch.float32, device=hidden.device)
        return self.logits_into(hidden, buffer[:, : self.shard.rows])

    def logits_into(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write this rank's FP32 logits into ``out[:, :rows]`` and ``-inf`` into every padding
        column and every column past ``rows`` (so shards padded to a common width stay inert)."""
        rows = self.shard.rows
        _finish(matmul_logits(hidden, self.weight, out[:, :rows], self.deterministic),
                self.bias, self.softcap, self.logit_scale)
        out[:, rows:] = float("-inf")
        out[:, self.padding_columns] = float("-inf")
        return out


def select_rows(hidden: torch.Tensor, seq_lens: torch.Tensor | None = None, *,
                output_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of a packed ``[T, H]`` batch that need logits: the last token of each sequence
    (``cumsum(seq_lens) - 1``), or the arbitrary rows ``output_ids`` (e.g. prompt logprobs)."""
    if (seq_lens is None) == (output_ids is None):
        raise ValueError("give exactly one of seq_lens or output_ids")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"select_rows: hidden must be packed [T, H] (the sequences' tokens one after "
                         f"another), got shape {tuple(getattr(hidden, 'shape', ()))}: for [B, L, H] of "
                         f"equal-length sequences pass hidden.reshape(-1, H) and seq_lens [L] * B")
    total = hidden.shape[0]
    if seq_lens is not None:
        lens = _int_vector(seq_lens, "seq_lens")
        if bool((lens <= 0).any()):
            first = int(torch.nonzero(lens <= 0)[0])
            raise ValueError(f"seq_lens must be positive; sequence {first} has length {int(lens[first])}")
        if int(lens.sum()) != total:
            raise ValueError(f"seq_lens sum to {int(lens.sum())} but hidden has {total} rows: hidden must be "
                             f"packed [T, H] with T = sum(seq_lens)")
        rows = lens.cumsum(0) - 1
    else:
        rows = _int_vector(output_ids, "output_ids")
        bad = (rows < 0) | (rows >= total)
        if bool(bad.any()):
            first = int(torch.nonzero(bad)[0])
            raise ValueError(f"output_ids[{first}] = {int(rows[first])} is outside [0, {total})")
    return hidden.index_select(0, rows.to(hidden.device))


def _int_vector(values: torch.Tensor | list[int], name: str) -> torch.Tensor:
    t = torch.as_tensor(values)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} with shape {tuple(t.shape)}")
    return t.long()
