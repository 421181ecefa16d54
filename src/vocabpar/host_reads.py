"""Count the host reads of device values a block of PyTorch code makes.

On a GPU each of these waits for the device to finish (a synchronisation of ~10–30 µs that also
stalls an engine's asynchronous scheduling and rules out CUDA graphs): reading a value
(``item``, ``tolist``, ``bool(t)``, ``int(t)``, ``float(t)``, ``t.__index__``), copying to the
host (``cpu``, ``numpy``), and every op whose output size depends on the data (``nonzero``,
``argwhere``, ``masked_select``, ``unique``, indexing or assigning through a boolean mask,
``repeat_interleave`` without ``output_size``). The counter sees them on the CPU too, so a CPU
test pins what a GPU run would pay.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
          "argwhere", "masked_select", "unique", "unique_consecutive"}
_MASKABLE = {"__getitem__", "__setitem__", "index_put", "index_put_"}


def _has_mask(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    if isinstance(value, (tuple, list)):
        return any(_has_mask(v) for v in value)
    return False


def _is_read(func: object, args: tuple, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    if name in _READS:
        return True
    if name in _MASKABLE:
        return len(args) > 1 and _has_mask(args[1])
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    return False


class _Mode(TorchFunctionMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_read(func, args, kwargs):
            self.counts[getattr(func, "__name__", str(func))] += 1
        return func(*args, **kwargs)


@contextmanager
def counting() -> Iterator[Counter]:
    """Yield a ``Counter`` of the host reads (by op name) made inside the block;
    ``sum(counter.values())`` is the total."""
    counts: Counter = Counter()
    with _Mode(counts):
        yield counts
