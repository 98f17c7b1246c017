"""Launching kernels: the direct launch, output buffers, the mods' arguments, and the facts of a
launch that later plans read (spills, out-of-resources errors).

[Note] Direct launches. Launching a compiled Triton kernel with less host work per call.

``jit_fn[grid](*args, **constexprs)`` re-does on every call what only the first call of a problem
needs: binding the arguments to the signature, computing each argument's specialisation, building
the kernel-cache key (which stringifies the compile options), checking the module's globals and
asking the driver for the device. That was most of a warm forward call's host time, several
times flexattn's own Python (docs/benchmarks_log.md, "Host time of a warm call: launching without
Triton's per-call binding (2026-11-24)").

``launch`` keeps, per kernel, the compiled kernel that Triton's own launch chose, under the facts
Triton specialises on (each tensor's dtype and 16-byte alignment; each int's divisibility by 16,
whether it is 1, whether it fits in 32 bits; a Gluon tensor descriptor's dtype, block shape, shared
layout and padding; a host tensor descriptor's dtype and block shape: their only specialisation on
Triton 3.6 to 3.9, tests/test_launch.py), the constexprs and the launch options. A later call with
the same facts calls the compiled kernel's launcher directly, without launch metadata or the (empty)
launch hooks; any other call, any argument of another kind, a launch hook that is set (a profiler)
or the interpreter takes Triton's own path. The facts are a
superset of what Triton keys its cache on, so a call can never reach a kernel compiled for another
specialisation: that would be a wrong number, not a slow one.

[Note] Ready launches. A warm call of the compiled forward op ([Note] Warm calls of the forward op in
compile/warm.py) repeats a launch whose every fact its key already fixes: the ints and floats (strides,
lengths, the scale) are the same values, the tensors the same dtypes and alignment, the descriptors
the same dtype and block shape. ``RepeatedLaunch`` goes through ``launch`` the first time, then looks
up the compiled kernel that launch used (``ready_launch``); the ``ReadyLaunch`` it keeps launches new
tensors without computing the facts again. The caller owns that promise, and passes what its key
cannot fix (its fresh buffers' alignment). Everything ``launch`` sends Triton's own way (a launch
hook, the debug knob, kernels compiling ahead, another current device) it still does. The warm
calls also copy their descriptors from templates (``descriptor_template``, ``descriptor_over``)
rather than building and checking them again. With the shapes, strides and launch-order ints the
families' warm launches work out once (kernels/forward.py, kernels/hopper/forward.py), a warm op
body's host time dropped by about half, for the portable and the Gluon forward (docs/benchmarks_log.md,
"Ready launches for warm forward calls, and where the compiled 4k step has slack").

[Note] Compile options. Every launch on Triton's own path names ``COMPILE_OPTIONS``: FP fusion
(a * b + c as one FMA) on, which is what the kernels were tuned and checked under. It is Triton's
default up to 3.9, but 3.9 warns on every process's first compile that the default turns off in
3.10, and a user setting ``TRITON_DEFAULT_FP_FUSION=0`` for their own kernels would otherwise slow
ours and change their rounding. An option the launch names is part of Triton's cache key like any
other, so kernels compiled ahead (kernels/ahead.py) carry it too.
"""

from __future__ import annotations

import os
import threading
from typing import Optional, Sequence

import torch

from ..cuda_graphs import may_keep_allocations, stream_key
from .ahead import pending, record, recording, wait_for

__all__ = [
    "launch", "fast_launches", "RepeatedLaunch", "descriptor_over", "descriptor_template", "interpreter_enabled",
    "empty_output", "empty_strided_output", "kept_scratch", "zeroed_output", "output_layout", "empty_attention_output",
    "attention_output_spec", "finished_output", "in_output_layout", "mod_launch_args", "kv_strides", "FLOAT8_DTYPES",
    "is_out_of_resources", "spilled_bytes", "shared_bytes",
]

fast_launches = 0  # launches that took the direct path (tests check that it runs and stays correct)

COMPILE_OPTIONS = {"enable_fp_fusion": True}  # [Note] Compile options

_MAX_ENTRIES = 512  # per kernel; cleared when full (a new entry costs one ordinary launch)


