"""Context parallelism on several GPUs: the check, the throughput and memory, and torch's baseline.

    python -m benchmarks.context_parallel_gpus --worlds 1,2 --check --torch --model --out cp_gpus.json
    python -m benchmarks.context_parallel_gpus --smoke --check --torch      # tiny, CPU ranks on gloo

One process per GPU (``torch.multiprocessing`` spawn, NCCL), one spawn per world size, the largest
first; world 1 is plain single-GPU flexattn (and torch's compiled flex_attention), no
ContextParallel. The problem: batch 1, bf16, 16 query heads and 4 K/V heads (GQA), head dim 128.

``--check`` (worlds of 2 and more): causal, document, sliding-window, prefix-LM and ALiBi at
``--check-tokens``, forward and backward of ``ContextParallel(block_mask, balance).flex_attention``
against single-GPU flexattn by the flash-attention rule: the error against a float32 run (float64 on
the CPU) at most twice single-GPU flexattn's own bf16 error. With ``--torch``, torch's context
parallelism is checked the same way (``--torch-check-masks``), after the throughput cases.

Throughput (unless ``--no-throughput``): one attention layer, forward and backward, per mask, length,
world and balance; 1 warm-up, then ``--iters`` iterations, each between a barrier and a device
synchronise; an iteration's time is the slowest rank's, the row's the median. Inputs are random
shards of the plan's shard shape (the global tensors are never built); the global BlockMask is.
TFLOP/s count the allowed (q, kv) pairs: ``4 * Hq * d * pairs`` forward, 3.5 times that with the
backward. Peak memory is each rank's over the timed iterations (inputs and plan included).

``--torch`` adds torch's design (``torch.distributed.tensor.experimental._attention``):
``_ContextParallel(seq_dim=2, FLEX)`` on a module that calls compiled torch ``flex_attention``,
K/V all-gathered by its pre-hook, the shards and BlockMask from ``_context_parallel_shard`` with no
load balancer (``none``), ``_HeadTailLoadBalancer`` (``head_tail``) or ``_PTRRLoadBalancer``
(``ptrr``). torch's flex_attention has no backward on the CPU: there it runs forward only, eager.

Every row is printed as it completes and the JSON (``--out``) rewritten after each, so a run cut off
keeps what it measured; ``--budget-s`` skips cases that would not finish in time (shared among
the worlds by their estimated work) instead. A failing case is recorded with its error; the rest go
on. ``--model`` adds the cost model's prediction of each throughput row (NVLink 4).
"""

from __future__ import annotations

import os

# NVLink multicast stays off: a program that uses it can put the host's shared GPUs out of service.
# Set before torch (and NCCL) load; children inherit it and set it again before their init.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def keep_multicast_off() -> None:
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


keep_multicast_off()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flexattn import create_block_mask, flex_attention  # noqa: E402
from flexattn.bench.common import block_density  # noqa: E402
from benchmarks.context_parallel import (  # noqa: E402
    BACKWARD_TFLOPS, FORWARD_TFLOPS, LINKS, WINDOW, _max_err, mods_of,
)
from benchmarks.torch_context_parallel import TORCH_BALANCES, TorchBaseline, torch_block_mask  # noqa: E402
from flexattn.distributed import ContextParallel, CostModel, Problem  # noqa: E402
from flexattn.distributed.cost import BACKWARD_COMPUTE, allgather_kv_seconds  # noqa: E402
from flexattn.variants import (  # noqa: E402
    causal_mask, document_ids, generate_document_mask, generate_prefix_lm, generate_sliding_window,
)

IMPLS = ("flexattn", "torch_cp")
THROUGHPUT_MASKS = ("causal", "document", "sliding_window")
CHECK_VARIANTS = ("causal", "document", "sliding_window", "prefix_lm", "alibi")
BALANCES = ("mask", "zigzag", "contiguous")
ATOL = 1e-6  # the flash-attention rule's allowance for outputs near zero (as benchmarks/context_parallel.py)
GIB = 2.0 ** 30
# For the time estimates that order the cases and keep to --budget-s (not for any result): torch's
# kernels at about 0.7 of flexattn's; a static torch.compile of flex forward+backward per new shape
# or mask, a dynamic one about twice per mask; torch's CP compiles create_block_mask per case.
TORCH_SPEED = 0.7
TORCH_COMPILE_S = {"static": 25.0, "dynamic": 12.0}
TORCH_CP_MASK_S = 6.0
CPU_FLOPS = 10e9
# Where torch.compile's errors come from: a dynamic compile that fails there is retried statically.
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch._higher_order_ops", "torch.fx",
                    "triton")


# ------------------------------------------------------------------------------------------------
# What runs
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """The run's settings, the same in every process."""

    device: str
    dtype: str
    heads: int
    kv_heads: int
    dim: int
    block: int
    tokens: tuple
    masks: tuple
    worlds: tuple
    world_tokens: tuple  # ((world, (tokens, ...)), ...): lengths of that world in place of ``tokens``
    impls: tuple
    throughput_impls: tuple  # the impls measured (the others only checked)
    balances: tuple
    torch_balances: tuple
    all_balances_tokens: Optional[int]
    schedule: str
    iters: int
    doc_tokens: tuple
    check: bool
    check_tokens: int
    check_variants: tuple
    torch_check_masks: tuple
    throughput: bool
    torch_compile: str
    torch_calibrate: bool
    model: bool
    out: str
    collective_timeout_s: float
    seed: int = 0

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def gqa(self) -> bool:
        return self.heads != self.kv_heads

    def tokens_of(self, world: int) -> tuple:
        return dict(self.world_tokens).get(world, self.tokens)


