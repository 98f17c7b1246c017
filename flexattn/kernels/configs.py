"""Launch configurations: tiles, warps and pipeline stages per GPU and head dim for each kernel
family, the checks of the ones a caller pins through kernel_options, and autotuning's store.

The defaults come from sweeps on Hopper GPUs (benchmarks/sweep.py, sweep_backward.py; the numbers
are in docs/benchmarks_log.md, "What each speed change did"); other GPUs start from the same shapes
and shrink until shared memory fits. A configuration only sets speed: every fact correctness depends
on (bounds checks, layouts) is derived from the call by the family that plans the launch.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple, Optional

import torch

from ..codegen import cache_dir
from ..errors import InvalidInputError
from .launch import FLOAT8_DTYPES, interpreter_enabled

__all__ = [
    "LaunchConfig", "select_config", "BackwardConfig", "select_backward_config", "DecodeConfig",
    "select_decode_config", "tuned_configs", "next_pow2", "input_precision", "max_shared_memory", "fit_tile",
    "fit_to_mask", "check_int_option", "check_tile_option", "check_launch_sizes", "upcast_dots", "kv_as_float16",
]


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def input_precision(dtype: torch.dtype) -> str:
    if dtype != torch.float32:
        return "ieee"
    # fp32 inputs use tf32 tensor cores only when torch's own matmul setting allows it.
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "ieee"


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether a kernel's products of ``dtype`` operands run in float32: only under Triton's
    interpreter, which returns garbage from bfloat16 and FP8 dots ([Note] Interpreter dots in the
    forward template). Compiled kernels never do."""
    return interpreter_enabled() and (dtype == torch.bfloat16 or dtype in FLOAT8_DTYPES)


def kv_as_float16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a kernel runs a bfloat16 query's products with an FP8 key and value in float16 ([Note]
    An FP8 cache read by a bfloat16 query, templates/common.py.jinja)."""
    return q.dtype == torch.bfloat16 and k.dtype in FLOAT8_DTYPES and v.dtype in FLOAT8_DTYPES


def max_shared_memory(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


def check_int_option(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"kernel_options['{name}'] must be an int, got {value!r}")


def check_tile_option(name: str, value: int, block: int, what: str) -> None:
    """A tile pinned through kernel_options must be a power of two >= 16 dividing the mask's block."""
    if value < 16 or value & (value - 1) or block % value:
        raise InvalidInputError(
            f"kernel_options['{name}'] must be a power of two >= 16 that divides the BlockMask's {what} "
            f"block size {block}, got {value}"
        )


def check_launch_sizes(num_warps: int, num_stages: int, names: str = "num_warps must be 1, 2, 4, 8 or 16 and "
                       "num_stages") -> None:
    """Warps and stages pinned through kernel_options (``names`` says which keys the caller used)."""
    if num_warps not in (1, 2, 4, 8, 16) or num_stages < 1:
        raise InvalidInputError(f"kernel_options {names} >= 1, got {num_warps} and {num_stages}")


# ------------------------------------------------------------------------------------ forward


@dataclass(frozen=True)
class LaunchConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    USE_TMA: bool = False  # Q, K, V and O through tensor descriptors (Hopper's copy engine)
    WARP_SPECIALIZE: bool = False  # Triton's warp specialisation of the key loop
    HOST_DESCRIPTORS: bool = False  # with USE_TMA: descriptors built by the launcher, not per program


def shared_memory_bytes(cfg: LaunchConfig, elem_bytes: int, qk_dim_p2: int, v_dim_p2: int) -> int:
    """Upper estimate of the forward's shared memory: Q once, K and V tiles per pipeline stage."""
    q_tile = cfg.BLOCK_M * qk_dim_p2
    kv_tiles = cfg.BLOCK_N * (qk_dim_p2 + v_dim_p2) * max(1, cfg.num_stages - 1)
    return (q_tile + kv_tiles) * elem_bytes


# Defaults from benchmarks/sweep.py on Hopper (docs/benchmarks_log.md, "What each speed change did");
# other GPUs start from the same shapes and shrink until shared memory fits. AUTOTUNE searches around
# them per problem.
_GPU_DEFAULTS = {  # pointer loads, any GPU
    # (head dim up to, elem bytes): config
    (64, 2): LaunchConfig(64, 128, 4, 3),
    (128, 2): LaunchConfig(128, 64, 4, 3),
    (256, 2): LaunchConfig(64, 32, 4, 3),
    (64, 4): LaunchConfig(64, 64, 4, 3),
    (128, 4): LaunchConfig(64, 32, 4, 3),
    (256, 4): LaunchConfig(32, 32, 4, 2),
}