def _facts(args) -> Optional[tuple]:
    """What Triton's specialisation can depend on, per argument; None for an argument of a kind this
    path does not handle. Ints first: most arguments are strides and lengths."""
    facts = []
    append = facts.append
    for a in args:
        kind = type(a)
        if kind is int:
            append((a & 15 == 0, a == 1, -2147483648 <= a <= 2147483647))
        elif kind is float:
            append(float)
        elif isinstance(a, torch.Tensor):
            append((a.dtype, a.data_ptr() & 15 == 0))
        elif kind is bool:
            append((bool, a))
        elif kind.__name__ == "TensorDescriptor" and kind.__module__.startswith("triton.experimental.gluon"):
            # The Gluon kernels' descriptors (1 to 7 a launch): ~100 us of Triton's own launch each call.
            append((kind, a.base.dtype, tuple(a.block_shape), a.layout, getattr(a, "padding", None), len(a.shape)))
        elif kind.__name__ == "TensorDescriptor" and kind.__module__ == "triton.tools.tensor_descriptor":
            # The portable forward's host descriptors (4 a launch, [Note] Host descriptors in the
            # forward template): specialised on dtype and block shape only; padding and rounding kept
            # too, though Triton reads them at launch.
            append((kind, a.base.dtype, tuple(a.block_shape), a.padding, getattr(a, "round_f32_to_tf32", None),
                    len(a.shape)))
        else:
            return None
    return tuple(facts)


class _Entry:
    __slots__ = ("kernel", "tail")

    def __init__(self, kernel, tail: tuple):
        self.kernel = kernel
        self.tail = tail  # the constexprs' values in signature order (Triton's launcher skips them)


def _idle(hook) -> bool:
    """No launch hook set: None, or (Triton 3.5 and later) an empty HookChain, which Triton's own
    launch still calls and builds launch metadata for on every call."""
    return hook is None or getattr(hook, "calls", None) == []


try:  # Triton 3.4 and later; before, every launch is Triton's own
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
except ImportError:  # pragma: no cover
    _knobs = _driver = None
_AVAILABLE = _knobs is not None


def _triton_launch(jit_fn, grid: tuple, args: tuple, constexprs: dict):
    """Triton's own launch of ``jit_fn`` (a JITFunction), with the compile options ([Note] Compile options)."""
    return jit_fn[grid](*args, **constexprs, **COMPILE_OPTIONS)


def launch(jit_fn, grid: tuple, args: tuple, constexprs: dict):
    """``jit_fn[grid](*args, **constexprs)``, directly through the compiled kernel's launcher when a
    launch with the same specialisation facts already went through Triton. Returns the compiled
    kernel that ran (None under the interpreter, and when recording: [Note] Kernels compiled ahead in
    kernels/ahead.py), whose ``n_spills`` callers may read."""
    global fast_launches
    if not _AVAILABLE or not hasattr(jit_fn, "device_caches"):  # the interpreter's function, or an old Triton
        return jit_fn[grid](*args, **constexprs)
    if pending:  # kernels the compile workers still hold (kernels/ahead.py)
        if recording():
            return record(jit_fn, grid, args, {**constexprs, **COMPILE_OPTIONS})
        wait_for(jit_fn)
    elif recording():
        return record(jit_fn, grid, args, {**constexprs, **COMPILE_OPTIONS})
    runtime = _knobs.runtime
    if not (_idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)) or runtime.debug:
        return _triton_launch(jit_fn, grid, args, constexprs)
    facts = _facts(args)
    if facts is None:
        return _triton_launch(jit_fn, grid, args, constexprs)
    device = _driver.active.get_current_device()
    key = (device, facts, tuple(constexprs.items()))
    entries = jit_fn.__dict__.setdefault("_flexattn_entries", {})
    entry = entries.get(key)
    if entry is None:
        kernel = _triton_launch(jit_fn, grid, args, constexprs)
        names = getattr(jit_fn, "arg_names", None)
        if kernel is None or names is None or len(names) < len(args):
            return kernel
        rest = names[len(args):]
        if any(name not in constexprs for name in rest):  # a parameter left to its default: not handled here
            return kernel
        if len(entries) >= _MAX_ENTRIES:
            entries.clear()
        entries[key] = _Entry(kernel, tuple(constexprs[name] for name in rest))
        return kernel
    kernel = entry.kernel
    stream = _driver.active.get_current_stream(device)
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    kernel.run(grid[0], grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, None, None, None,
               *args, *entry.tail)
    fast_launches += 1
    return kernel