@dataclasses.dataclass(frozen=True)
class Case:
    """One row: a throughput measurement, or a check of one implementation and balance."""

    part: str  # "check" or "throughput"
    impl: str  # "flexattn" or "torch_cp"
    mask: str  # a throughput mask, or a check variant
    tokens: int
    world: int
    balance: Optional[str] = None  # None at world 1
    compile: Optional[str] = None  # torch: "static" or "dynamic" (None on the CPU: eager)

    def label(self) -> str:
        extra = "".join(f" {x}" for x in (self.balance, self.compile) if x)
        return f"{self.part} {self.impl} {self.mask} {self.tokens} tokens, world {self.world}{extra}"


def _runs_balance(setup: Setup, balances: tuple, balance: str, tokens: int) -> bool:
    # The first balance runs at every length; the others up to --all-balances-tokens.
    return balance == balances[0] or setup.all_balances_tokens is None or tokens <= setup.all_balances_tokens


def throughput_cases(setup: Setup, world: int) -> list:
    cases = []
    torch_compile = setup.torch_compile if setup.cuda else None
    for mask in setup.masks:
        for tokens in setup.tokens_of(world):
            if "flexattn" in setup.throughput_impls:
                if world == 1:
                    cases.append(Case("throughput", "flexattn", mask, tokens, 1))
                cases += [Case("throughput", "flexattn", mask, tokens, world, b) for b in setup.balances
                          if world > 1 and _runs_balance(setup, setup.balances, b, tokens)]
            if "torch_cp" in setup.throughput_impls:
                if world == 1:
                    cases.append(Case("throughput", "torch_cp", mask, tokens, 1, compile=torch_compile))
                cases += [Case("throughput", "torch_cp", mask, tokens, world, b, torch_compile)
                          for b in setup.torch_balances
                          if world > 1 and _runs_balance(setup, setup.torch_balances, b, tokens)]
    if world == 1 and "torch_cp" in setup.throughput_impls and setup.cuda and setup.torch_calibrate \
            and setup.torch_compile == "dynamic":
        # One static compile beside the dynamic ones: what dynamic shapes cost torch's kernels.
        cases.append(Case("throughput", "torch_cp", setup.masks[0], min(setup.tokens_of(1)), 1, compile="static"))
    return cases


def throughput_groups(setup: Setup, world: int) -> list:
    """((mask, tokens), cases) in the order they run: one global BlockMask per group, the
    cheapest groups first (a run cut short loses the costliest)."""
    groups: dict = {}
    for case in throughput_cases(setup, world):
        groups.setdefault((case.mask, case.tokens), []).append(case)

    def cost(key):
        return mask_seconds(setup, key[1]) + sum(estimate_seconds(setup, c) for c in groups[key])

    return [(key, groups[key]) for key in sorted(groups, key=cost)]


def check_cases(setup: Setup, world: int) -> list:
    if world < 2 or not setup.check:
        return []
    cases = []
    torch_compile = setup.torch_compile if setup.cuda else None
    for variant in setup.check_variants:
        if "flexattn" in setup.impls:
            cases += [Case("check", "flexattn", variant, setup.check_tokens, world, b) for b in setup.balances]
        if "torch_cp" in setup.impls and variant in setup.torch_check_masks:
            cases += [Case("check", "torch_cp", variant, setup.check_tokens, world, b, torch_compile)
                      for b in setup.torch_balances]
    return cases


# ------------------------------------------------------------------------------------------------
# Masks, pairs, FLOPs and the time estimates
# ------------------------------------------------------------------------------------------------