# Hopper with tensor descriptors, 16-bit inputs (benchmarks/sweep.py at 16k tokens; docs/benchmarks_log.md,
# "What each speed change did", second session): two pipeline stages beat three once the copy engine
# fetches K/V, and 128-row programs win at d=128.
_HOPPER_TMA_DEFAULTS = {
    64: LaunchConfig(64, 128, 4, 2, USE_TMA=True),
    128: LaunchConfig(128, 64, 4, 2, USE_TMA=True),
}
# The one warp-specialised configuration flexattn validated (Triton 3.6, Hopper, d=128, no mods),
# faster there than the best plain loop (docs/benchmarks_log.md, "What each speed change did").
# Triton 3.6 miscompiled every other case we tried: wrong results with captured tensors or masks in
# the loop, NaN with three stages, a 3x slower kernel with any masked tile outside the loop, and
# pointer stores of the per-row LSE that lose half the rows (the template stores it through a
# descriptor instead). So nothing else gets it by default, and calls that need row maxima never get
# it (see _plan).
_HOPPER_WS_CONFIG = LaunchConfig(128, 128, 4, 2, USE_TMA=True, WARP_SPECIALIZE=True)
# Rows that visit few blocks (document masks) run faster with descriptors built on the host than
# with pointer loads, at both head dims (docs/benchmarks_log.md, "What each speed change did", third session).
_HOPPER_SHORT_ROW_DEFAULTS = {
    64: LaunchConfig(64, 128, 4, 2, USE_TMA=True, HOST_DESCRIPTORS=True),
    128: LaunchConfig(64, 32, 4, 2, USE_TMA=True, HOST_DESCRIPTORS=True),
}


def warp_specialization_validated() -> bool:
    import triton

    return triton.__version__.startswith("3.6.")


MIN_TILE = 16  # tl.dot needs at least 16 rows and columns


def fit_tile(limit: int, block: int, name: str) -> int:
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


def fit_to_mask(cfg: LaunchConfig, sparse_q: int, sparse_kv: int) -> LaunchConfig:
    """cfg with power-of-two tiles that divide the BlockMask's blocks (48 -> 16, 96 -> 32)."""
    block_m = fit_tile(cfg.BLOCK_M, sparse_q, "BLOCK_M")
    block_n = fit_tile(cfg.BLOCK_N, sparse_kv, "BLOCK_N")
    if (block_m, block_n) == (cfg.BLOCK_M, cfg.BLOCK_N):
        return cfg
    return replace(cfg, BLOCK_M=block_m, BLOCK_N=block_n)


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
        return fit_to_mask(LaunchConfig(128, 128, 4, 1), sparse_q, sparse_kv)
    elem = dtype.itemsize
    dim = max(qk_dim, v_dim)
    bucket = next((d for d in (64, 128, 256) if dim <= d), 256)
    base = _GPU_DEFAULTS[(bucket, 2 if elem <= 2 else 4)]
    sparse_rows = has_mask_mod and blocks_per_row < 8
    if has_mask_mod and elem == 2 and bucket in (64, 128):
        # Masks whose rows visit few blocks (documents, short windows) want more, smaller programs;
        # dense-row masks (causal, prefix) want 128 query rows per program (benchmarks/sweep.py;
        # docs/benchmarks_log.md, "What each speed change did").
        if sparse_rows:
            base = LaunchConfig(64, 128, 4, 3) if bucket == 64 else LaunchConfig(64, 64, 4, 3)
        else:
            base = LaunchConfig(128, 128, 4, 3) if bucket == 64 else LaunchConfig(128, 128, 8, 3)
    if elem == 1 and bucket in (64, 128):
        # FP8 products: 128x128 tiles with 4 warps, the fastest of the five tried at both head dims,
        # faster than the 16-bit defaults (flexattn/bench/fp8.py; docs/benchmarks_log.md, "FP8
        # forward and FP8-cache decoding"). Pointer loads: no descriptors for FP8 yet.
        base = LaunchConfig(128, 128, 4, 3)
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
    cfg = fit_to_mask(base, sparse_q, sparse_kv)
    limit = max_shared_memory(device)
    qk_p2, v_p2 = next_pow2(qk_dim), next_pow2(v_dim)
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