def ready_launch(jit_fn, grid: tuple, args: tuple, constexprs: dict) -> Optional["ReadyLaunch"]:
    """The launch ``launch(jit_fn, grid, args, constexprs)`` just made, ready to repeat with new
    arguments of the same facts ([Note] Ready launches); None where ``launch`` kept no compiled kernel
    for it (the interpreter, an old Triton, a launch Triton's own path took)."""
    entries = getattr(jit_fn, "_flexattn_entries", None) if _AVAILABLE else None
    if not entries:
        return None
    facts = _facts(args)
    device = _driver.active.get_current_device()
    entry = None if facts is None else entries.get((device, facts, tuple(constexprs.items())))
    return None if entry is None else ReadyLaunch(jit_fn, grid, constexprs, entry, device)


class ReadyLaunch:
    """``launch`` of one kernel, grid and constexprs for arguments whose facts are known to be those
    of the launch it was made from ([Note] Ready launches)."""

    __slots__ = ("jit_fn", "grid", "constexprs", "kernel", "tail", "device")

    def __init__(self, jit_fn, grid: tuple, constexprs: dict, entry: _Entry, device: int):
        self.jit_fn, self.constexprs, self.device = jit_fn, constexprs, device
        self.kernel, self.tail = entry.kernel, entry.tail
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)

    def __call__(self, args: tuple):
        global fast_launches
        runtime = _knobs.runtime
        if (pending or recording() or runtime.debug or not (_idle(runtime.launch_enter_hook)
                                                            and _idle(runtime.launch_exit_hook))):
            return launch(self.jit_fn, self.grid, args, self.constexprs)
        device = _driver.active.get_current_device()
        if device != self.device:
            return launch(self.jit_fn, self.grid, args, self.constexprs)
        kernel = self.kernel
        x, y, z = self.grid
        kernel.run(x, y, z, _driver.active.get_current_stream(device), kernel.function, kernel.packed_metadata,
                   None, None, None, *args, *self.tail)
        fast_launches += 1
        return kernel


class RepeatedLaunch:
    """``launch`` of one kernel, grid and constexprs, for a caller that repeats it with arguments of
    the same facts (a warm call, [Note] Ready launches): Triton's way the first time, ready after."""

    __slots__ = ("jit_fn", "grid", "constexprs", "ready", "tried")

    def __init__(self, jit_fn, grid: tuple, constexprs: dict):
        self.jit_fn, self.grid, self.constexprs = jit_fn, grid, constexprs
        self.ready: Optional[ReadyLaunch] = None
        self.tried = False

    def __call__(self, args: tuple, fresh_aligned: bool):
        """``fresh_aligned``: the call's own new buffers are 16-byte aligned, the one fact the
        caller's key cannot fix."""
        if self.ready is not None and fresh_aligned:
            return self.ready(args)
        kernel = launch(self.jit_fn, self.grid, args, self.constexprs)
        if not self.tried:
            self.ready, self.tried = ready_launch(self.jit_fn, self.grid, args, self.constexprs), True
        return kernel


def descriptor_template(descriptor):
    """``descriptor`` (a Triton host or Gluon tensor descriptor) without its tensor, for
    ``descriptor_over``; None for a Triton whose descriptors cannot be copied so (then build each
    one). A kept descriptor must not hold the call's tensor: that would keep it alive, and inside a
    CUDA-graph capture its memory belongs to the graph's pool."""
    state = getattr(descriptor, "__dict__", None)
    if state is None or "base" not in state:
        return None
    template = object.__new__(type(descriptor))
    template.__dict__.update(state)
    template.base = None
    return template


def descriptor_over(template, base: torch.Tensor):
    """A descriptor like ``template`` (from descriptor_template) over ``base``, a tensor of the
    dtype, shape and strides of the one it was made for, without the constructor's checks: they
    passed for that one (about 3 us of host time a descriptor)."""
    descriptor = object.__new__(type(template))
    descriptor.__dict__.update(template.__dict__)
    descriptor.base = base
    return descriptor