def document_lengths(total: int, low: int, high: int, seed: int = 0) -> list:
    """Random document lengths from ``low`` to ``high`` tokens that add up to ``total`` (fixed seed):
    each draw leaves room for one more whole document (needs ``high >= 2 * low``)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > high:
        top = min(high, left - low)
        lengths.append(int(torch.randint(low, top + 1, (1,), generator=gen)))
        left -= lengths[-1]
    return lengths + [left]


def throughput_mods(setup: Setup, name: str, tokens: int, device) -> tuple:
    """(mask_mod, facts for the row) of a throughput mask."""
    if name == "causal":
        return causal_mask, {}
    if name == "sliding_window":
        window = min(WINDOW, tokens // 4)
        return generate_sliding_window(window), {"window": window}
    lengths = document_lengths(tokens, *setup.doc_tokens, seed=setup.seed)
    facts = {"documents": len(lengths), "document_tokens_min": min(lengths), "document_tokens_max": max(lengths)}
    return generate_document_mask(document_ids(lengths, device)), facts


def check_mods(name: str, tokens: int, heads: int, device) -> tuple:
    """(score_mod, mask_mod) of a check variant: the one-GPU bench's, and prefix-LM."""
    if name == "prefix_lm":
        return None, generate_prefix_lm(tokens // 4)
    return mods_of(name, tokens, heads, device)


def allowed_pairs(setup: Setup, name: str, tokens: int) -> int:
    """The (q, kv) pairs a throughput mask keeps, counted exactly."""
    if name == "causal":
        return tokens * (tokens + 1) // 2
    if name == "sliding_window":  # q sees q - window .. q
        window = min(WINDOW, tokens // 4)
        if tokens <= window + 1:
            return tokens * (tokens + 1) // 2
        return (window + 1) * (window + 2) // 2 + (tokens - window - 1) * (window + 1)
    return sum(n * (n + 1) // 2 for n in document_lengths(tokens, *setup.doc_tokens, seed=setup.seed))


def _slowest_share(mask: str, balance: Optional[str], world: int) -> float:
    """The slowest rank's share of the work, times ``world`` (1: even), for the estimates."""
    if mask == "causal" and balance in ("contiguous", "none") and world > 1:
        return (2 * world - 1) / world  # the last rank's rows see the whole sequence
    return 1.0


def estimate_seconds(setup: Setup, case: Case) -> float:
    """A rough wall time of one case (warm-up included), to order the cases and keep to the budget."""
    if case.part == "check":
        if not setup.cuda:
            return 1.0 if case.impl == "flexattn" else 4.0
        if case.impl == "flexattn":
            return 5.0
        return TORCH_COMPILE_S[case.compile] + TORCH_CP_MASK_S
    fwd_flops = 4.0 * setup.heads * setup.dim * allowed_pairs(setup, case.mask, case.tokens)
    if setup.cuda:
        per_iter = fwd_flops * (1 / FORWARD_TFLOPS[case.mask] + BACKWARD_COMPUTE / BACKWARD_TFLOPS[case.mask]) / 1e12
    else:
        per_iter = 3.5 * fwd_flops / CPU_FLOPS
    per_iter *= _slowest_share(case.mask, case.balance, case.world) / case.world
    if case.impl == "flexattn":
        fixed = 3.0 if setup.cuda else 0.5  # the plan, the first call's kernels
    else:
        per_iter /= TORCH_SPEED
        fixed = TORCH_COMPILE_S[case.compile] if case.compile else 0.0
        fixed += (TORCH_CP_MASK_S if setup.cuda else 3.0) if case.world > 1 else 0.0
    return fixed + (1 + setup.iters) * per_iter


def mask_seconds(setup: Setup, tokens: int) -> float:
    """Building a global BlockMask (once per mask and length): the mask_mod over every pair."""
    return 0.5 + 2e-11 * tokens ** 2 if setup.cuda else 0.2


def check_variant_seconds(setup: Setup, cases: list) -> float:
    return (8.0 if setup.cuda else 1.0) + sum(estimate_seconds(setup, c) for c in cases)


def world_seconds(setup: Setup, world: int) -> float:
    start = 20.0 if setup.cuda else 5.0  # processes, imports, the process group
    cases = throughput_cases(setup, world)
    groups = {(c.mask, c.tokens) for c in cases}
    checks = check_cases(setup, world)
    variants = {c.mask for c in checks}
    return (start + sum(estimate_seconds(setup, c) for c in cases) + sum(mask_seconds(setup, n) for _, n in groups)
            + sum(check_variant_seconds(setup, [c for c in checks if c.mask == v]) for v in variants))


def _model_machine(mask: str):
    """The cost model's forward and backward machines for a mask, as benchmarks/context_parallel.py's
    --model table has them (NVLink 4; measured throughput counts partial tiles at their cost)."""
    forward = CostModel(flops_per_s=FORWARD_TFLOPS[mask] * 1e12, link_bytes_per_s=LINKS["NVLink 4"],
                        step_latency_s=30e-6, memory_bytes_per_s=3.0e12, partial_tile_cost=1.0)
    return forward, dataclasses.replace(forward, flops_per_s=BACKWARD_TFLOPS[mask] * 1e12)


# ------------------------------------------------------------------------------------------------
# The report file
# ------------------------------------------------------------------------------------------------


def read_report(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def write_report(path: str, report: dict) -> None:
    """Write whole and then rename: a run cut off never leaves half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)


def update_report(path: str, change) -> None:
    report = read_report(path)
    change(report)
    write_report(path, report)


def _command_output(argv: list, limit: int = 6000) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        return (done.stdout + done.stderr)[:limit]
    except Exception as err:  # no nvidia-smi, or it hung: the run goes on without it
        return f"unavailable: {type(err).__name__}: {err}"


def environment(setup: Setup) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
           "cuda": torch.version.cuda, "multicast_env": {name: os.environ.get(name) for name in MULTICAST_OFF},
           "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as err:
        env["triton"] = f"unavailable: {err}"
    if setup.cuda:
        try:
            env["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as err:
            env["nccl"] = f"unavailable: {err}"
        env["gpus"] = _command_output(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                                       "--format=csv,noheader"])
        env["topology"] = _command_output(["nvidia-smi", "topo", "-m"])
        env["nvlink"] = _command_output(["nvidia-smi", "nvlink", "--status"])
    return env


# ------------------------------------------------------------------------------------------------
# One rank
# ------------------------------------------------------------------------------------------------


class Rank:
    """What one process runs: flexattn's checks, the throughput cases (cheapest first), torch's
    checks."""

    def __init__(self, rank: int, world: int, device: torch.device, setup: Setup, deadline: Optional[float]) -> None:
        self.rank, self.world, self.device, self.setup, self.deadline = rank, world, device, setup, deadline
        self.dtype = getattr(torch, setup.dtype)
        self.problem = Problem(1, setup.heads, 1, setup.kv_heads, setup.dim, setup.dim,
                               torch.empty((), dtype=self.dtype).element_size())
        self._torch: Optional[TorchBaseline] = None
        self.dynamic_failed = False
        self.compiler_failed = False  # whether the last guarded run failed in torch's compiler

    # ---------------------------------------------------------------------------- collectives

    def barrier(self) -> None:
        dist.barrier()
        if self.setup.cuda:
            torch.cuda.synchronize()

    def gather_values(self, values: list) -> list:
        """Each rank's list of floats (None travels as NaN), in rank order."""
        mine = torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float64,
                            device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine)
        return [[None if x != x else x for x in part.tolist()] for part in parts]

    def gather_objects(self, obj) -> list:
        parts = [None] * self.world
        dist.all_gather_object(parts, obj)
        return parts

    def decide(self, estimate: float) -> bool:
        """Rank 0's word on whether a case of ``estimate`` seconds fits the budget (every rank
        must take the same branch)."""
        go = self.deadline is None or time.time() + estimate <= self.deadline
        flag = torch.tensor([1 if go else 0], device=self.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    # ---------------------------------------------------------------------------- rows

    def record(self, row: dict) -> None:
        if self.rank != 0:
            return
        update_report(self.setup.out, lambda report: report["rows"].append(row))
        print("row " + json.dumps(row, default=str), flush=True)

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(f"[world {self.world}, {time.strftime('%H:%M:%S')}] {text}", flush=True)

    def base_row(self, case: Case) -> dict:
        s = self.setup
        return {"part": case.part, "impl": case.impl, "mask": case.mask, "tokens": case.tokens, "world": case.world,
                "balance": case.balance, "compile": case.compile, "batch": 1, "heads": s.heads,
                "kv_heads": s.kv_heads, "dim": s.dim, "dtype": s.dtype, "block": s.block}

    def run_guarded(self, case: Case, row: dict, fn) -> None:
        """Run ``fn`` (every rank), catching its error; any rank's error goes into the row."""
        error = None
        try:
            row.update(fn() or {})
        except Exception as err:
            error = (f"{type(err).__name__}: {err}"[:2000], type(err).__module__)
            print(f"[rank {self.rank}] {case.label()} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        errors = self.gather_objects(error)
        failed = {f"rank {r}": e[0] for r, e in enumerate(errors) if e is not None}
        self.compiler_failed = any(e is not None and e[1].startswith(COMPILER_MODULES) for e in errors)
        if failed:
            row["error"] = failed
            row["ok"] = False
        self.free()

    def free(self) -> None:
        gc.collect()
        if self.setup.cuda:
            torch.cuda.empty_cache()

    def compile_mode(self, case: Case) -> Case:
        """After a dynamic compile failed once in this process, torch's cases compile statically."""
        if case.compile == "dynamic" and self.dynamic_failed:
            return dataclasses.replace(case, compile="static")
        return case

    def after_dynamic_failure(self, case: Case, row: dict, run) -> dict:
        """A torch case whose dynamic compile failed runs again compiled statically (every rank
        failed alike: the same code), the first error kept in the row."""
        if case.compile != "dynamic" or "error" not in row or not self.compiler_failed:
            return row
        self.dynamic_failed = True
        static = dataclasses.replace(case, compile="static")
        again = {**self.base_row(static), "dynamic_compile_error": row["error"]}
        self.run_guarded(static, again, lambda: run(static))
        return again

    def torch_baseline(self) -> TorchBaseline:
        if self._torch is None:
            self._torch = TorchBaseline(self.world, self.device)
        return self._torch

    # ---------------------------------------------------------------------------- the run

    def run(self) -> None:
        s = self.setup
        try:
            name = torch.cuda.get_device_name(self.device) if s.cuda else platform.processor()
        except Exception as err:
            name = f"unknown: {err}"
        names = self.gather_objects(name)
        if self.rank == 0:
            info = {"devices": names, "backend": dist.get_backend()}
            update_report(s.out, lambda report: report["worlds"].setdefault(str(self.world), {}).update(info))
        # torch's checks last: its compiles may take what is left, never flexattn's measurements
        if s.check and self.world > 1:
            self.run_checks("flexattn")
        if s.throughput:
            self.run_throughput()
        if s.check and self.world > 1:
            self.run_checks("torch_cp")

    # ---------------------------------------------------------------------------- checks

    def run_checks(self, impl: str) -> None:
        s = self.setup
        cases = [c for c in check_cases(s, self.world) if c.impl == impl]
        for variant in s.check_variants:
            mine = [c for c in cases if c.mask == variant]
            if not mine:
                continue
            if not self.decide(check_variant_seconds(s, mine)):
                for case in mine:
                    self.record({**self.base_row(case), "skipped": "time budget"})
                continue
            self.say(f"check {variant} at {s.check_tokens} tokens: {[c.label() for c in mine]}")
            inputs, error = None, None
            try:
                inputs = self.check_inputs(variant)
                if self.rank == 0:
                    inputs.update(self.reference(inputs))
            except Exception as err:  # caught on its rank; every rank then learns of it below
                error = f"{type(err).__name__}: {err}"[:2000]
                traceback.print_exc()
            errors = [e for e in self.gather_objects(error) if e]
            for case in mine:
                row = self.base_row(case)
                if errors:
                    row.update(error={"inputs": errors[0]}, ok=False)
                elif case.impl == "flexattn":
                    self.run_guarded(case, row, lambda: self.check_flexattn(case, inputs))
                else:
                    case = self.compile_mode(case)
                    row = self.base_row(case)
                    self.run_guarded(case, row, lambda: self.check_torch(case, inputs))
                    row = self.after_dynamic_failure(case, row, lambda c: self.check_torch(c, inputs))
                self.record(row)
            inputs = None
            self.free()

    def check_inputs(self, variant: str) -> dict:
        """The global inputs of a check and its mask: the same on every rank (drawn on the CPU from
        one seed)."""
        s, N = self.setup, self.setup.check_tokens
        score_mod, mask_mod = check_mods(variant, N, s.heads, self.device)
        bm = create_block_mask(mask_mod, None, None, N, N, device=self.device, BLOCK_SIZE=s.block)
        gen = torch.Generator().manual_seed(s.seed + 1)

        def draw(heads):
            return torch.randn(1, heads, N, s.dim, generator=gen).to(self.device, self.dtype)

        q, k, v, grad_out = draw(s.heads), draw(s.kv_heads), draw(s.kv_heads), draw(s.heads)
        return {"q": q, "k": k, "v": v, "grad_out": grad_out, "bm": bm, "score_mod": score_mod}

    def reference(self, inputs: dict) -> dict:
        """Rank 0: the reference (float32 on GPUs, float64 on the CPU) and single-GPU flexattn's
        errors against it, for out, dq, dk, dv."""
        s = self.setup
        reference_dtype = torch.float32 if s.cuda else torch.float64

        def single(dtype):
            # detach first: .to() of the same dtype is the input itself, shared with the CP run
            leaves = [inputs[name].detach().to(dtype).requires_grad_() for name in ("q", "k", "v")]
            out = flex_attention(*leaves, score_mod=inputs["score_mod"], block_mask=inputs["bm"], enable_gqa=s.gqa)
            grads = torch.autograd.grad(out, leaves, inputs["grad_out"].to(dtype))
            return [out.detach(), *grads]

        reference = single(reference_dtype)
        low = single(self.dtype)
        return {"reference": reference, "single_err": [_max_err(a, b) for a, b in zip(low, reference)],
                "reference_dtype": str(reference_dtype).replace("torch.", "")}

    def compare(self, got: list, inputs: dict, names=("out", "dq", "dk", "dv")) -> dict:
        """Errors against the reference and the flash-attention rule (rank 0)."""
        if self.rank != 0:
            return {}
        row = {"reference_dtype": inputs["reference_dtype"]}
        oks = []
        for name, value, ref, single in zip(names, got, inputs["reference"], inputs["single_err"]):
            err = _max_err(value, ref)
            ok = bool(err <= 2 * single + ATOL) and tuple(value.shape) == tuple(ref.shape)
            row.update({f"{name}_err": err, f"{name}_single_gpu_err": single, f"{name}_ok": ok})
            oks.append(ok)
        row["ok"] = all(oks)
        return row

    def check_flexattn(self, case: Case, inputs: dict) -> dict:
        cp = ContextParallel(inputs["bm"], balance=case.balance, schedule=self.setup.schedule)
        q_l, k_l, v_l = (cp.shard(inputs[name]).detach().requires_grad_() for name in ("q", "k", "v"))
        out_l = cp.flex_attention(q_l, k_l, v_l, score_mod=inputs["score_mod"], enable_gqa=self.setup.gqa)
        out_l.backward(cp.shard(inputs["grad_out"]))
        got = [cp.unshard(out_l.detach(), "query"), cp.unshard(q_l.grad, "query"), cp.unshard(k_l.grad, "key"),
               cp.unshard(v_l.grad, "key")]
        return {"schedule": cp.plan.schedule, "plan": cp.plan.describe(), **self.compare(got, inputs)}

    def check_torch(self, case: Case, inputs: dict) -> dict:
        if inputs["score_mod"] is not None:
            raise ValueError("the torch check takes mask-only variants")
        s, base = self.setup, self.torch_baseline()
        tbm = torch_block_mask(inputs["bm"])
        lb = base.load_balancer(case.balance, tbm, case.tokens)
        q_l, k_l, v_l, g_l, local_bm = base.shard([inputs[n].detach() for n in ("q", "k", "v", "grad_out")] + [tbm],
                                                 lb)
        layer = base.layer(case.compile, s.gqa)
        if not s.cuda:  # forward only: torch's flex_attention has no backward on the CPU
            with torch.no_grad():
                out_l = layer(q_l, k_l, v_l, block_mask=local_bm)
            got = base.unshard([out_l], lb)
            return {"backward": "not run: torch's flex_attention has no backward on the CPU",
                    **self.compare(got, inputs, names=("out",))}
        q_l, k_l, v_l = (t.detach().requires_grad_() for t in (q_l, k_l, v_l))
        out_l = layer(q_l, k_l, v_l, block_mask=local_bm)
        out_l.backward(g_l)
        got = base.unshard([out_l.detach(), q_l.grad, k_l.grad, v_l.grad], lb)
        return self.compare(got, inputs)

    # ---------------------------------------------------------------------------- throughput

    def run_throughput(self) -> None:
        s = self.setup
        groups = throughput_groups(s, self.world)
        total = sum(len(cases) for _, cases in groups)
        done = 0
        for (mask, tokens), cases in groups:
            built: dict = {}
            for case in cases:
                done += 1
                estimate = estimate_seconds(s, case) + (0.0 if "bm" in built else mask_seconds(s, tokens))
                row = self.base_row(case)
                if not self.decide(estimate):
                    left = None if self.deadline is None else round(self.deadline - time.time(), 1)
                    row["skipped"] = f"time budget: estimated {estimate:.0f} s, {left} s left"
                    self.record(row)
                    continue
                case = self.compile_mode(case)
                row = self.base_row(case)
                self.say(f"{done}/{total} {case.label()} (estimated {estimate:.0f} s)")
                self.run_guarded(case, row, lambda: self.throughput(case, built))
                row = self.after_dynamic_failure(case, row, lambda c: self.throughput(c, built))
                self.record(row)
            built.clear()
            self.free()

    def global_mask(self, case: Case, built: dict) -> dict:
        """The global BlockMask of (mask, tokens) and its facts, built once for the group's cases."""
        if "bm" not in built:
            s = self.setup
            start = time.perf_counter()
            mask_mod, facts = throughput_mods(s, case.mask, case.tokens, self.device)
            bm = create_block_mask(mask_mod, None, None, case.tokens, case.tokens, device=self.device,
                                   BLOCK_SIZE=s.block)
            if s.cuda:
                torch.cuda.synchronize()
            pairs = allowed_pairs(s, case.mask, case.tokens)
            full = int(bm.full_kv_num_blocks.sum()) if bm.full_kv_num_blocks is not None else 0
            built.update(bm=bm, facts={
                **facts, "mask_build_s": time.perf_counter() - start, "pairs": pairs,
                "density_pairs": pairs / case.tokens ** 2, "density_tiles": block_density(bm),
                "tiles_full": full, "tiles_partial": int(bm.kv_num_blocks.sum()),
                "flops_fwd_bwd": 3.5 * 4.0 * s.heads * s.dim * pairs,
                "flops_counted": "allowed (q, kv) pairs: 4*Hq*d per pair forward, 3.5x with the backward",
            })
        return built

    def throughput(self, case: Case, built: dict) -> dict:
        s = self.setup
        built = self.global_mask(case, built)
        bm = built["bm"]
        torch.manual_seed(s.seed + 1000 + self.rank)  # timing only: shards need not be one tensor's
        row = dict(built["facts"])
        grad = s.cuda or case.impl == "flexattn"
        cp, base = None, None
        start = time.perf_counter()
        if case.impl == "flexattn" and case.world == 1:
            q_len = kv_len = case.tokens

            def attend(q, k, v):
                return flex_attention(q, k, v, block_mask=bm, enable_gqa=s.gqa)
        elif case.impl == "flexattn":
            cp = ContextParallel(bm, balance=case.balance, schedule=s.schedule)
            q_len, kv_len = cp.plan.q_layout.local_length, cp.plan.kv_layout.local_length

            def attend(q, k, v):
                return cp.flex_attention(q, k, v, enable_gqa=s.gqa)
        else:
            base = self.torch_baseline()
            if "tbm" not in built:
                built["tbm"] = torch_block_mask(bm)
            tbm = built["tbm"]
            if case.world == 1:
                q_len = kv_len = case.tokens
                compiled = base.attend(case.compile)

                def attend(q, k, v):
                    return compiled(q, k, v, block_mask=tbm, enable_gqa=s.gqa)
            else:
                lb = base.load_balancer(case.balance, tbm, case.tokens)
                (local_bm,) = base.shard([tbm], lb)
                layer = base.layer(case.compile, s.gqa)
                q_len = kv_len = case.tokens // case.world

                def attend(q, k, v):
                    return layer(q, k, v, block_mask=local_bm)
        if s.cuda:
            torch.cuda.synchronize()
        row["setup_s"] = time.perf_counter() - start  # the plan, or torch's sharded mask (its compile)
        q = torch.randn(1, s.heads, q_len, s.dim, device=self.device, dtype=self.dtype, requires_grad=grad)
        k, v = (torch.randn(1, s.kv_heads, kv_len, s.dim, device=self.device, dtype=self.dtype, requires_grad=grad)
                for _ in range(2))
        grad_out = torch.randn_like(q, requires_grad=False)

        def step():
            for t in (q, k, v):
                t.grad = None
            if grad:
                attend(q, k, v).backward(grad_out)
            else:
                with torch.no_grad():
                    attend(q, k, v)

        if not grad:
            row["backward"] = "not run: torch's flex_attention has no backward on the CPU"
        row.update(self.measure(step, (q, k, v), case, row["flops_fwd_bwd"] if grad else row["flops_fwd_bwd"] / 3.5))
        if cp is not None:
            row.update(schedule=cp.plan.schedule, plan=cp.plan.describe(), local_tokens=q_len)
        elif case.world > 1:
            row["local_tokens"] = q_len
        if s.model and self.rank == 0 and grad:
            try:  # rank 0 alone: a failure here must not cost the measurement
                rows = None
                if case.impl == "torch_cp" and case.world > 1:
                    rows = base.rank_rows(case.balance, built["tbm"], case.tokens, s.block)
                row.update(self.predicted(case, bm, cp, rows, row["ms"]))
            except Exception as err:
                row["model_error"] = f"{type(err).__name__}: {err}"
        return row

    def measure(self, step, leaves, case: Case, flops: float) -> dict:
        """Warm-up, then the timed iterations: each between a barrier and a synchronise, the
        slowest rank's time; peak memory per rank over the timed ones."""
        cuda = self.setup.cuda

        def once() -> float:
            self.barrier()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - start

        warmup = once()
        for t in leaves:  # the warm-up's gradients: not held into the peak's baseline
            t.grad = None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated() if cuda else None
        times = [once() for _ in range(self.setup.iters)]
        peak = torch.cuda.max_memory_allocated() if cuda else None
        reserved = torch.cuda.max_memory_reserved() if cuda else None
        per_rank = self.gather_values([warmup, held, peak, reserved] + times)
        slowest = [max(r[4 + i] for r in per_rank) for i in range(len(times))]
        seconds = statistics.median(slowest)

        def gib(index):
            values = [r[index] for r in per_rank]
            return None if values[0] is None else [x / GIB for x in values]

        peaks = gib(2)
        return {
            "ms": 1e3 * seconds, "ms_iterations": [1e3 * t for t in slowest],
            "warmup_s": max(r[0] for r in per_rank),
            "tokens_per_s": case.tokens / seconds, "tokens_per_s_per_gpu": case.tokens / seconds / case.world,
            "tflops_total": flops / seconds / 1e12, "tflops_per_gpu": flops / seconds / 1e12 / case.world,
            "peak_gib_per_rank": peaks, "peak_gib": None if peaks is None else max(peaks),
            "held_before_gib_per_rank": gib(1), "reserved_gib_per_rank": gib(3),
        }

    def predicted(self, case: Case, bm, cp, rows, measured_ms: float) -> dict:
        """The cost model's time of this row (NVLink 4; benchmarks/context_parallel.py's machines)."""
        forward, backward = _model_machine(case.mask)
        problem, block = self.problem, tuple(bm.BLOCK_SIZE)
        if case.world == 1:
            tiles = int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum())
            work = tiles * problem.tile_flops(block)
            seconds = work / forward.flops_per_s + BACKWARD_COMPUTE * work / backward.flops_per_s
        elif cp is not None:
            schedule = cp.plan.schedule
            seconds = (max(cp.plan.predicted_seconds(problem, schedule, model=forward))
                       + max(cp.plan.predicted_seconds(problem, schedule, backward=True, model=backward)))
        else:  # torch: K/V all-gathered, then the heaviest rank's tiles
            partial_rows, full_rows = bm.kv_num_blocks[0, 0].cpu(), bm.full_kv_num_blocks[0, 0].cpu()
            loads = [(int(full_rows[r].sum()), int(partial_rows[r].sum())) for r in rows]
            full, partial = max(loads, key=sum)
            args = (problem, block, case.tokens // case.world, case.world, full, partial)
            seconds = allgather_kv_seconds(forward, *args) + allgather_kv_seconds(backward, *args, backward=True)
        return {"model_ms": 1e3 * seconds, "measured_over_model": measured_ms / (1e3 * seconds)}


def _rank_main(rank: int, world: int, port: int, setup: Setup, deadline: Optional[float]) -> None:
    keep_multicast_off()
    if setup.cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
    options = dict(backend="nccl" if setup.cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                   world_size=world, timeout=datetime.timedelta(seconds=setup.collective_timeout_s))
    if setup.cuda:
        options["device_id"] = device
    dist.init_process_group(**options)
    try:
        Rank(rank, world, device, setup, deadline).run()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(setup: Setup, world: int, deadline: Optional[float], kill_at: Optional[float]) -> dict:
    """Spawn ``world`` ranks and wait; a rank that raises or a world past ``kill_at`` ends the spawn
    (its rows so far are in the report)."""
    import torch.multiprocessing as mp

    start = time.time()
    context = mp.start_processes(_rank_main, args=(world, _free_port(), setup, deadline), nprocs=world,
                                 join=False, start_method="spawn")
    failure = None
    try:
        while not context.join(timeout=1.0):
            if kill_at is not None and time.time() > kill_at:
                failure = "stopped: past the time budget"
                break
    except Exception as err:  # a rank died: its traceback is in the message
        failure = f"a rank failed: {err}"[-4000:]
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    status = {"elapsed_s": time.time() - start}
    if failure:
        status["failure"] = failure
        print(f"[world {world}] {failure}", file=sys.stderr, flush=True)
    return status


def _by(rows, **want):
    return [r for r in rows if all(r.get(k) == v for k, v in want.items()) and r.get("ms")]


def print_table(rows: list) -> None:
    """The throughput rows, with speed-ups against world 1 and against torch's best."""
    measured = [r for r in rows if r.get("part") == "throughput" and r.get("ms")]
    masks = {name: i for i, name in enumerate(THROUGHPUT_MASKS)}
    measured.sort(key=lambda r: (masks.get(r["mask"], len(masks)), r["tokens"], r["world"], IMPLS.index(r["impl"])))
    print("| mask | tokens | world | impl | balance | schedule | ms | tok/s | TFLOP/s/GPU | peak GiB "
          "| vs world 1 | flexattn / best torch | measured / model |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in measured:
        one = _by(measured, impl=r["impl"], compile=r.get("compile"), mask=r["mask"], tokens=r["tokens"], world=1)
        scaling = f"{one[0]['ms'] / r['ms']:.2f}x" if one else "-"
        versus = "-"
        if r["impl"] == "flexattn":
            theirs = [t for t in _by(measured, impl="torch_cp", mask=r["mask"], tokens=r["tokens"], world=r["world"])
                      if "backward" not in t]  # forward only (torch on the CPU): not comparable
            if theirs:
                versus = f"{min(t['ms'] for t in theirs) / r['ms']:.2f}x"
        balance = r.get("balance") or "-"
        if r.get("compile"):
            balance += f" ({r['compile']})"
        model = f"{r['measured_over_model']:.2f}" if r.get("measured_over_model") else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        print(f"| {r['mask']} | {r['tokens'] // 1024}k | {r['world']} | {r['impl']} | {balance} "
              f"| {r.get('schedule') or '-'} | {r['ms']:.1f} | {r['tokens_per_s']:.3g} | {r['tflops_per_gpu']:.3g} "
              f"| {peak} | {scaling} | {versus} | {model} |")
    for r in rows:
        if r.get("error") or r.get("skipped"):
            print(f"not measured: {r['part']} {r['impl']} {r['mask']} {r['tokens']} world {r['world']} "
                  f"{r.get('balance') or ''}: {r.get('error') or r.get('skipped')}")


def print_checks(rows: list) -> None:
    checks = [r for r in rows if r.get("part") == "check"]
    for r in checks:
        errs = ", ".join(f"{n} {r[n + '_err']:.2e} (single {r[n + '_single_gpu_err']:.2e})"
                         for n in ("out", "dq", "dk", "dv") if n + "_err" in r)
        state = "skipped" if r.get("skipped") else ("pass" if r.get("ok") else "FAIL")
        print(f"check {r['impl']} {r['mask']} world {r['world']} {r.get('balance')}: {state} {errs} "
              f"{r.get('error') or ''}")


def _ints(text: str) -> tuple:
    return tuple(int(x) for x in text.split(",") if x)


def _names(text: str, allowed: tuple, what: str) -> tuple:
    names = tuple(x for x in text.split(",") if x)
    unknown = [x for x in names if x not in allowed]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; choose from {allowed}")
    return names


def make_setup(args) -> Setup:
    smoke = args.smoke
    device = "cpu" if smoke else (args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    impls = _names(args.impls, IMPLS, "impls")
    if args.torch and "torch_cp" not in impls:
        impls += ("torch_cp",)
    measured = impls if args.throughput_impls is None else _names(args.throughput_impls, impls, "throughput impls")
    doc_tokens = _ints(args.doc_tokens or ("256,1024" if smoke else "8192,65536"))
    if len(doc_tokens) != 2 or doc_tokens[1] < 2 * doc_tokens[0]:
        raise SystemExit(f"--doc-tokens LOW,HIGH needs HIGH >= 2 * LOW, got {doc_tokens}")
    world_tokens = []
    for item in args.world_tokens:
        world, _, lengths = item.partition("=")
        world_tokens.append((int(world), _ints(lengths)))
    out = args.out or tempfile.mkstemp(prefix="context_parallel_gpus_", suffix=".json")[1]
    return Setup(
        device=device, dtype="float32" if smoke else args.dtype,
        heads=args.heads or (4 if smoke else 16), kv_heads=args.kv_heads or (2 if smoke else 4),
        dim=args.dim or (32 if smoke else 128), block=args.block,
        tokens=_ints(args.tokens or ("2048" if smoke else "131072,262144,524288")),
        masks=_names(args.masks, THROUGHPUT_MASKS, "masks"), worlds=_ints(args.worlds),
        world_tokens=tuple(world_tokens), impls=impls, throughput_impls=measured,
        balances=_names(args.balances, BALANCES, "balances"),
        torch_balances=_names(args.torch_balances, TORCH_BALANCES, "torch balances"),
        all_balances_tokens=args.all_balances_tokens, schedule=args.schedule,
        iters=args.iters if args.iters is not None else (2 if smoke else 3),
        doc_tokens=doc_tokens,
        check=args.check, check_tokens=args.check_tokens or (2048 if smoke else 32768),
        check_variants=_names(args.check_variants, CHECK_VARIANTS, "check variants"),
        torch_check_masks=_names(args.torch_check_masks, CHECK_VARIANTS, "torch check masks"),
        throughput=not args.no_throughput, torch_compile=args.torch_compile, torch_calibrate=args.torch_calibrate,
        model=args.model, out=out, collective_timeout_s=args.collective_timeout_s,
    )


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="1,2", help="world sizes, one spawn each (default 1,2)")
    p.add_argument("--tokens", help="throughput lengths (default 131072,262144,524288; --smoke 2048)")
    p.add_argument("--world-tokens", action="append", default=[], metavar="WORLD=T1,T2",
                   help="throughput lengths of one world in place of --tokens (repeatable)")
    p.add_argument("--masks", default=",".join(THROUGHPUT_MASKS), help="throughput masks")
    p.add_argument("--impls", default="flexattn", help="flexattn and/or torch_cp (default flexattn)")
    p.add_argument("--torch", action="store_true", help="add torch_cp: torch's context parallelism")
    p.add_argument("--throughput-impls", help="the impls whose throughput is measured (default: all; the others "
                                              "are only checked)")
    p.add_argument("--balances", default="mask", help="flexattn's balance modes (mask, zigzag, contiguous)")
    p.add_argument("--torch-balances", default="ptrr,head_tail,none", help="torch's load balancers")
    p.add_argument("--all-balances-tokens", type=int,
                   help="run balances after the first of each list only up to this length (default: at all)")
    p.add_argument("--schedule", default="auto", choices=("auto", "ring", "allgather"))
    p.add_argument("--iters", type=int, help="timed iterations after 1 warm-up (default 3; --smoke 2)")
    p.add_argument("--doc-tokens", help="LOW,HIGH document lengths of the throughput document mask "
                                        "(default 8192,65536; --smoke 256,1024)")
    p.add_argument("--check", action="store_true", help="forward and backward against single-GPU flexattn")
    p.add_argument("--check-tokens", type=int, help="the check's length (default 32768; --smoke 2048)")
    p.add_argument("--check-variants", default=",".join(CHECK_VARIANTS))
    p.add_argument("--torch-check-masks", default="causal,document", help="variants torch's CP is checked on")
    p.add_argument("--no-throughput", action="store_true")
    p.add_argument("--torch-compile", default="static", choices=("static", "dynamic"),
                   help="torch.compile of torch's flex_attention: static (a compile per shape) or dynamic")
    p.add_argument("--torch-calibrate", action="store_true",
                   help="with --torch-compile dynamic: one static row too (world 1, first mask, shortest)")
    p.add_argument("--model", action="store_true", help="add the cost model's prediction to each row")
    p.add_argument("--out", help="the JSON report (rewritten after each row)")
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--block", type=int, default=128, help="BlockMask block size")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU ranks (gloo): the whole code path")
    p.add_argument("--budget-s", type=float, help="skip cases that would end past this many seconds")
    p.add_argument("--grace-s", type=float, default=45.0, help="past the budget by this much, a world is stopped")
    p.add_argument("--collective-timeout-s", type=float, default=300.0)
    p.add_argument("--table", nargs="+", metavar="REPORT",
                   help="print the checks and the table of these reports together (runs nothing)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table:  # runs split over several commands, compared in one table
        rows = [row for path in args.table for row in read_report(path)["rows"]]
        print_checks(rows)
        print_table(rows)
        return 0
    setup = make_setup(args)
    started = time.time()
    report = {"program": "benchmarks.context_parallel_gpus", "argv": list(sys.argv[1:] if argv is None else argv),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "setup": dataclasses.asdict(setup),
              "environment": environment(setup), "worlds": {}, "rows": []}
    write_report(setup.out, report)
    print(f"report: {setup.out}", flush=True)
    worlds = sorted(set(setup.worlds), reverse=True)  # world 1, which holds the costliest case, last
    if setup.cuda:
        count = torch.cuda.device_count()
        for world in [w for w in worlds if w > count]:
            note = f"skipped: {world} ranks need {world} GPUs, {count} visible"
            print(note, flush=True)
            update_report(setup.out, lambda r, w=world: r["worlds"].setdefault(str(w), {}).update(skipped=note))
        worlds = [w for w in worlds if w <= count]
    estimates = {w: world_seconds(setup, w) for w in worlds}
    print("estimated seconds per world: " + ", ".join(f"{w}: {estimates[w]:.0f}" for w in worlds), flush=True)
    failed = False
    for i, world in enumerate(worlds):
        deadline = kill_at = None
        if args.budget_s is not None:  # the time left, shared by the worlds still to run
            end = started + args.budget_s
            share = estimates[world] / sum(estimates[w] for w in worlds[i:])
            deadline = time.time() + max(0.0, end - time.time()) * share
            kill_at = min(deadline, end) + args.grace_s
        status = run_world(setup, world, deadline, kill_at)
        failed |= "failure" in status
        update_report(setup.out, lambda r, w=world, s=status: r["worlds"].setdefault(str(w), {}).update(s))
    report = read_report(setup.out)
    report["elapsed_s"] = time.time() - started
    write_report(setup.out, report)
    rows = report["rows"]
    print_checks(rows)
    print_table(rows)
    bad_checks = [r for r in rows if r.get("part") == "check" and not r.get("skipped") and not r.get("ok")]
    print(f"done in {report['elapsed_s']:.0f} s; report: {setup.out}", flush=True)
    return 1 if failed or bad_checks else 0


if __name__ == "__main__":
    sys.exit(main())