def candidate_configs(base: LaunchConfig, sparse_q: int, sparse_kv: int) -> list[LaunchConfig]:
    shapes = [(128, 128), (128, 64), (64, 64), (64, 128), (128, 32), (64, 32)]
    out = {base}
    for bm, bn in shapes:
        for warps in (4, 8):
            for stages in (2, 3, 4):
                cfg = LaunchConfig(bm, bn, warps, stages, base.USE_TMA, HOST_DESCRIPTORS=base.HOST_DESCRIPTORS)
                out.add(fit_to_mask(cfg, sparse_q, sparse_kv))
    return sorted(out, key=lambda c: (c != base, -c.BLOCK_M, -c.BLOCK_N, c.num_warps, c.num_stages))


class _TunedConfigs:
    """Autotuned choices, kept in ``<cache dir>/autotune.json`` so later processes reuse them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._table: Optional[dict] = None
        self.searches = 0  # run in this process (a stored choice from an earlier process adds none)

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

OPTION_KEYS = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}  # keys that pin the launch config


def pinned_config(options: dict, default: LaunchConfig, sparse_q: int, sparse_kv: int) -> LaunchConfig:
    # A pinned shape keeps the default's load path; warp specialisation only when asked for.
    cfg = LaunchConfig(
        **{k: int(options.get(k, getattr(default, k))) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")},
        USE_TMA=default.USE_TMA, HOST_DESCRIPTORS=default.HOST_DESCRIPTORS,
    )
    check_tile_option("BLOCK_M", cfg.BLOCK_M, sparse_q, "query")
    check_tile_option("BLOCK_N", cfg.BLOCK_N, sparse_kv, "key")
    check_launch_sizes(cfg.num_warps, cfg.num_stages)
    return cfg


# ------------------------------------------------------------------------------------ backward


@dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the two main kernels, with torch's names: the dK/dV kernel owns BLOCK_N1 keys and
    walks BLOCK_M1 queries at a time; the dQ kernel owns BLOCK_M2 queries and walks BLOCK_N2 keys."""

    BLOCK_M1: int
    BLOCK_N1: int
    BLOCK_M2: int
    BLOCK_N2: int
    num_warps: int  # both kernels, unless num_warps2 sets the dQ kernel's
    num_stages: int
    num_warps2: int = 0  # dQ kernel; 0: num_warps
    num_stages2: int = 0
    USE_TMA: bool = False  # stream the walked tiles through tensor descriptors (Hopper's copy engine)

    def dkdv(self) -> LaunchConfig:
        return LaunchConfig(self.BLOCK_M1, self.BLOCK_N1, self.num_warps, self.num_stages)

    def dq(self) -> LaunchConfig:
        return LaunchConfig(self.BLOCK_M2, self.BLOCK_N2, self.num_warps2 or self.num_warps,
                            self.num_stages2 or self.num_stages)


# (head dim up to, 16-bit inputs, has a mask_mod): defaults from per-kernel sweeps at 16k tokens
# (docs/benchmarks_log.md, "Backward: the Triton kernels (2026-11-22, issue 9)"). 64x64 tiles, 4 warps
# and two stages win for both kernels, at both head dims, with and without a mask; a third stage
# spills registers on the causal mask's partial blocks at d128. The walked tiles go through tensor
# descriptors where the layout allows (USE_TMA), which was faster.
_GPU_BACKWARD_DEFAULTS = {
    (64, True, False): BackwardConfig(64, 64, 64, 64, 4, 2, USE_TMA=True),
    (64, True, True): BackwardConfig(64, 64, 64, 64, 4, 2, USE_TMA=True),
    (128, True, False): BackwardConfig(64, 64, 64, 64, 4, 2, USE_TMA=True),
    # dQ on masks at d128: 128x128 programs with 8 warps, 2-5% faster than 64x64 (slower without a mask).
    (128, True, True): BackwardConfig(64, 64, 128, 128, 4, 2, num_warps2=8, USE_TMA=True),
    (256, True, False): BackwardConfig(32, 64, 64, 32, 8, 2),
    (256, True, True): BackwardConfig(32, 64, 64, 32, 8, 2),
    (64, False, False): BackwardConfig(32, 64, 64, 32, 4, 2),
    (64, False, True): BackwardConfig(32, 64, 64, 32, 4, 2),
    (128, False, False): BackwardConfig(32, 64, 64, 32, 8, 2),
    (128, False, True): BackwardConfig(32, 64, 64, 32, 8, 2),
    (256, False, False): BackwardConfig(16, 32, 32, 16, 8, 1),
    (256, False, True): BackwardConfig(16, 32, 32, 16, 8, 1),
}


