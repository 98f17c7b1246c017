"""Launching a compiled Triton kernel with less host work per call.

``jit_fn[grid](*args, **constexprs)`` re-does on every call what only the first call of a problem
needs: binding the arguments to the signature, computing each argument's specialisation, building
the kernel-cache key (which stringifies the compile options), checking the module's globals and
asking the driver for the device. On the H100 machine's host that costs about 120 us of the 160 us
of a warm forward call (flexattn's own Python: about 40 us).

``launch`` keeps, per kernel, the compiled kernel that Triton's own launch chose, under the facts
Triton specialises on (each tensor's dtype and 16-byte alignment; each int's divisibility by 16,
whether it is 1, whether it fits in 32 bits), the constexprs and the launch options. A later call
with the same facts calls the compiled kernel's launcher directly, without launch metadata or the
(empty) launch hooks; any other call, any argument of another kind (a host tensor descriptor), a
launch hook that is set (a profiler) or the interpreter takes Triton's own path. The facts are a
superset of what Triton keys its cache on, so a call can never reach a kernel compiled for another
specialisation: that would be a wrong number, not a slow one.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["launch", "fast_launches"]

fast_launches = 0  # launches that took the direct path (tests check that it runs and stays correct)

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


def launch(jit_fn, grid: tuple, args: tuple, constexprs: dict):
    """``jit_fn[grid](*args, **constexprs)``, directly through the compiled kernel's launcher when a
    launch with the same specialisation facts already went through Triton. Returns the compiled
    kernel that ran (None under the interpreter), whose ``n_spills`` callers may read."""
    global fast_launches
    if not _AVAILABLE or not hasattr(jit_fn, "device_caches"):  # the interpreter's function, or an old Triton
        return jit_fn[grid](*args, **constexprs)
    runtime = _knobs.runtime
    if not (_idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)) or runtime.debug:
        return jit_fn[grid](*args, **constexprs)
    facts = _facts(args)
    if facts is None:
        return jit_fn[grid](*args, **constexprs)
    device = _driver.active.get_current_device()
    key = (device, facts, tuple(constexprs.items()))
    entries = jit_fn.__dict__.setdefault("_flexattn_entries", {})
    entry = entries.get(key)
    if entry is None:
        kernel = jit_fn[grid](*args, **constexprs)
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