def interpreter_enabled() -> bool:
    """Kernels run in Triton's interpreter (TRITON_INTERPRET=1: on the CPU, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Tests set FLEXATTN_POISON_OUTPUTS=1: outputs start as NaN, so an element a kernel forgets to
# write fails the comparison instead of passing on whatever the allocator left there.
_POISON_OUTPUTS = os.environ.get("FLEXATTN_POISON_OUTPUTS", "0") not in ("", "0")


def empty_output(shape, dtype, device) -> torch.Tensor:
    """A buffer every element of which a kernel writes (NaN-filled under FLEXATTN_POISON_OUTPUTS; on
    the meta device while launches are recorded, see kernels/ahead.py)."""
    if recording():
        return torch.empty(shape, dtype=dtype, device="meta")
    if _POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def empty_strided_output(shape: tuple, strides: tuple, dtype, device) -> torch.Tensor:
    """``empty_output`` with these strides (the layout of an output made before: one allocation, no
    view on top)."""
    if recording():
        return torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    out = torch.empty_strided(shape, strides, dtype=dtype, device=device)
    return out.fill_(float("nan")) if _POISON_OUTPUTS else out


def output_layout(q: torch.Tensor, value_dim: int) -> tuple:
    """``(storage shape, dims)``: attention's output [B, H, L, value_dim] for query ``q`` is
    ``storage.permute(dims)``.

    [Note] The output's layout. The output is stored as q is: [B, L, H, Ev] storage (each row holds
    every head) when q is a transposed view of such storage, as a model's q cut from one projection
    is; [B, H, L, Ev] otherwise. The model's next step, ``out.transpose(1, 2).reshape(B, L, H * Ev)``,
    is then a view rather than a copy, and its gradient reaches the backward in that layout too,
    which the kernels read as it is. torch's flex_attention keeps the query's layout as well. The op's
    fake implementation (compile/ops.py) asks this function, so compiled graphs see the same strides."""
    B, H, L = q.shape[:3]
    if q.stride(1) < q.stride(2):
        return (B, L, H, value_dim), (0, 2, 1, 3)
    return (B, H, L, value_dim), (0, 1, 2, 3)


# The FP8 formats the kernels read (torch's names; Triton's fp8e4nv and fp8e5).
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def empty_attention_output(q: torch.Tensor, value_dim: int) -> torch.Tensor:
    """An ``empty_output`` for attention's output, in the layout of [Note] The output's layout, and in
    the query's dtype, but float32 for an FP8 query under the interpreter, whose float32 to FP8
    conversion drops the carry into the exponent (1.97 becomes 1.0 in Triton 3.6 to 3.9): there
    ``finished_output`` converts with torch."""
    shape, dims = output_layout(q, value_dim)
    return empty_output(shape, _attention_output_dtype(q), q.device).permute(dims)


def attention_output_spec(q: torch.Tensor, value_dim: int) -> tuple[tuple, tuple, torch.dtype]:
    """``(shape, strides, dtype)`` of ``empty_attention_output(q, value_dim)``, without allocating it:
    for ``empty_strided_output`` (one allocation, no view on top) in a launch worked out once."""
    storage, dims = output_layout(q, value_dim)
    strides, step = [0] * 4, 1
    for d in reversed(range(4)):
        strides[d], step = step, step * storage[d]
    return tuple(storage[d] for d in dims), tuple(strides[d] for d in dims), _attention_output_dtype(q)


def _attention_output_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float32 if q.dtype in FLOAT8_DTYPES and interpreter_enabled() else q.dtype


def finished_output(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The output a kernel wrote into ``empty_attention_output(q, ...)``, in the query's dtype."""
    return out if out.dtype == q.dtype else out.to(q.dtype)


