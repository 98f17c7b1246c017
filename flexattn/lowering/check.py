"""CHECK_INDICES: find the gathers of a mod that read outside a captured tensor, before a call runs.

torch raises an IndexError for ``bias[i]`` with ``i`` outside ``[-n, n)``; a kernel cannot raise, and
every backend reads 0 there instead (negative indices wrap, as in torch; trace.gather_or_zero is
the rule on the PyTorch backend, the reference and the BlockMask builder). This debug mode, turned on by
``kernel_options={"CHECK_INDICES": True}`` or ``FLEXATTN_CHECK_INDICES=1``, evaluates each traced
mod with torch over every ``(b, h, q_idx, kv_idx)`` of the call and raises an InvalidInputError that
names the mod, its line, the tensor, the index and one position where it is out of range.

It runs the traced graph (what the kernels run) under ``torch.vmap`` in tiles, on the query's
device, with int64 indices (integer arithmetic on indices is exact, as in the kernels). Each
``aten.index`` of the graph also returns whether its index is out of range, and reads at the
index wrapped into range, so the evaluation itself never faults (a CUDA gather out of range
would end the process with a device-side assert). The score_mod sees a score of 0: an index
computed from the score is checked at that value only.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.fx

from ..errors import InvalidInputError
from .sites import describe_site
from ..trace import TracedMod

__all__ = ["check_indices", "TILE_ELEMENTS"]

TILE_ELEMENTS = 1 << 22  # (b, h, q, kv) positions per vmapped tile: a few int64 temporaries of this size

_INDEX = torch.ops.aten.index.Tensor


class _Site:
    """One index argument of one aten.index node: which tensor and dim it reads."""

    def __init__(self, node: torch.fx.Node, position: int):
        self.node, self.position = node, position

    def tensor_name(self) -> str:
        source = self.node.args[0]
        while isinstance(source, torch.fx.Node) and source.op != "placeholder" and source.args:
            source = source.args[0]  # a view, slice or gather of a captured tensor: name the tensor
        return source.name if isinstance(source, torch.fx.Node) else "a tensor"


class _CheckedGathers(torch.fx.Interpreter):
    """Runs a traced mod; every aten.index reads at its index wrapped into range and records
    whether the index was out of range (a bool per position, batched like the mod's values)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.out_of_range: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        self.sites: list[_Site] = []

    def run_node(self, n: torch.fx.Node):
        if n.op != "call_function" or n.target is not _INDEX:
            return super().run_node(n)
        src, indices = self.fetch_args_kwargs_from_env(n)[0][:2]
        safe = []
        for position, index in enumerate(indices):
            if index is None or index.dtype == torch.bool or index.dtype.is_floating_point:
                safe.append(index)
                continue
            size = src.shape[position]
            self.out_of_range.append((index < -size) | (index >= size))
            self.indices.append(index)
            self.sites.append(_Site(n, position))
            safe.append(torch.remainder(index, size) if size else index)
        return _INDEX(src, safe)


def _vmapped(traced: TracedMod, captured: list, with_indices: bool):
    """fn(b, h, q_idx, kv_idx) -> (value, *out_of_range[, *indices]) over 1-D index ranges."""
    sites: list[_Site] = []

    def one(b, h, q_idx, kv_idx):
        interpreter = _CheckedGathers(traced.graph_module_on(b.device))
        args = (torch.zeros((), dtype=torch.float32, device=b.device), b, h, q_idx, kv_idx)
        if traced.kind == "mask_mod":
            args = args[1:]
        value = interpreter.run(*args, *captured)
        sites[:] = interpreter.sites
        return (value, *interpreter.out_of_range, *(interpreter.indices if with_indices else ()))

    fn = one
    for in_dims in [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]:
        fn = torch.vmap(fn, in_dims=in_dims, out_dims=0)
    return fn, sites


def _tiles(B: int, H: int, L: int, S: int):
    """(b, h, q, kv) ranges covering the call, each at most about TILE_ELEMENTS positions."""
    kv_step = min(S, TILE_ELEMENTS)
    q_step = min(L, max(1, TILE_ELEMENTS // kv_step))
    h_step = min(H, max(1, TILE_ELEMENTS // (kv_step * q_step)))
    b_step = min(B, max(1, TILE_ELEMENTS // (kv_step * q_step * h_step)))
    starts = itertools.product(range(0, B, b_step), range(0, H, h_step), range(0, L, q_step), range(0, S, kv_step))
    for b0, h0, q0, k0 in starts:
        yield ((b0, min(B, b0 + b_step)), (h0, min(H, h0 + h_step)), (q0, min(L, q0 + q_step)),
               (k0, min(S, k0 + kv_step)))


def _first_problem(traced: TracedMod, captured: list, B: int, H: int, L: int, S: int, device) -> Optional[tuple]:
    """(site, position, index value) of the first out-of-range gather found, or None."""
    fn, sites = _vmapped(traced, captured, with_indices=False)
    ranges = [torch.arange(n, dtype=torch.int64, device=device) for n in (B, H, L, S)]
    found = None  # one device->host copy per tile that has a gather at all
    with torch.no_grad():
        for tile in _tiles(B, H, L, S):
            args = [r[lo:hi] for r, (lo, hi) in zip(ranges, tile)]
            _, *flags = fn(*args)
            if not flags:
                return None  # the mod gathers nothing: nothing can be out of range
            bad = torch.stack([f.any() for f in flags]).tolist()
            if any(bad):
                found = tile, bad
                break
    if found is None:
        return None
    tile, bad = found
    site_number = bad.index(True)
    args = [r[lo:hi] for r, (lo, hi) in zip(ranges, tile)]
    fn, _ = _vmapped(traced, captured, with_indices=True)
    with torch.no_grad():
        outputs = fn(*args)
    flags, indices = outputs[1:1 + len(sites)], outputs[1 + len(sites):]
    where = torch.nonzero(flags[site_number].expand(*(hi - lo for lo, hi in tile)))[0].tolist()
    position = [lo + offset for (lo, _), offset in zip(tile, where)]
    value = int(indices[site_number].expand(*(hi - lo for lo, hi in tile))[tuple(where)])
    return sites[site_number], position, value


def check_indices(traced: TracedMod, captured: list, B: int, H: int, L: int, S: int, device: torch.device) -> None:
    """Raise InvalidInputError if any gather of ``traced`` reads out of range in this call."""
    if not any(n.op == "call_function" and n.target is _INDEX for n in traced.graph.nodes):
        return
    problem = _first_problem(traced, captured, B, H, L, S, device)
    if problem is None:
        return
    site, (b, h, q_idx, kv_idx), value = problem
    src = site.node.args[0]
    size = src.meta["val"].shape[site.position] if isinstance(src, torch.fx.Node) and "val" in src.meta else None
    tensor = site.tensor_name()
    valid = f"[{-size}, {size})" if size is not None else "its range"
    raise InvalidInputError(
        f"CHECK_INDICES: {traced.kind} '{traced.name}' reads {tensor} at index {value} in dim {site.position} "
        f"(size {size}), outside {valid}, at b={b}, h={h}, q_idx={q_idx}, kv_idx={kv_idx} (the read is "
        f"{'; '.join(describe_site(traced, site.node))}). torch raises an IndexError there, and flexattn reads 0 "
        f"instead. Fix the mod so the index stays in range for every position of the call (B={B}, H={H}, "
        f"Q_LEN={L}, KV_LEN={S}): make {tensor} large enough, or clamp the index, e.g. "
        f"{tensor}[i.clamp(0, {size - 1 if size else 'n - 1'})]"
    )