def backward_shared_memory_bytes(cfg: BackwardConfig, elem: int, qk_p2: int, v_p2: int) -> int:
    """Upper estimate for the larger of the two kernels: the resident tiles (K and V, or Q and dO)
    once, the streamed ones per pipeline stage, and the transposed score tiles."""
    stages = max(1, cfg.num_stages - 1)
    dkdv = (cfg.BLOCK_N1 * (qk_p2 + v_p2) + cfg.BLOCK_M1 * (qk_p2 + v_p2) * stages) * elem
    dkdv += 2 * cfg.BLOCK_M1 * cfg.BLOCK_N1 * elem
    dq = (cfg.BLOCK_M2 * (qk_p2 + v_p2) + cfg.BLOCK_N2 * (qk_p2 + v_p2) * stages) * elem
    dq += cfg.BLOCK_M2 * cfg.BLOCK_N2 * elem
    return max(dkdv, dq)


def fit_backward(cfg: BackwardConfig, sparse_q: int, sparse_kv: int) -> BackwardConfig:
    dkdv = fit_to_mask(cfg.dkdv(), sparse_q, sparse_kv)
    dq = fit_to_mask(cfg.dq(), sparse_q, sparse_kv)
    return replace(cfg, BLOCK_M1=dkdv.BLOCK_M, BLOCK_N1=dkdv.BLOCK_N, BLOCK_M2=dq.BLOCK_M, BLOCK_N2=dq.BLOCK_N)


# Masks whose rows visit few blocks (documents), where each program's set-up is a larger share:
# d64 prefers 32-row steps under 64-key programs and 32-key steps; d128 prefers pointer loads, whose
# programs skip the descriptors' set-up (per-kernel sweeps of the document mask; docs/benchmarks_log.md,
# "Backward: the Triton kernels (2026-11-22, issue 9)").
_GPU_BACKWARD_SHORT_ROWS = {
    64: BackwardConfig(32, 64, 64, 32, 4, 2, USE_TMA=True),
    128: BackwardConfig(64, 64, 64, 64, 4, 2),
}