def in_output_layout(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``out`` with exactly the strides of [Note] The output's layout: itself when it has them (the
    kernels allocate it so), else a copy (a path that computed it with PyTorch ops)."""
    shape, dims = output_layout(q, out.shape[-1])
    stride, step = [0] * 4, 1
    for d in reversed(range(4)):
        stride[d], step = step, step * shape[d]
    if tuple(out.stride()) == tuple(stride[d] for d in dims):
        return out
    return torch.empty(shape, dtype=out.dtype, device=out.device).permute(dims).copy_(out)


# [Note] Kept scratch. Buffers that one call's kernels write and read back before the call returns
# (the decode kernels' split partials: the partial kernel writes every entry, the merge reads them)
# hold nothing from one call to the next, so a thread keeps one set per device, stream and shape
# instead of allocating it at every call. Safe because each call writes before it reads, on one
# stream: the next call's first kernel runs after this call's last one by stream order. Per
# thread, because two threads enqueueing on one stream could interleave one call's write with the
# other's read; per stream, because two streams run unordered. Nothing is kept where
# flexattn/cuda_graphs.py forbids it (inside a capture, which needs buffers the graph owns, or on a
# CUDA-graph tree's stream, whose allocations go to the graph's pool) or while launches are only
# recorded: there every call allocates. Under FLEXATTN_POISON_OUTPUTS kept buffers are NaN-filled
# again at each call, so an entry a kernel forgets to write still shows.
_kept_scratch = threading.local()
_SCRATCH_SETS_KEPT = 8  # per thread: (device, stream, shapes, dtype) sets; cleared when full


def kept_scratch(shapes: tuple, dtype, device) -> tuple:
    """Buffers of ``shapes`` (a tuple of shapes, each a tuple) and ``dtype`` on ``device`` for the
    kernels of one call to write and then read ([Note] Kept scratch): this thread's kept set for the
    device's current stream, or new ``empty_output``s where nothing may be kept."""
    device = torch.device(device)
    if recording() or not may_keep_allocations(device):
        return tuple(empty_output(shape, dtype, device) for shape in shapes)
    kept = getattr(_kept_scratch, "sets", None)
    if kept is None:
        kept = _kept_scratch.sets = {}
    key = (device, stream_key(device), shapes, dtype)
    buffers = kept.get(key)
    if buffers is None:
        if len(kept) >= _SCRATCH_SETS_KEPT:
            kept.clear()
        buffers = kept[key] = tuple(empty_output(shape, dtype, device) for shape in shapes)
    elif _POISON_OUTPUTS:
        for buffer in buffers:
            buffer.fill_(float("nan"))
    return buffers


def zeroed_output(shape, dtype, device) -> torch.Tensor:
    """A buffer kernels add into, zero-filled (on the meta device while launches are recorded)."""
    return torch.zeros(shape, dtype=dtype, device="meta" if recording() else device)


def mod_launch_args(*captured: Sequence) -> list:
    """The mods' extra kernel arguments, in the order of their LoweredMod.kernel_params: each
    captured tensor, then its strides; each number the mod reads, its value. The tensors are
    already on the query's device (user tensors are checked by the API, a mod's own constants moved
    by TracedMod.fixed_values_on)."""
    args = []
    for values in captured:
        for t in values:
            if isinstance(t, torch.Tensor):
                args.append(t)
                args.extend(t.stride())
            else:
                args.append(t)
    return args


def kv_strides(k: torch.Tensor, v: torch.Tensor, batch: int) -> tuple[tuple, tuple]:
    """K's and V's strides as the kernels take them: a key/value batch of 1 broadcast over the
    queries' batch gets batch stride 0, so every query batch re-reads the same rows."""
    k_strides, v_strides = k.stride(), v.stride()
    if k.shape[0] == 1 and batch > 1:
        k_strides, v_strides = (0,) + k_strides[1:], (0,) + v_strides[1:]
    return k_strides, v_strides


def is_out_of_resources(err: Exception) -> bool:
    """The compiler found the kernel too large for the GPU (shared memory, registers)."""
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover - every supported Triton has it
        return False
    return isinstance(err, OutOfResources)


def spilled_bytes(kernel) -> int:
    """Bytes of local memory per thread of a compiled Triton kernel (0 when unknown: the interpreter)."""
    return getattr(kernel, "n_spills", 0) or 0


def shared_bytes(kernel) -> int:
    """Bytes of shared memory a compiled Triton kernel uses (0 when unknown: the interpreter)."""
    return getattr(getattr(kernel, "metadata", None), "shared", 0) or 0
