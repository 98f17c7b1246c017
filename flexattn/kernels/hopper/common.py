"""What the Hopper kernels (forward.py, backward.py) share: the Triton releases their Gluon was
checked on, the rules that say whether a call can run on them at all (device, dtypes, head dims,
lengths, layouts), the 2-D views their tensor descriptors read, and :class:`HopperFamily`, the base
that remembers mods whose kernels did not compile.

The kernels are written in Triton's Gluon (templates/hopper_*.py.jinja) for compute capability 9.0;
``BACKEND='GLUON'`` pins them. A call they cannot take runs on the portable kernels (dispatch.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from ...errors import BackendUnavailableError
from ...lowering import index_bounds, lowering_variants
from ...trace import TracedMod
from ..ahead import recording
from ..family import KernelFamily, Plan, Problem
from ..launch import interpreter_enabled, kv_strides

__all__ = ["HopperFamily", "HopperUnavailable", "problem_reason", "device_reason", "shape_reason", "View",
           "tensor_view", "descriptor_ready", "shared_layout", "resident_in_registers", "GLUON_TRITON_VERSIONS",
           "GLUON_COMPILES_ON", "BLOCK", "HEAD_DIMS", "CONSUMER_REGS", "RESIDENT_TILES"]

# The Triton releases whose Gluon API (warp_specialize's signature, the Hopper copy and mbarrier
# ops, calls from @gluon.jit into @triton.jit hooks) the Gluon kernels were run and checked on, on
# a Hopper GPU (tests/test_gpu_hopper_*.py, each release's wheel over torch 2.11; docs/benchmarks_log.md,
# "The Gluon kernels under Triton 3.7, 3.8 and 3.9"): the
# runtime guard. A later release may rename Gluon ops again, so it runs the portable kernels until
# it has been checked the same way.
GLUON_TRITON_VERSIONS = ("3.6", "3.7", "3.8", "3.9")
# The Triton releases whose Gluon compiles these templates (forward and backward) for sm_90 offline,
# in the CPU tests; the spellings that differ are chosen at render time ([Note] Gluon API by Triton
# release in codegen/source.py).
GLUON_COMPILES_ON = ("3.6", "3.7", "3.8", "3.9")
BLOCK = 128  # query rows per program and keys per tile: the BlockMask's block on both sides
HEAD_DIMS = (64, 128)
CONSUMER_REGS = 240  # registers per thread of a consumer warpgroup (the loader warp keeps 24)


# [Note] Resident tiles in registers. A Hopper wgmma reads its first operand from shared memory or
# from registers. From shared memory, an m64 n64 k16 product (32 cycles at the tensor cores' rate)
# reads 4 KB: all of the 128 bytes a cycle an SM's shared memory delivers. The dK/dV kernel's S and
# dP products are that shape (64 keys x 64 queries a consumer); at head dim 64 a query tile moved
# about 190 KB through shared memory (products, ring, dS and dQ tiles), about 1500 cycles against
# 1280 of tensor-core work: the kernel waited on shared memory. Each consumer keeps one tile for its
# whole walk (forward: its 64 rows of Q; dK/dV: its 64 keys of K and V; dQ: Q and dO), so it can
# load that tile into registers once and read only the second operand from shared memory. It costs
# 16 registers a thread per tile at head dim 64, 32 at 128. What RESIDENT_TILES keeps, from
# measurements against shared memory (docs/benchmarks_log.md, "Resident tiles in registers; the d=64
# backward and the compiled model ..."):
# - dK/dV at head dim 64: faster on every case (the paper's masks and mods, deterministic, the
#   model's shapes), the same bits. At 128, K and V (64 registers) beside dK and dV (128) spilled:
#   shared memory there.
# - forward at head dim 64: slightly faster, the same bits. At 128 no gain worth 32 registers, so
#   128 keeps shared memory.
# - dQ at head dim 64 (Q and dO): slower; at 128 it spilled. The dQ kernel has no such flag (the
#   form measured was removed).
# A/B runs: docs/data/resident_tiles_h200_2026-11-28.json.
RESIDENT_TILES = {("forward", 64), ("dkdv", 64)}


def resident_in_registers(kernel: str, head_dim: int) -> bool:
    """Whether ``kernel`` ("forward" or "dkdv") keeps its resident tiles in registers ([Note]
    Resident tiles in registers)."""
    return (kernel, head_dim) in RESIDENT_TILES

class HopperUnavailable(BackendUnavailableError):
    """This call cannot run on the Hopper kernels; the message says why (dispatch.py falls back)."""

@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def _triton_version() -> str:
    import triton

    return triton.__version__


class View(NamedTuple):
    """A tensor [B, H, N, D] as one 2-D descriptor (see [Note] 2-D views in the template): its
    shape and row stride, and where (batch, head)'s rows start: rows per batch and per head,
    columns per head."""

    shape: tuple
    row_stride: int
    row_z: int
    row_h: int
    col_h: int


def tensor_view(t: torch.Tensor, strides: tuple) -> Optional[View]:
    """``t`` (with ``strides``, a batch stride of 0 where K/V are broadcast) as one 2-D view, or None.

    Two layouts qualify: each head's rows apart from the others' ([B, H, N, D] storage and its
    slices: every stride a whole number of rows), and heads side by side in a row ([B, N, H, D]
    storage, a transposed view: the heads' columns inside the row stride)."""
    B, H, N, D = t.shape
    sz, sh, sn, sd = strides
    if sd != 1 or sn < D or min(sz, sh) < 0:
        return None
    z_rows = 0 if B == 1 else sz
    if z_rows % sn:
        return None
    if H == 1 or sh % sn == 0:  # rows per head
        h_rows = 0 if H == 1 else sh // sn
        rows = (B - 1) * (z_rows // sn) + (H - 1) * h_rows + N
        return View((rows, D), sn, z_rows // sn, h_rows, 0)
    if sh >= D and (H - 1) * sh + D <= sn:  # columns per head
        rows = (B - 1) * (z_rows // sn) + N
        return View((rows, (H - 1) * sh + D), sn, z_rows // sn, 0, sh)
    return None


def descriptor_ready(t: torch.Tensor, strides: Optional[tuple] = None) -> bool:
    """Whether ``t`` (with ``strides``, by default its own) can be read through one 2-D tensor
    descriptor: a ``tensor_view``, with 16-byte aligned base and rows."""
    view = tensor_view(t, t.stride() if strides is None else strides)
    return view is not None and t.data_ptr() % 16 == 0 and (view.row_stride * t.element_size()) % 16 == 0


def problem_reason(q, k, v, block_mask, need_max: bool) -> Optional[str]:
    """Why the Hopper kernels cannot run this problem (None: they can), whatever the mods."""
    if not q.is_cuda:
        return "Gluon kernels need a CUDA device (Triton's interpreter cannot run them)"
    return device_reason(q.device) or shape_reason(q, k, v, block_mask, need_max)


def device_reason(device: torch.device) -> Optional[str]:
    """Why the kernel cannot run on this CUDA device with this Triton (None: it can)."""
    if interpreter_enabled():
        return "Triton's interpreter (TRITON_INTERPRET=1) cannot run Gluon kernels"
    version = _triton_version()
    if not version.startswith(GLUON_TRITON_VERSIONS):
        return (f"Gluon kernels validated on Triton {GLUON_TRITON_VERSIONS[0]} to {GLUON_TRITON_VERSIONS[-1]} "
                f"only (this is Triton {version})")
    capability = tuple(_capability(device.index if device.index is not None else torch.cuda.current_device()))
    if capability != (9, 0):
        return f"the Gluon kernel is for compute capability 9.0 (Hopper), this GPU is {capability[0]}.{capability[1]}"
    return None


def shape_reason(q, k, v, block_mask, need_max: bool) -> Optional[str]:
    """Why the kernel cannot take these inputs and this BlockMask (None: it can)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        dtypes = ", ".join(str(t.dtype).replace("torch.", "") for t in (q, k, v))
        return f"the Gluon kernel takes a query, key and value of one dtype, float16 or bfloat16, got {dtypes}"
    E, Ev = q.shape[-1], v.shape[-1]
    if E != Ev or E not in HEAD_DIMS:
        return f"the Gluon kernel needs equal Q/K and V head dims of 64 or 128, got {E} and {Ev}"
    L, S = q.shape[2], k.shape[2]
    if L % BLOCK or S % BLOCK:
        return f"the Gluon kernel needs query and key lengths that are multiples of {BLOCK}, got {L} and {S}"
    if tuple(block_mask.BLOCK_SIZE) != (BLOCK, BLOCK):
        return (f"the Gluon kernel needs a BlockMask BLOCK_SIZE of ({BLOCK}, {BLOCK}), "
                f"got {tuple(block_mask.BLOCK_SIZE)}")
    if need_max:
        return "the Gluon kernel does not write max_scores"
    k_strides, v_strides = kv_strides(k, v, q.shape[0])
    for name, t, strides in (("q", q, q.stride()), ("k", k, k_strides), ("v", v, v_strides)):
        if not descriptor_ready(t, strides):
            return (f"{name} cannot be read through one 2-D tensor descriptor (it needs a unit last stride, 16-byte "
                    "aligned rows and base, and [B, H, N, D] or [B, N, H, D] storage)")
    return None


class HopperFamily(KernelFamily):
    """What the Gluon families share: a lowering variant whose kernels did not compile (a mod Gluon
    cannot express, or kernels that do not fit) is remembered with its reason, so later calls go to
    the portable kernels without trying again; the first launch of a plan is where that shows."""

    what = "kernel"  # how the error names the family's kernels

    def __init__(self, score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool):
        super().__init__(score, mask, tanh_approx=tanh_approx)
        self._failed: dict = {}  # lowering variants -> why their kernels did not compile

    def _variants(self, q, k) -> tuple:
        B, Hq, L, _ = q.shape
        return lowering_variants(self.score, self.mask, index_bounds(B, Hq, L, k.shape[2]))

    def failed_reason(self, q, k) -> Optional[str]:
        """Why this call's kernels did not compile, when an earlier launch of its lowering variant
        failed (None: none did). Changes as launches fail, so never kept by a caller."""
        return self._failed.get(self._variants(q, k)) if self._failed else None

    def _first_launch(self, key: tuple, problem: Problem) -> tuple[Plan, object]:
        """``(plan, _launch(plan, problem))`` for a problem seen for the first time; the plan is kept
        once its launch (which compiles) succeeded. Raises HopperUnavailable, and remembers why, when
        it fails."""
        plan = self._new_plan(problem)
        if recording():  # [Note] Kernels compiled ahead: the real first launch keeps the plan
            return plan, self._launch(plan, problem)
        q, k = problem.q, problem.k
        try:
            result = self._launch(plan, problem)
        except Exception as err:
            if isinstance(err, torch.cuda.OutOfMemoryError):
                raise
            # See [Note] Gluon spelling in codegen/source.py.
            reason = (f"the Gluon {self.what} of {self._names()} did not compile ({type(err).__name__}: "
                      f"{last_line(err)})")
            self._failed[self._variants(q, k)] = reason
            raise HopperUnavailable(reason) from err
        self._remember_plan(key, plan)
        return plan, result


@functools.lru_cache(maxsize=None)
def shared_layout(rows: int, cols: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of a [rows, cols] tile of ``dtype``, as the copy engine
    writes it and warpgroup_mma reads it (12 us to work out each time, so kept)."""
    from triton.experimental.gluon import language as gl

    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, cols], element)


def last_line(err: Exception) -> str:
    """The compiler's own message: the last line of its error (the lines above quote the source)."""
    text = str(err).strip().splitlines()
    return text[-1][:200] if text else ""