def select_backward_config(device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int,
                           sparse_q: int, sparse_kv: int, has_mask_mod: bool = False,
                           blocks_per_row: float = float("inf")) -> BackwardConfig:
    if interpreter_enabled() or device.type != "cuda":
        # The interpreter runs each program in numpy: fewer, larger tiles are faster.
        return fit_backward(BackwardConfig(64, 64, 64, 64, 4, 1), sparse_q, sparse_kv)
    bucket = next((d for d in (64, 128, 256) if max(qk_dim, v_dim) <= d), 256)
    base = _GPU_BACKWARD_DEFAULTS[(bucket, dtype.itemsize <= 2, has_mask_mod)]
    if has_mask_mod and blocks_per_row < 8 and dtype.itemsize <= 2 and bucket in _GPU_BACKWARD_SHORT_ROWS:
        base = _GPU_BACKWARD_SHORT_ROWS[bucket]
    cfg = fit_backward(base, sparse_q, sparse_kv)
    limit = max_shared_memory(device)
    qk_p2, v_p2 = next_pow2(qk_dim), next_pow2(v_dim)
    while backward_shared_memory_bytes(cfg, dtype.itemsize, qk_p2, v_p2) > limit:
        if cfg.num_stages > 1:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif max(cfg.BLOCK_M1, cfg.BLOCK_N2) > 16:
            cfg = replace(cfg, BLOCK_M1=max(16, cfg.BLOCK_M1 // 2), BLOCK_N2=max(16, cfg.BLOCK_N2 // 2))
        elif max(cfg.BLOCK_N1, cfg.BLOCK_M2) > 16:
            cfg = replace(cfg, BLOCK_N1=max(16, cfg.BLOCK_N1 // 2), BLOCK_M2=max(16, cfg.BLOCK_M2 // 2))
        else:
            break
    return cfg


BACKWARD_TILE_KEYS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")


def pinned_backward_config(options: dict, default: BackwardConfig, sparse_q: int, sparse_kv: int) -> BackwardConfig:
    """``default`` with the tiles and launch sizes the caller pinned through kernel_options."""
    values = {k: options.get(k, getattr(default, k)) for k in BACKWARD_TILE_KEYS}
    for key in ("num_warps", "num_stages"):
        # torch's rule: a bwd_ key sets the backward alone, a plain key sets both passes.
        value = options[f"bwd_{key}"] if f"bwd_{key}" in options else options.get(key)
        values[key] = getattr(default, key) if value is None else value
    for key, value in values.items():
        check_int_option(key, value)
    blocks = {"BLOCK_M1": (sparse_q, "query"), "BLOCK_M2": (sparse_q, "query"),
              "BLOCK_N1": (sparse_kv, "key"), "BLOCK_N2": (sparse_kv, "key")}
    for key, (block, what) in blocks.items():
        check_tile_option(key, values[key], block, what)
    check_launch_sizes(values["num_warps"], values["num_stages"],
                       "num_warps / bwd_num_warps must be 1, 2, 4, 8 or 16 and num_stages / bwd_num_stages")
    # A pinned launch size applies to both kernels; an unpinned one keeps the default's per-kernel values.
    for key in ("num_warps", "num_stages"):
        given = options[f"bwd_{key}"] if f"bwd_{key}" in options else options.get(key)
        if given is not None:
            values[f"{key}2"] = 0
    return replace(default, **values)


def backward_pinned(options: dict) -> bool:
    return any(k in options for k in (*BACKWARD_TILE_KEYS, "bwd_num_warps", "bwd_num_stages", "num_warps",
                                      "num_stages"))


# ------------------------------------------------------------------------------------ decode


class DecodeConfig(NamedTuple):
    BLOCK_N: int
    num_warps: int
    num_stages: int


# (head dim up to, 16-bit inputs): a memory-bound loop wants deep pipelines of K/V tiles. d128:
# 128-key tiles with 4 warps and 2 stages were the best or close to it in CUDA-graph-timed sweeps at
# small and large batches; the stage count hardly mattered, smaller key tiles were slower, and K/V
# tiles through tensor descriptors were slower than pointer loads in every case (not kept). Other
# GPUs and fp32 are not swept. Numbers: docs/benchmarks_log.md, "Decoding: the split-KV decode kernel".
_GPU_DECODE_DEFAULTS = {
    (64, True): DecodeConfig(128, 4, 3),
    (128, True): DecodeConfig(128, 4, 2),
    (256, True): DecodeConfig(32, 4, 2),
    (64, False): DecodeConfig(64, 4, 3),
    (128, False): DecodeConfig(32, 4, 3),
    (256, False): DecodeConfig(16, 4, 2),
}


def select_decode_config(q: torch.Tensor, v: torch.Tensor, sparse_kv: int, options: dict) -> DecodeConfig:
    if interpreter_enabled() or q.device.type != "cuda":
        cfg = DecodeConfig(128, 4, 1)
    else:
        bucket = next((d for d in (64, 128, 256) if max(q.shape[-1], v.shape[-1]) <= d), 256)
        cfg = _GPU_DECODE_DEFAULTS[(bucket, q.element_size() <= 2)]
    pinned = {k: options[k] for k in ("BLOCK_N", "num_warps", "num_stages") if options.get(k) is not None}
    for key, value in pinned.items():
        check_int_option(key, value)
    cfg = cfg._replace(**pinned)
    if "BLOCK_N" in pinned:
        check_tile_option("BLOCK_N", cfg.BLOCK_N, sparse_kv, "key")
    else:
        cfg = cfg._replace(BLOCK_N=fit_tile(cfg.BLOCK_N, sparse_kv, "BLOCK_N"))
    check_launch_sizes(cfg.num_warps, cfg.num_stages)
    if q.device.type == "cuda" and not interpreter_enabled() and not pinned:
        limit = max_shared_memory(q.device)
        dims = next_pow2(q.shape[-1]) + next_pow2(v.shape[-1])
        while cfg.BLOCK_N * dims * q.element_size() * max(1, cfg.num_stages - 1) > limit and cfg.BLOCK_N > 16:
            cfg = cfg._replace(BLOCK_N=cfg.BLOCK_N // 2)
    return cfg
