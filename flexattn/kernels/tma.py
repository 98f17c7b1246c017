"""Tensor descriptors (Hopper's copy engine, TMA): when a launch may use them, the descriptors the
launcher builds on the host, and the scratch memory that descriptors built in a kernel need."""

from __future__ import annotations

import threading

import torch

from ..cuda_graphs import may_keep_allocations
from .launch import interpreter_enabled

__all__ = ["tma_layout_ok", "tma_compatible", "host_descriptors_ok", "host_descriptors", "install_tma_allocator"]


def tma_layout_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Q, K, V and the output (V's head dim, in either layout of [Note] The output's layout in
    launch.py) can all go through tensor descriptors."""
    return tma_compatible(q, k, v) and (v.shape[-1] * q.element_size()) % 16 == 0


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need Hopper or newer, a unit last stride and 16-byte aligned rows."""
    first = tensors[0]
    if interpreter_enabled() or not first.is_cuda or torch.cuda.get_device_capability(first.device)[0] < 9:
        return False
    # Plans are keyed by shapes and strides: only the base addresses can change between two calls
    # that share a plan, and each launch re-checks just those.
    for t in tensors:
        elem = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or (t.stride(-2) * elem) % 16 or (t.shape[-1] * elem) < 16:
            return False
        if any((s * elem) % 16 for s in t.stride()[:2] if s):
            return False
    return True


def host_descriptors_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # See [Note] Host descriptors in the forward template. The launcher encodes 4-D descriptors,
    # which need every stride non-zero (an expanded batch or head has stride 0) and 16-byte aligned.
    if not tma_layout_ok(q, k, v):
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return all(s > 0 for t in (q, k, v) for s in t.stride())


def host_descriptors(q, k, v, out, constexprs):
    """4-D descriptors [Z, H, LEN, D] of Q, K, V and the output, with the launch's tiles as blocks
    (None for an ``out`` of None: a kernel that reads and writes its output through pointers)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn = constexprs["BLOCK_M"], constexprs["BLOCK_N"]
    dq, dv = constexprs["QK_HEAD_DIM_P2"], constexprs["V_HEAD_DIM_P2"]
    return (
        TensorDescriptor(q, list(q.shape), list(q.stride()), [1, 1, bm, dq]),
        TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, bn, dq]),
        TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, bn, dv]),
        None if out is None else TensorDescriptor(out, list(out.shape), list(out.stride()), [1, 1, bm, dv]),
    )


# triton.set_allocator sets a context variable: each thread needs its own call. The backward runs
# in autograd's worker thread, and users may call from several threads.
_tma_allocator_threads = threading.local()
_tma_scratch: dict = {}  # stream handle -> int8 buffer


def _tma_scratch_for(size: int, alignment: int, stream) -> torch.Tensor:
    # Device-side tensor descriptors need global scratch for every launch. Launches on one stream
    # run in order, so one buffer per stream, grown when needed, serves them all and saves a
    # caching-allocator round trip per call (a few microseconds of host time). A capture gets a
    # buffer of its own, in the graph's pool: the graph keeps the pointer, and a kept buffer may be
    # grown (freed) later. A graph tree's warm-up gets one for the launch alone (flexattn/cuda_graphs.py).
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(max(size, 1), dtype=torch.int8, device="cuda")
    buf = _tma_scratch.get(stream)
    if buf is None or buf.numel() < size:
        buf = torch.empty(max(size, 1 << 16), dtype=torch.int8, device="cuda")
        if may_keep_allocations(buf.device):
            _tma_scratch[stream] = buf
    return buf


def install_tma_allocator() -> None:
    """Make sure this thread's Triton has the scratch allocator that device-side descriptors need."""
    if not getattr(_tma_allocator_threads, "installed", False):
        import triton

        triton.set_allocator(_tma_scratch_for)
        _tma_allocator_threads.installed = True
