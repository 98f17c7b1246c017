"""The peak of live tensor bytes of one thread, on any device: what a rank's code allocates.

    with LiveBytes() as live:
        live.hold(q, k, v, grad_out)       # tensors made before, counted as held
        out = cp.flex_attention(q, k, v); out.backward(grad_out)
    live.peak                               # bytes

A TorchDispatchMode sees every tensor an op returns; each new storage is counted until it is
freed (a weak reference to it expires). Views add nothing, and what kernels allocate outside torch
(the Triton interpreter's copies) is not counted, as on a GPU it does not exist. The mode is the
thread's own, so ranks run as threads of one process each have their own count. The peak is read
after each op, before its outputs could be freed: the largest number of bytes alive at once, not
rounded up to the caching allocator's blocks (``torch.cuda.max_memory_allocated`` rounds to 512
bytes and sees every thread).

``collect=True`` runs the garbage collector before each op that allocates: Triton's interpreter
keeps a launch's arguments in a reference cycle until it runs, which on a GPU (no interpreter)
would not hold them. The CPU measurements use it; it costs about a millisecond an allocation.
"""

from __future__ import annotations

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Live tensor bytes of the ops run under it (see the module docstring)."""

    # Ops that make a new buffer rather than compute into one: where a peak can rise.
    _ALLOCATING = ("empty", "zeros", "ones", "full", "new_", "_to_copy", "clone", "cat", "contiguous")

    def __init__(self, collect: bool = False) -> None:
        super().__init__()
        self.collect = collect
        self._live: dict = {}  # storage address -> (weak reference, bytes)
        self.now = self.peak = 0

    def hold(self, *tensors: torch.Tensor) -> None:
        """Count tensors made before the mode (a rank's inputs) as live while they are."""
        for t in tensors:
            self._add(t)
        self.peak = max(self.peak, self.now)

    def reset_peak(self) -> None:
        self._prune()
        self.peak = self.now

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in self._live:
            return
        self._live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.now += storage.nbytes()

    def _prune(self) -> None:
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            self.now -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.collect and any(name in func.__name__ for name in self._ALLOCATING):
            gc.collect()
        out = func(*args, **(kwargs or {}))
        self._prune()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t)
        self.peak = max(self.peak, self.now)
        return out
