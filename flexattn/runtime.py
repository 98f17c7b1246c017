"""Runtime: compile-once kernels, launch configurations, autotuning and launches.

Stage 4 of the pipeline (trace -> lowering -> codegen -> runtime). A ``ForwardKernel`` is built
once per (score_mod graph, mask_mod graph, tanh flag) and kept; its launch plans (grid, constexprs
and which lowering variant of the mods to run) are made once per problem shape and BlockMask
content, so each warm call only gathers pointers and strides and launches. Triton compiles each
constexpr specialisation once and caches it on disk.

[Note] Cache keys. Every cache in this module, api.py, index_bounds.py and codegen.py follows
three rules, because a cache hit with a stale entry is a wrong number with no error:
1. A key covers everything that can change the generated code or the launch (shapes, strides,
   dtypes, device, flags, the BlockMask's row statistics, the lowering variant, options).
2. No ``id()`` of an object that can die: CPython hands a freed object's id to the next one (a
   training loop that rebuilds its BlockMask each step got the previous mask's plan, issue 8).
   Objects in a key are held by the key itself (TracedMod, compared by identity, stays alive
   while it is a key), or the key is built from content.
3. Data derived from a mutable object lives on that object, stamped with what it came from
   (BlockMask.derived: table identities and version counters), or is keyed by content.
Every cache is bounded (least recently used entries go first).

The caches: ``_kernels`` (TracedMod pair, tanh flag), ``ForwardKernel._compiled`` (lowering
variants), ``ForwardKernel._plans`` (shapes, strides, dtype, device, BlockMask content, flags,
options), the device copies of a mod's own constants (on the TracedMod, per device), launch
tables and row statistics (on the BlockMask, BlockMask.derived), ``codegen._loaded`` (source
digest), the autotune table (source digest, device, shape class, Triton version),
``api._dense_masks`` (lengths, device), ``index_bounds._WIDE`` (TracedMods, bounds), and the
direct launches of ``launch.py`` (on each Triton kernel: device, specialisation facts, constexprs).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from types import ModuleType
from typing import NamedTuple, Optional, Sequence

import torch

from . import lowering
from .block_mask import BlockMask, _ascending
from .codegen import KernelSpec, cache_dir, load_kernel_module, render
from .errors import BackendUnavailableError, InvalidInputError, ResourceError
from .index_bounds import index_bounds, lowering_variant
from .launch import launch
from .lowering import LoweredMod
from .trace import TracedMod

__all__ = [
    "LaunchConfig", "ForwardKernel", "CompiledForward", "forward_kernel", "interpreter_enabled", "select_config",
    "block_mask_row_stats", "launch_tables",
]


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class LaunchConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    USE_TMA: bool = False  # Q, K, V and O through tensor descriptors (Hopper's copy engine)
    WARP_SPECIALIZE: bool = False  # Triton's warp specialisation of the key loop
    HOST_DESCRIPTORS: bool = False  # with USE_TMA: descriptors built by the launcher, not per program


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def shared_memory_bytes(cfg: LaunchConfig, elem_bytes: int, qk_dim_p2: int, v_dim_p2: int) -> int:
    """Upper estimate of the forward's shared memory: Q once, K and V tiles per pipeline stage."""
    q_tile = cfg.BLOCK_M * qk_dim_p2
    kv_tiles = cfg.BLOCK_N * (qk_dim_p2 + v_dim_p2) * max(1, cfg.num_stages - 1)
    return (q_tile + kv_tiles) * elem_bytes


def max_shared_memory(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


# Defaults from flexattn/gym/sweep.py on an H200 (docs/benchmarks.md); other GPUs start from the same shapes
# and shrink until shared memory fits. AUTOTUNE searches around them per problem.
_GPU_DEFAULTS = {  # pointer loads, any GPU
    # (head dim up to, elem bytes): config
    (64, 2): LaunchConfig(64, 128, 4, 3),
    (128, 2): LaunchConfig(128, 64, 4, 3),
    (256, 2): LaunchConfig(64, 32, 4, 3),
    (64, 4): LaunchConfig(64, 64, 4, 3),
    (128, 4): LaunchConfig(64, 32, 4, 3),
    (256, 4): LaunchConfig(32, 32, 4, 2),
}


# Hopper with tensor descriptors, 16-bit inputs (flexattn/gym/sweep.py at 16k tokens on an H200): two
# pipeline stages beat three once the copy engine fetches K/V, and 128-row programs win at d=128.
_HOPPER_TMA_DEFAULTS = {
    64: LaunchConfig(64, 128, 4, 2, USE_TMA=True),
    128: LaunchConfig(128, 64, 4, 2, USE_TMA=True),
}
# The one warp-specialised configuration flexattn validated (Triton 3.6, H100/H200, d=128, no
# mods): +6 to 7% over the best plain loop. Triton 3.6 miscompiled every other case we tried:
# wrong results with captured tensors or masks in the loop, NaN with three stages, a 3x slower
# kernel with any masked tile outside the loop, and pointer stores of the per-row LSE that lose
# half the rows (the template stores it through a descriptor instead). So nothing else gets it by
# default, and calls that need row maxima never get it (see _plan).
_HOPPER_WS_CONFIG = LaunchConfig(128, 128, 4, 2, USE_TMA=True, WARP_SPECIALIZE=True)
# Rows that visit few blocks (document masks), with descriptors built on the host (16k tokens,
# H200): d=64 310 vs 287 TFLOP/s with pointers; d=128 345 vs 309.
_HOPPER_SHORT_ROW_DEFAULTS = {
    64: LaunchConfig(64, 128, 4, 2, USE_TMA=True, HOST_DESCRIPTORS=True),
    128: LaunchConfig(64, 32, 4, 2, USE_TMA=True, HOST_DESCRIPTORS=True),
}


def warp_specialization_validated() -> bool:
    import triton

    return triton.__version__.startswith("3.6.")


MIN_TILE = 16  # tl.dot needs at least 16 rows and columns


def _tile(limit: int, block: int, name: str) -> int:
    """The largest power of two <= limit, at least MIN_TILE, that divides the BlockMask's block."""
    tile = 1 << (max(1, min(limit, block)).bit_length() - 1)
    while tile >= MIN_TILE and block % tile:
        tile //= 2
    if tile < MIN_TILE:
        what = "query" if name == "BLOCK_M" else "key"
        raise InvalidInputError(
            f"the BlockMask's {what} block size (BLOCK_SIZE) is {block}: the Triton backend walks each block "
            f"in tiles of a power of two of at least {MIN_TILE} that divides it, and {block} has none "
            "(48, 80 and 96 work: tiles of 16 or 32). Build the BlockMask with such a BLOCK_SIZE (a multiple "
            "of 16; 128 is the default), or use kernel_options={'BACKEND': 'PYTORCH'}, which takes any block size"
        )
    return tile


def _fit_to_mask(cfg: LaunchConfig, sparse_q: int, sparse_kv: int) -> LaunchConfig:
    """cfg with power-of-two tiles that divide the BlockMask's blocks (48 -> 16, 96 -> 32)."""
    block_m = _tile(cfg.BLOCK_M, sparse_q, "BLOCK_M")
    block_n = _tile(cfg.BLOCK_N, sparse_kv, "BLOCK_N")
    if (block_m, block_n) == (cfg.BLOCK_M, cfg.BLOCK_N):
        return cfg
    return replace(cfg, BLOCK_M=block_m, BLOCK_N=block_n)


class RowStats(NamedTuple):
    mean_blocks: float  # key blocks (partial and full) a query-block row visits, on average
    consecutive_partial: bool  # every row's partial blocks are first, first + 1, first + 2, ...
    consecutive_full: bool  # the same for the full blocks


class LaunchTables(NamedTuple):
    """A BlockMask's forward tables as the kernel reads them, and what launch choices need from them.

    Kept on the mask (BlockMask.derived), so a rebuilt mask never inherits another's and a table
    changed in place or replaced is checked again.
    """

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor  # kv_num_blocks when the mask has no full blocks
    full_kv_indices: torch.Tensor
    has_full: bool
    stats: RowStats
    plan_key: tuple  # everything in here a launch plan depends on


def _consecutive(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    steps = torch.arange(idx.shape[-1], device=idx.device, dtype=idx.dtype)
    used = steps < num.unsqueeze(-1)
    return ((idx == idx[..., :1] + steps) | ~used).all()


def _table_checks(num: torch.Tensor, idx: torch.Tensor, cols: int) -> list[torch.Tensor]:
    """[counts out of range, a used entry out of range, used entries not strictly ascending] (0-d)."""
    used = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    bad_count = ((num < 0) | (num > idx.shape[-1])).any()
    bad_used = (used & ((idx < 0) | (idx >= cols))).any()
    unordered = (used[..., 1:] & (idx[..., 1:] <= idx[..., :-1])).any()
    return [bad_count, bad_used, unordered]


def _compute_launch_tables(block_mask: BlockMask) -> LaunchTables:
    """One host sync per mask: row statistics and the checks the kernel relies on."""
    nb, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    fnb, fidx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    has_full = fnb is not None
    q_block, kv_block = block_mask.BLOCK_SIZE
    q_len, kv_len = block_mask.seq_lengths
    cols = -(-kv_len // kv_block)
    pairs = [("kv", nb, idx)] + ([("full_kv", fnb, fidx)] if has_full else [])
    for name, num, ind in pairs:
        if (num.dim() != 3 or ind.dim() != 4 or ind.shape[:3] != num.shape or num.device != nb.device
                or ind.device != nb.device or num.dtype.is_floating_point or ind.dtype.is_floating_point):
            raise InvalidInputError(
                f"block_mask.{name}_num_blocks {tuple(num.shape)} and block_mask.{name}_indices {tuple(ind.shape)} "
                "must be integer tensors [B, H, ROWS] and [B, H, ROWS, W] on one device"
            )
    if nb.shape[2] * q_block < q_len:
        raise InvalidInputError(
            f"block_mask.kv_num_blocks has {nb.shape[2]} rows of {q_block} queries, fewer than its Q_LEN "
            f"{q_len}; rebuild it with create_block_mask or BlockMask.from_kv_blocks"
        )
    total = nb.sum(dtype=torch.int64) + (fnb.sum(dtype=torch.int64) if has_full else 0)
    consecutive = [_consecutive(nb, idx), _consecutive(fnb, fidx) if has_full else _consecutive(nb, idx)]
    checks = [c for _, num, ind in pairs for c in _table_checks(num, ind, cols)]
    values = torch.stack([total, *(flag.to(torch.int64) for flag in consecutive + checks)]).tolist()
    total, partial, full, checks = values[0], bool(values[1]), bool(values[2]), values[3:]
    tables = {"kv": [nb, idx], "full_kv": [fnb, fidx]}
    reordered = False
    for i, (name, num, ind) in enumerate(pairs):
        bad_count, bad_used, unordered = checks[3 * i: 3 * i + 3]
        if bad_count or bad_used:
            raise InvalidInputError(
                f"block_mask.{name}_num_blocks / {name}_indices list a key block outside [0, {cols}) (the "
                f"mask's KV_LEN {kv_len} in blocks of {kv_block}) or more blocks than the table holds; the "
                "kernel would read outside the keys. Rebuild the mask (create_block_mask or from_kv_blocks check this)"
            )
        if unordered:
            # The kernel bounds-checks only a row's last block ([Note] Boundary block): keep rows
            # ascending (BlockMask's constructor does; a table changed in place may not be).
            tables[name][1] = _ascending(num, ind)
            reordered = True
    if reordered:
        _check_no_repeats(pairs, tables)
    nb, idx = (t.contiguous() for t in tables["kv"])
    fnb, fidx = (t.contiguous() for t in tables["full_kv"]) if has_full else (nb, idx)
    stats = RowStats(total / max(1, nb.numel()), partial, full)
    return LaunchTables(nb, idx, fnb, fidx, has_full, stats, (tuple(nb.shape), has_full, stats))


def _check_no_repeats(pairs, tables) -> None:
    for name, num, _ in pairs:
        ind = tables[name][1]
        used = torch.arange(ind.shape[-1], device=ind.device) < num.unsqueeze(-1)
        if bool((used[..., 1:] & (ind[..., 1:] == ind[..., :-1])).any()):
            raise InvalidInputError(
                f"block_mask.{name}_indices lists a key block twice in one row; the kernel would count it twice"
            )


def launch_tables(block_mask: BlockMask) -> LaunchTables:
    """The checked tables and row statistics of ``block_mask``, computed once per table content."""
    return block_mask.derived("launch_tables", _compute_launch_tables)


def preset_launch_tables(block_mask: BlockMask) -> None:
    """Launch tables for a mask flexattn built from dense tile maps (decode_block_mask), whose rows
    are ascending and in range by construction: set without the checks' host sync, so a decoding
    step that builds its mask each step never waits for the GPU. The row statistics are fixed
    (no consecutive-block fast path, mean = the table's width), so the step's launch plan is the
    same at every step; they only steer speed."""
    nb, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    fnb, fidx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    has_full = fnb is not None
    stats = RowStats(float(idx.shape[-1]), False, False)
    tables = LaunchTables(nb, idx, fnb if has_full else nb, fidx if has_full else idx, has_full, stats,
                          (tuple(nb.shape), has_full, stats))
    block_mask.preset_derived("launch_tables", tables)


def block_mask_row_stats(block_mask: BlockMask) -> RowStats:
    """What launch choices need from a BlockMask's tables (see LaunchTables)."""
    return launch_tables(block_mask).stats


def select_config(
    device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int, sparse_q: int, sparse_kv: int,
    has_mask_mod: bool = False, blocks_per_row: float = float("inf"), *,
    has_score_mod: bool = False, tma_ok: bool = False, host_descriptors_ok: bool = False, even_n: bool = True,
    row_stats: bool = False,
) -> LaunchConfig:
    """A launch configuration that divides the mask's blocks and fits in shared memory.

    tma_ok: the tensors allow tensor descriptors (see _tma_compatible); host_descriptors_ok: and
    descriptors built on the host (see _host_descriptors_ok); even_n: the key length is a multiple
    of the BlockMask's key block; row_stats: the call writes the row maxima, or an LSE whose rows
    the warp-specialised loop cannot store (see _plan).
    """
    if interpreter_enabled() or device.type != "cuda":
        # The interpreter runs each program in numpy: fewer, larger tiles are faster.
        return _fit_to_mask(LaunchConfig(128, 128, 4, 1), sparse_q, sparse_kv)
    elem = dtype.itemsize
    dim = max(qk_dim, v_dim)
    bucket = next((d for d in (64, 128, 256) if dim <= d), 256)
    base = _GPU_DEFAULTS[(bucket, 2 if elem <= 2 else 4)]
    sparse_rows = has_mask_mod and blocks_per_row < 8
    if has_mask_mod and elem == 2 and bucket in (64, 128):
        # Measured on an H200 (flexattn/gym/sweep.py, flexattn/gym/benchmark.py): masks whose rows visit few blocks
        # (documents, short windows) want more, smaller programs; dense-row masks (causal, prefix)
        # want 128 query rows per program.
        if sparse_rows:
            base = LaunchConfig(64, 128, 4, 3) if bucket == 64 else LaunchConfig(64, 64, 4, 3)
        else:
            base = LaunchConfig(128, 128, 4, 3) if bucket == 64 else LaunchConfig(128, 128, 8, 3)
    if tma_ok and elem == 2 and bucket in _HOPPER_TMA_DEFAULTS:
        # [Note] Descriptor set-up: a descriptor made in the kernel costs each program a write and
        # a fence before its first load. Rows that visit few blocks cannot hide that (document
        # mask d=64: 246 TFLOP/s with in-kernel descriptors, 287 with pointers, 310 with host-built
        # ones). Host-built descriptors are 4-D and at d=128 (256-byte rows) Triton 3.6 loads them
        # more slowly (causal d=128: 450 vs 505), so long rows of 256 bytes keep in-kernel ones.
        if sparse_rows:
            if host_descriptors_ok:
                base = _HOPPER_SHORT_ROW_DEFAULTS[bucket]
        else:
            base = _HOPPER_TMA_DEFAULTS[bucket]
            if host_descriptors_ok and bucket * elem <= 128:
                base = replace(base, HOST_DESCRIPTORS=True)  # sliding window d=64: 337 -> 373
            if (qk_dim == v_dim == 128 and not has_mask_mod and not has_score_mod and even_n and not row_stats
                    and torch.cuda.get_device_capability(device) == (9, 0) and warp_specialization_validated()):
                base = _HOPPER_WS_CONFIG
    cfg = _fit_to_mask(base, sparse_q, sparse_kv)
    limit = max_shared_memory(device)
    qk_p2, v_p2 = _next_pow2(qk_dim), _next_pow2(v_dim)
    while shared_memory_bytes(cfg, elem, qk_p2, v_p2) > limit:
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.BLOCK_N > 16:
            cfg = replace(cfg, BLOCK_N=cfg.BLOCK_N // 2)
        elif cfg.BLOCK_M > 16:
            cfg = replace(cfg, BLOCK_M=cfg.BLOCK_M // 2)
        else:
            break
    return cfg


def _candidate_configs(base: LaunchConfig, sparse_q: int, sparse_kv: int) -> list[LaunchConfig]:
    shapes = [(128, 128), (128, 64), (64, 64), (64, 128), (128, 32), (64, 32)]
    out = {base}
    for bm, bn in shapes:
        for warps in (4, 8):
            for stages in (2, 3, 4):
                cfg = LaunchConfig(bm, bn, warps, stages, base.USE_TMA, HOST_DESCRIPTORS=base.HOST_DESCRIPTORS)
                out.add(_fit_to_mask(cfg, sparse_q, sparse_kv))
    return sorted(out, key=lambda c: (c != base, -c.BLOCK_M, -c.BLOCK_N, c.num_warps, c.num_stages))


class _TunedConfigs:
    """Autotuned choices, kept in ``<cache dir>/autotune.json`` so later processes reuse them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._table: Optional[dict] = None

    @property
    def path(self):
        return cache_dir() / "autotune.json"

    def _load(self) -> dict:
        if self._table is None:
            try:
                self._table = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._table = {}
        return self._table

    def get(self, key: str) -> Optional[LaunchConfig]:
        with self._lock:
            entry = self._load().get(key)
        return LaunchConfig(**entry) if entry else None

    def get_entry(self, key: str) -> Optional[dict]:
        with self._lock:
            return self._load().get(key)

    def put(self, key: str, cfg: LaunchConfig) -> None:
        self.put_entry(key, asdict(cfg))

    def put_entry(self, key: str, entry: dict) -> None:
        with self._lock:
            table = self._load()
            table[key] = entry
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            os.replace(tmp, self.path)


tuned_configs = _TunedConfigs()
autotune_runs = 0  # searches run in this process (a stored choice from an earlier process adds none)

_OPTION_KEYS = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}  # keys that pin the launch config


def _pinned_config(options: dict, default: LaunchConfig, sparse_q: int, sparse_kv: int) -> LaunchConfig:
    # A pinned shape keeps the default's load path; warp specialisation only when asked for.
    cfg = LaunchConfig(
        **{k: int(options.get(k, getattr(default, k))) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")},
        USE_TMA=default.USE_TMA, HOST_DESCRIPTORS=default.HOST_DESCRIPTORS,
    )
    for name, value, sparse, what in (("BLOCK_M", cfg.BLOCK_M, sparse_q, "query"), ("BLOCK_N", cfg.BLOCK_N, sparse_kv, "key")):
        if value < 16 or value & (value - 1) or sparse % value:
            raise InvalidInputError(
                f"kernel_options['{name}'] must be a power of two >= 16 that divides the BlockMask's "
                f"{what} block size {sparse}, got {value}"
            )
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        raise InvalidInputError(
            f"kernel_options num_warps must be 1, 2, 4, 8 or 16 and num_stages >= 1, got {cfg.num_warps} and {cfg.num_stages}"
        )
    return cfg


def _input_precision(dtype: torch.dtype) -> str:
    if dtype != torch.float32:
        return "ieee"
    # fp32 inputs use tf32 tensor cores only when torch's own matmul setting allows it.
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "ieee"


@dataclass(frozen=True)
class CompiledForward:
    """One rendered and imported forward kernel: the mods lowered for one lowering variant."""

    spec: KernelSpec
    source: str
    source_digest: str
    module: ModuleType
    variants: tuple  # (score variant, mask variant) it was lowered for; None: any lengths

    @property
    def jit_fn(self):
        return self.module.flex_attention_forward


class _Plan(NamedTuple):
    grid: tuple[int, int, int]
    constexprs: dict
    compiled: CompiledForward
    check_compiled: bool = False  # default tiles not yet seen compiled: see [Note] Tiles the compiler made costly


_PLANS_PER_KERNEL = 256


class KernelFamily:
    """What the forward, backward and decode kernels of one pair of traced mods share (see [Note]
    Cache keys): one compiled source per lowering variant (``compiled``, built by the family's
    ``_compile``) and a bounded table of launch plans, one per problem (``_remember_plan``)."""

    def __init__(self, score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool):
        self.score, self.mask, self.tanh_approx = score, mask, tanh_approx
        self.has_score_mod = score is not None
        self.has_mask_mod = mask is not None
        self._compiled: dict[tuple, object] = {}
        self._plans: "OrderedDict[tuple, tuple]" = OrderedDict()

    def compiled(self, bounds=None):
        """The kernels for calls within ``bounds`` (an IndexBounds); None: correct at any lengths."""
        variants = lowering_variants(self.score, self.mask, bounds)
        compiled = self._compiled.get(variants)
        if compiled is None:
            compiled = self._compiled[variants] = self._compile(variants)
        return compiled

    def _compile(self, variants: tuple):
        raise NotImplementedError

    def _lowered_mods(self, variants: tuple) -> dict:
        """The spec fields every family's template takes: both mods lowered for ``variants``, and
        their names."""
        return dict(
            score_mod=_lower(self.score, "sm_", self.tanh_approx, variants[0]),
            mask_mod=_lower(self.mask, "mm_", self.tanh_approx, variants[1]),
            score_name=self.score.name if self.score else "identity",
            mask_name=self.mask.name if self.mask else "none",
        )

    @staticmethod
    def _load(compiled_type: type, spec: KernelSpec, variants: tuple):
        """``compiled_type`` for ``spec``: rendered and imported (codegen.load_kernel_module)."""
        source = render(spec)
        return compiled_type(
            spec=spec, source=source, source_digest=hashlib.sha256(source.encode()).hexdigest()[:16],
            module=load_kernel_module(source, spec.readable_name()), variants=variants,
        )

    def _remember_plan(self, key: tuple, plan):
        self._plans[key] = plan
        if len(self._plans) > _PLANS_PER_KERNEL:  # masks rebuilt with new content must not pile up
            self._plans.popitem(last=False)
        return plan


class ForwardKernel(KernelFamily):
    """The forward kernels of one pair of traced mods: one compiled source per lowering variant,
    and one launch plan per problem (see [Note] Cache keys)."""

    def __init__(self, score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool):
        super().__init__(score, mask, tanh_approx=tanh_approx)
        self.last_constexprs: Optional[dict] = None  # what the latest launch used (tests and debugging read it)
        self.last_compiled: Optional[CompiledForward] = None

    def _compile(self, variants: tuple) -> CompiledForward:
        return self._load(CompiledForward, KernelSpec("forward", **self._lowered_mods(variants)), variants)

    # ---------------------------------------------------------------- launch
    def __call__(
        self, q, k, v, block_mask, scale: float, score_captured, mask_captured, *,
        need_lse: bool, need_max: bool, options: dict,
    ):
        B, Hq, L, _ = q.shape
        Ev = v.shape[3]
        tables = launch_tables(block_mask)
        plan_key = (
            q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device,
            block_mask.BLOCK_SIZE, tables.plan_key,  # content, never id(block_mask): see [Note] Cache keys
            need_lse, need_max, scale > 0, tuple(sorted(options.items())) if options else (),
            torch.get_float32_matmul_precision() if q.dtype == torch.float32 else None,
        )
        plan = self._plans.get(plan_key)
        if plan is None:
            plan = self._remember_plan(plan_key, self._plan(
                q, k, v, block_mask, tables, scale, score_captured, mask_captured, need_lse, need_max, options))
        grid, constexprs, compiled = plan.grid, plan.constexprs, plan.compiled
        if constexprs["USE_TMA"] and (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
            # Same shapes and strides as the plan's first call, but an unaligned view this time.
            constexprs = {**constexprs, "USE_TMA": False, "HOST_DESCRIPTORS": False, "WARP_SPECIALIZE": False}
        self.last_constexprs = constexprs
        self.last_compiled = compiled
        if constexprs["USE_TMA"]:
            _install_tma_allocator()  # per call: plans are shared by threads, allocators are not

        out = _empty((B, Hq, L, Ev), q.dtype, q.device)
        lse = _empty((B, Hq, L), torch.float32, q.device) if need_lse else out
        mx = _empty((B, Hq, L), torch.float32, q.device) if need_max else out
        # K/V batch of 1 broadcast over the query batch: stride 0 re-reads the same rows.
        k_strides = k.stride()
        v_strides = v.stride()
        if k.shape[0] == 1 and B > 1:
            k_strides, v_strides = (0,) + k_strides[1:], (0,) + v_strides[1:]
        extra = mod_launch_args(score_captured if self.has_score_mod else (),
                                mask_captured if self.has_mask_mod else ())
        q_arg, k_arg, v_arg, out_arg = q, k, v, out
        if constexprs["HOST_DESCRIPTORS"]:
            q_arg, k_arg, v_arg, out_arg = _host_descriptors(q, k, v, out, constexprs)
        nb, idx, fnb, fidx = tables.kv_num_blocks, tables.kv_indices, tables.full_kv_num_blocks, tables.full_kv_indices
        try:
            kernel = launch(compiled.jit_fn, grid, (
                q_arg, k_arg, v_arg, out_arg, lse, mx, nb, idx, fnb, fidx,
                *q.stride(), *k_strides, *v_strides, *out.stride(),
                nb.shape[2], idx.shape[3], fidx.shape[3],
                L, k.shape[2], scale, *extra), constexprs)
        except Exception as err:
            # [Note] Resource fallback: a mod with many per-pair gathers (a Graphormer edge bias
            # summed over a path) can need more shared memory than the default tiles allow. The
            # compiler says so at the first launch; a smaller tile is then planned and kept for
            # this problem, and only when no tile fits does the user see an error, ours.
            if not _is_out_of_resources(err):
                raise
            smaller = _smaller_plan(plan, L)
            if smaller is None:
                raise ResourceError(
                    f"the Triton kernel for score_mod '{self.score.name if self.score else None}' and mask_mod "
                    f"'{self.mask.name if self.mask else None}' does not fit this GPU even with 16x16 tiles and one "
                    f"pipeline stage ({err}); simplify the mod (fewer captured-tensor reads per pair) or run it "
                    "with kernel_options={'BACKEND': 'PYTORCH'}"
                ) from err
            self._plans[plan_key] = smaller
            return self(q, k, v, block_mask, scale, score_captured, mask_captured,
                        need_lse=need_lse, need_max=need_max, options=options)
        if plan.check_compiled and constexprs is plan.constexprs:
            self._plans[plan_key] = _plan_after_compile(plan, kernel, L, q.element_size(),
                                                        self.has_score_mod or self.has_mask_mod)
        return out, (lse if need_lse else None), (mx if need_max else None)

    def _plan(self, q, k, v, block_mask, tables, scale, score_captured, mask_captured, need_lse, need_max, options):
        """Grid, constexprs and kernel for one problem: computed once, reused by every later call."""
        B, Hq, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
        sparse_q, sparse_kv = block_mask.BLOCK_SIZE
        stats = tables.stats
        # The lowering's decisions for these lengths (int64 index arithmetic where it is needed):
        # made here, once per plan, so warm calls pay nothing for them.
        compiled = self.compiled(index_bounds(B, Hq, L, S))
        cfg = self._config(q, k, v, block_mask, stats, compiled, scale, score_captured, mask_captured, options,
                           sparse_q, sparse_kv, need_lse, need_max)
        use_tma = bool(options.get("USE_TMA", cfg.USE_TMA)) and _tma_layout_ok(q, k, v)
        # Never with mods or row maxima, even when asked for: Triton 3.6 gets those wrong (see
        # _HOPPER_WS_CONFIG), and a fast wrong answer is not an option. The LSE is stored through
        # a descriptor under warp specialisation, which needs 16-byte aligned rows of it.
        warp_specialize = (use_tma and bool(options.get("WARP_SPECIALIZE", cfg.WARP_SPECIALIZE))
                           and not (need_max or self.has_score_mod or self.has_mask_mod)
                           and not (need_lse and L % 4))
        # Triton's warp specialisation rejects 4-D descriptors (3.9: "descriptor block and tensor
        # must have the same number of elements"); its loops are long, so in-kernel ones cost little.
        host_descriptors = (use_tma and not warp_specialize and _host_descriptors_ok(q, k, v)
                            and bool(options.get("HOST_DESCRIPTORS", cfg.HOST_DESCRIPTORS)))
        constexprs = dict(
            SPARSE_Z=tables.kv_num_blocks.shape[0], SPARSE_HQ=tables.kv_num_blocks.shape[1],
            GQA_GROUP=Hq // Hkv,
            QK_HEAD_DIM=E, QK_HEAD_DIM_P2=max(16, _next_pow2(E)),
            V_HEAD_DIM=Ev, V_HEAD_DIM_P2=max(16, _next_pow2(Ev)),
            SPARSE_Q_BLOCK_SIZE=sparse_q, SPARSE_KV_BLOCK_SIZE=sparse_kv,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
            EVEN_M=L % cfg.BLOCK_M == 0, EVEN_N=S % sparse_kv == 0,
            HAS_SCORE_MOD=self.has_score_mod,
            # The mods see the scaled score; the scale folds into the exp2 only when it is positive.
            SCALE_FIRST=self.has_score_mod or scale <= 0,
            HAS_PARTIAL_BLOCKS=self.has_mask_mod, HAS_FULL_BLOCKS=tables.has_full,
            # See [Note] Consecutive blocks in the forward template.
            CONSECUTIVE_PARTIAL=stats.consecutive_partial, CONSECUTIVE_FULL=stats.consecutive_full,
            OUTPUT_LSE=need_lse, OUTPUT_MAX=need_max,
            INPUT_PRECISION=_input_precision(q.dtype), NUM_STAGES=cfg.num_stages,
            UPCAST_DOTS=q.dtype == torch.bfloat16 and interpreter_enabled(),
            USE_TMA=use_tma,
            HOST_DESCRIPTORS=host_descriptors,
            WARP_SPECIALIZE=warp_specialize,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        chosen_here = not (_OPTION_KEYS & options.keys() or options.get("AUTOTUNE"))
        return _Plan((triton_cdiv(L, cfg.BLOCK_M), Hq, B), constexprs, compiled,
                     check_compiled=chosen_here and q.device.type == "cuda" and not interpreter_enabled())

    # ---------------------------------------------------------------- configs
    def _config(self, q, k, v, block_mask, stats, compiled, scale, score_captured, mask_captured, options,
                sparse_q, sparse_kv, need_lse, need_max):
        E, Ev = q.shape[-1], v.shape[-1]
        # Scores the kernel computes: what sets its GPU time.
        scores = q.shape[0] * q.shape[1] * block_mask.kv_num_blocks.shape[2] * stats.mean_blocks * sparse_q * sparse_kv
        default = select_config(
            q.device, q.dtype, E, Ev, sparse_q, sparse_kv,
            has_mask_mod=self.has_mask_mod,
            blocks_per_row=stats.mean_blocks if self.has_mask_mod else float("inf"),
            # Descriptors cost host time per launch (scratch for them, a longer launch); on problems
            # below about a million scores the launch, not the kernel, sets the pace. Host-built
            # ones cost more again (57 -> 83 us a call, H200), so only kernels of 2^28 scores and
            # up (over 100 us of GPU time, which hides them) get them.
            has_score_mod=self.has_score_mod, tma_ok=_tma_layout_ok(q, k, v) and q.shape[2] * k.shape[2] >= 1 << 20,
            host_descriptors_ok=_host_descriptors_ok(q, k, v) and scores >= 1 << 28,
            even_n=k.shape[2] % sparse_kv == 0, row_stats=need_max or (need_lse and q.shape[2] % 4 != 0),
        )
        if _OPTION_KEYS & options.keys():
            return _pinned_config(options, default, sparse_q, sparse_kv)
        if not options.get("AUTOTUNE") or interpreter_enabled() or q.device.type != "cuda":
            return default
        import triton

        # A stored choice only sets the speed: every launch fact that correctness depends on is
        # re-derived from the call in _plan. So the key is a shape class, not the exact problem.
        key = "|".join(
            str(x) for x in (
                compiled.spec.readable_name(), compiled.source_digest, torch.cuda.get_device_name(q.device),
                triton.__version__, q.dtype, _input_precision(q.dtype), E, Ev, _next_pow2(q.shape[2]),
                _next_pow2(k.shape[2]), q.shape[1] // k.shape[1], sparse_q, sparse_kv, need_lse or need_max,
            )
        )
        cached = tuned_configs.get(key)
        if cached is not None:
            return cached
        global autotune_runs
        autotune_runs += 1
        best = self._autotune(q, k, v, block_mask, scale, score_captured, mask_captured, default, sparse_q, sparse_kv,
                              need_lse, need_max)
        tuned_configs.put(key, best)
        return best

    def _autotune(self, q, k, v, block_mask, scale, score_captured, mask_captured, default, sparse_q, sparse_kv,
                  need_lse, need_max):
        import triton.testing

        limit = max_shared_memory(q.device)
        qk_p2, v_p2 = _next_pow2(q.shape[-1]), _next_pow2(v.shape[-1])
        timings = []
        for cfg in _candidate_configs(default, sparse_q, sparse_kv):
            if shared_memory_bytes(cfg, q.dtype.itemsize, qk_p2, v_p2) > limit:
                continue
            pinned = {"BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N, "num_warps": cfg.num_warps,
                      "num_stages": cfg.num_stages, "USE_TMA": cfg.USE_TMA, "WARP_SPECIALIZE": cfg.WARP_SPECIALIZE,
                      "HOST_DESCRIPTORS": cfg.HOST_DESCRIPTORS}

            def run():
                self(q, k, v, block_mask, scale, score_captured, mask_captured,
                     need_lse=need_lse, need_max=need_max, options=pinned)

            try:
                ms = triton.testing.do_bench(run, warmup=5, rep=20, return_mode="median")
            except Exception:  # a config the compiler rejects (resources) is simply not a candidate
                continue
            timings.append((ms, cfg))
        if not timings:
            return default
        return min(timings, key=lambda t: t[0])[1]


def _is_out_of_resources(err: Exception) -> bool:
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover - every supported Triton has it
        return False
    return isinstance(err, OutOfResources)


def _smaller_plan(plan: "_Plan", L: int) -> Optional["_Plan"]:
    """The plan with one pipeline stage, then half the key tile, then half the query tile (See
    [Note] Resource fallback); None once both tiles are 16 and one stage is left."""
    c = dict(plan.constexprs)
    if c["num_stages"] > 1:
        c["num_stages"] = c["NUM_STAGES"] = 1
    elif c["BLOCK_N"] > 16:
        c["BLOCK_N"] //= 2
    elif c["BLOCK_M"] > 16:
        c["BLOCK_M"] //= 2
    else:
        return None
    # Descriptor and warp-specialised loads were tuned for the original tiles: plain loads now.
    c.update(USE_TMA=False, HOST_DESCRIPTORS=False, WARP_SPECIALIZE=False, EVEN_M=L % c["BLOCK_M"] == 0)
    grid = (triton_cdiv(L, c["BLOCK_M"]),) + tuple(plan.grid[1:])
    return plan._replace(grid=grid, constexprs=c)


# [Note] Tiles the compiler made costly. Default tiles are chosen before the mods are compiled, and
# a mod that gathers per pair can make them slow in two ways the compiler reports once the first
# call has run (correct, if slow). Later calls of the problem then get a cheaper plan, one step per
# call, until neither holds; tiles pinned by kernel_options or chosen by AUTOTUNE are kept.
# 1. Spills: more than SPILL_LIMIT_BYTES of local memory per thread halves the key tile, then the
#    query tile (not below 32).
# 2. Staged gathers: shared memory beyond the query tile and one key/value tile per stage by
#    STAGED_GATHER_BYTES or more means the software pipeliner buffers the mods' gathered tiles
#    too: one stage fewer, down to one.
# H100 census of the 22 catalogue entries at their defaults (bf16, 4k tokens, d=64 and 128; Triton
# 3.6; flexattn/gym/tile_census.py, docs/benchmarks.md): five kernels changed, all faster: Longformer
# d=64 (132 bytes spilled) 1.27 -> 0.33 ms, Graphormer d=64 (248) 0.55 -> 0.21, T5 d=64 (169 KB of
# shared memory against 104 KB of tiles) 10.8 -> 3.5, T5 d=128 (292 bytes) 7.4 -> 1.9, Graphormer
# d=128 (177 KB against 112) 0.80 -> 0.17. Twelve d=128 kernels spill 2 to 62 bytes and stay: half
# the key tile made eight of them 16-35% slower. Every other kernel was within 5 KB of its tiles.
SPILL_LIMIT_BYTES = 100
STAGED_GATHER_BYTES = 32 * 1024


def spilled_bytes(kernel) -> int:
    """Bytes of local memory per thread of a compiled Triton kernel (0 when unknown: the interpreter)."""
    return getattr(kernel, "n_spills", 0) or 0


def _tile_bytes(c: dict, elem_bytes: int) -> int:
    """The query tile and one key and value tile per pipeline stage, as the forward stages them."""
    kv = c["BLOCK_N"] * (c["QK_HEAD_DIM_P2"] + c["V_HEAD_DIM_P2"]) * max(1, c["num_stages"])
    return (c["BLOCK_M"] * c["QK_HEAD_DIM_P2"] + kv) * elem_bytes


def _plan_after_compile(plan: "_Plan", kernel, L: int, elem_bytes: int, has_mods: bool) -> "_Plan":
    """The next plan for a problem whose default tiles just ran compiled as ``kernel`` (see [Note]
    Tiles the compiler made costly): a cheaper one, or the same one marked as seen."""
    c = dict(plan.constexprs)
    if spilled_bytes(kernel) > SPILL_LIMIT_BYTES and (c["BLOCK_N"] > 32 or c["BLOCK_M"] > 32):
        if c["BLOCK_N"] > 32:
            c["BLOCK_N"] //= 2
        else:
            c["BLOCK_M"] //= 2
        c["EVEN_M"] = L % c["BLOCK_M"] == 0
        grid = (triton_cdiv(L, c["BLOCK_M"]),) + tuple(plan.grid[1:])
        return plan._replace(grid=grid, constexprs=c)
    shared = getattr(getattr(kernel, "metadata", None), "shared", 0) or 0
    if has_mods and c["num_stages"] > 1 and shared - _tile_bytes(c, elem_bytes) >= STAGED_GATHER_BYTES:
        c["num_stages"] = c["NUM_STAGES"] = c["num_stages"] - 1
        return plan._replace(constexprs=c)
    return plan._replace(check_compiled=False)


def _tma_layout_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Q, K, V and the output (contiguous, V's head dim) can all go through tensor descriptors."""
    return _tma_compatible(q, k, v) and (v.shape[-1] * q.element_size()) % 16 == 0


def _tma_compatible(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need Hopper or newer, a unit last stride and 16-byte aligned rows."""
    first = tensors[0]
    if interpreter_enabled() or not first.is_cuda or torch.cuda.get_device_capability(first.device)[0] < 9:
        return False
    # Plans are keyed by shapes and strides (see __call__): only the base addresses can change
    # between two calls that share a plan, and __call__ re-checks just those.
    for t in tensors:
        elem = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or (t.stride(-2) * elem) % 16 or (t.shape[-1] * elem) < 16:
            return False
        if any((s * elem) % 16 for s in t.stride()[:2] if s):
            return False
    return True


def _host_descriptors_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # See [Note] Host descriptors in the forward template. The launcher encodes 4-D descriptors,
    # which need every stride non-zero (an expanded batch or head has stride 0) and 16-byte aligned.
    if not _tma_layout_ok(q, k, v):
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return all(s > 0 for t in (q, k, v) for s in t.stride())


def _host_descriptors(q, k, v, out, constexprs):
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn = constexprs["BLOCK_M"], constexprs["BLOCK_N"]
    dq, dv = constexprs["QK_HEAD_DIM_P2"], constexprs["V_HEAD_DIM_P2"]
    return (
        TensorDescriptor(q, list(q.shape), list(q.stride()), [1, 1, bm, dq]),
        TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, bn, dq]),
        TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, bn, dv]),
        TensorDescriptor(out, list(out.shape), list(out.stride()), [1, 1, bm, dv]),
    )


# triton.set_allocator sets a context variable: each thread needs its own call. The backward runs
# in autograd's worker thread, and users may call from several threads.
_tma_allocator_threads = threading.local()
_tma_scratch: dict = {}  # stream handle -> int8 buffer


def _tma_scratch_for(size: int, alignment: int, stream) -> torch.Tensor:
    # Device-side tensor descriptors need global scratch for every launch. Launches on one stream
    # run in order, so one buffer per stream, grown when needed, serves them all and saves a
    # caching-allocator round trip per call (a few microseconds of host time).
    buf = _tma_scratch.get(stream)
    if buf is None or buf.numel() < size:
        buf = torch.empty(max(size, 1 << 16), dtype=torch.int8, device="cuda")
        _tma_scratch[stream] = buf
    return buf


def _install_tma_allocator() -> None:
    """Make sure this thread's Triton has the scratch allocator that device-side descriptors need."""
    if not getattr(_tma_allocator_threads, "installed", False):
        import triton

        triton.set_allocator(_tma_scratch_for)
        _tma_allocator_threads.installed = True


# Tests set FLEXATTN_POISON_OUTPUTS=1: outputs start as NaN, so an element a kernel forgets to
# write fails the comparison instead of passing on whatever the allocator left there.
_POISON_OUTPUTS = os.environ.get("FLEXATTN_POISON_OUTPUTS", "0") not in ("", "0")


def _empty(shape, dtype, device) -> torch.Tensor:
    if _POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _lower(traced: Optional[TracedMod], prefix: str, tanh_approx: bool, variant) -> Optional[LoweredMod]:
    if traced is None:
        return None
    if variant is None:  # also the lowering's signature before it took variants
        return lowering.lower(traced, prefix=prefix, tanh_approx=tanh_approx)
    return lowering.lower(traced, prefix=prefix, tanh_approx=tanh_approx, variant=variant)


_kernels: "OrderedDict[tuple, ForwardKernel]" = OrderedDict()  # see [Note] Cache keys
_KERNELS_KEPT = 256


def _import_triton() -> ModuleType:
    try:
        return importlib.import_module("triton")
    except ImportError as err:
        missing = getattr(err, "name", None)
        if missing is None or missing == "triton" or missing.startswith("triton."):
            raise BackendUnavailableError(
                "the Triton backend needs the 'triton' package (pip install triton); "
                "use kernel_options={'BACKEND': 'PYTORCH'} to run without it"
            ) from err
        needs = " (Triton's interpreter, TRITON_INTERPRET=1, imports it)" if interpreter_enabled() else ""
        raise BackendUnavailableError(
            f"triton is installed but importing it failed: {err}. It needs the module '{missing}'{needs}: "
            f"pip install {missing}; or use kernel_options={{'BACKEND': 'PYTORCH'}} to run without Triton"
        ) from err


# The range analysis behind a lowering variant walks the whole graph (about 0.1 ms): remembered per
# (TracedMods, bounds). TracedMods are immutable and compared by identity, kept alive by the key (see
# [Note] Cache keys), and the analysis reads nothing else (graph, captured shapes and dtypes, and
# constants frozen into the TracedMod), so an entry can never describe other contents.
_VARIANTS: "OrderedDict[tuple, tuple]" = OrderedDict()
_VARIANTS_KEPT = 512


def lowering_variants(score: Optional[TracedMod], mask: Optional[TracedMod], bounds) -> tuple:
    """The (score_mod, mask_mod) lowering variants for calls within ``bounds`` (an IndexBounds); None
    entries mean "correct at any lengths". Every kernel family keys its compiled sources by this."""
    if bounds is None:
        return (None, None)
    key = (score, mask, bounds)
    variants = _VARIANTS.get(key)
    if variants is None:
        variants = (lowering_variant(score, bounds) if score is not None else None,
                    lowering_variant(mask, bounds) if mask is not None else None)
        _VARIANTS[key] = variants
        if len(_VARIANTS) > _VARIANTS_KEPT:
            _VARIANTS.popitem(last=False)
    else:
        _VARIANTS.move_to_end(key)
    return variants


def mod_launch_args(*captured: Sequence[torch.Tensor]) -> list:
    """The mods' extra kernel arguments, in the order of their LoweredMod.kernel_params: each
    captured tensor, then its strides. The tensors are already on the query's device (user tensors
    are checked by the API, a mod's own constants moved by TracedMod.fixed_values_on)."""
    args = []
    for tensors in captured:
        for t in tensors:
            args.append(t)
            args.extend(t.stride())
    return args


def cached_kernel(table: OrderedDict, family: type, score: Optional[TracedMod], mask: Optional[TracedMod],
                  tanh_approx: bool):
    """``family(score, mask, tanh_approx=...)`` from ``table``, built on first use and kept (the latest
    _KERNELS_KEPT), for every kernel family (forward, backward, decode). The key holds the TracedMods
    themselves (see [Note] Cache keys)."""
    key = (score, mask, tanh_approx)
    kernel = table.get(key)
    if kernel is None:
        _import_triton()
        kernel = table[key] = family(score, mask, tanh_approx=tanh_approx)
        if len(table) > _KERNELS_KEPT:
            table.popitem(last=False)
    else:
        table.move_to_end(key)
    return kernel


def forward_kernel(score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool = False) -> ForwardKernel:
    """The forward kernel for these traced mods, built on first use and kept (the latest 256)."""
    return cached_kernel(_kernels, ForwardKernel, score, mask, tanh_approx)
