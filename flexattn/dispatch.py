"""Which backend runs a call, and running it: the call record, the backend choice, and the forward
and backward of each backend.

Backends:
- TRITON: the generated FlashAttention-2 kernels (CUDA; CPU under ``TRITON_INTERPRET=1``). Its
  forward and backward run the Hopper Gluon kernels (kernels/hopper/)
  where they apply, unless ``BACKEND='TRITON'`` was given explicitly; ``BACKEND='GLUON'`` pins them
  (see run_forward and run_backward).
- TRITON_DECODE: the generated split-KV decode kernels for short queries at inference; chosen by
  AUTO on CUDA for queries of up to ``MAX_AUTO_QUERY_LEN`` rows (see choose_decode).
- PYTORCH: the blockwise online-softmax path in plain PyTorch (any device, forward and backward).

``api.flex_attention`` validates and traces, then calls ``run_forward`` directly or through
``autograd.FlexAttentionFunction``, whose backward calls ``run_backward``: both import this module,
and it imports neither.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import NamedTuple, Optional

import torch

from .blockwise import Q_TILE_MAX, TILE_ELEMENTS, BlockwiseMods, blockwise_backward, blockwise_forward
from .codegen import debug_enabled
from .errors import BackendUnavailableError, InvalidInputError
from .kernels import ahead
from .kernels import (
    MAX_AUTO_QUERY_LEN, HopperUnavailable, backward_kernel, decode_kernel, descriptor_ready, forward_kernel,
    hopper_auto_reason, hopper_backward_kernel, hopper_forward_kernel, in_output_layout, interpreter_enabled,
    merging_forward_kernel, output_layout, unsupported_reason,
)
from .kernels.launch import FLOAT8_DTYPES
from .kernels.tables import backward_tables, launch_tables
from .masks import BlockMask
from .options import deterministic, resolve_backend_name
from .trace import TracedMod

__all__ = ["Call", "pick_backend", "choose_decode", "use_tanh_approx", "run_forward", "forward_into",
           "forward_relaunch", "prepare_backward", "run_backward", "backward_relaunch", "sm90_forward_choice",
           "sm90_backward_choice"]


class Call(NamedTuple):
    """What one call runs, besides the tensors autograd tracks."""

    backend: str
    block_mask: BlockMask
    scale: float
    score: Optional[TracedMod]
    mask: Optional[TracedMod]
    mask_captured: list
    options: dict
    index_dtype: torch.dtype  # of the index tensors the PyTorch backend passes to the mods


def pick_backend(query: torch.Tensor, options: dict) -> str:
    """The backend the options and the query's device and dtype call for."""
    if not options and query.is_cuda and query.dtype != torch.float64:
        return "TRITON"  # the common case, decided without reading anything else
    backend = resolve_backend_name(options)
    if backend == "AUTO":
        # float64 has no tensor-core path: it runs on the blockwise PyTorch backend, like CPU tensors.
        return "TRITON" if query.is_cuda and query.dtype != torch.float64 else "PYTORCH"
    if backend == "GLUON":
        # The Gluon kernels run inside the Triton backend: run_forward and run_backward pin them.
        if not query.is_cuda:
            raise BackendUnavailableError(
                f"kernel_options={{'BACKEND': 'GLUON'}} runs on CUDA (Hopper) GPUs, got {query.device} tensors "
                "(Triton's interpreter cannot run Gluon kernels); use BACKEND='TRITON' or 'PYTORCH'"
            )
        backend = "TRITON"
    if backend == "TRITON_DECODE" and options.get("FORCE_USE_FLEX_ATTENTION"):
        raise InvalidInputError(
            "kernel_options BACKEND='TRITON_DECODE' and FORCE_USE_FLEX_ATTENTION=True contradict each other "
            "(as in torch): drop one of them"
        )
    if backend in ("TRITON", "TRITON_DECODE"):
        if query.dtype == torch.float64:
            raise BackendUnavailableError(
                "the Triton backend supports float16, bfloat16 and float32; float64 inputs run on "
                "kernel_options={'BACKEND': 'PYTORCH'}"
            )
        if query.device.type == "cpu" and not interpreter_enabled():
            raise BackendUnavailableError(
                f"kernel_options={{'BACKEND': '{backend}'}} with CPU tensors needs the Triton interpreter: set the "
                "environment variable TRITON_INTERPRET=1 before importing flexattn (slow; meant for testing), "
                "or move the tensors to a CUDA device"
            )
        if query.device.type not in ("cpu", "cuda"):
            raise BackendUnavailableError(
                f"the Triton backend runs on CUDA devices, got {query.device}; use BACKEND='PYTORCH'"
            )
    return backend


def choose_decode(backend: str, options: dict, query: torch.Tensor, block_mask: BlockMask, needs_grad: bool,
                  need_max: bool) -> str:
    """The Triton backend's choice between the forward kernel and the decode kernels.

    AUTO picks the decode kernels for queries of up to MAX_AUTO_QUERY_LEN rows (see its comment for
    the measurement) that fit one query block of the mask, when no gradient and no max_scores
    are needed and FORCE_USE_FLEX_ATTENTION is not set. A forced TRITON_DECODE still runs the
    forward kernel (and so the Triton backward) when gradients are needed: the decode kernels
    write no state for a backward. Calls that need max_scores also take the forward kernel, which
    writes them; the decode kernels do not.
    """
    if backend == "TRITON":
        if (query.shape[2] <= MAX_AUTO_QUERY_LEN and not needs_grad and not need_max
                and options.get("BACKEND", "AUTO") == "AUTO" and not options.get("FORCE_USE_FLEX_ATTENTION")
                and unsupported_reason(query, block_mask) is None):
            return "TRITON_DECODE"
    elif backend == "TRITON_DECODE" and (needs_grad or need_max):
        return "TRITON"
    return backend


def use_tanh_approx(q: torch.Tensor, options: dict) -> bool:
    """Whether tanh in the mods runs as the hardware approximation."""
    choice = options.get("TANH_APPROX")
    if choice is not None:
        return bool(choice)
    # Default: the hardware tanh for 16-bit and FP8 inputs on NVIDIA GPUs, where its error (~2^-11
    # relative) is below the inputs' own rounding (2^-8 for bf16, 2^-11 for fp16, 2^-4 for e4m3);
    # exact otherwise.
    return q.is_cuda and torch.version.cuda is not None and (
        q.dtype in (torch.float16, torch.bfloat16) or q.dtype in FLOAT8_DTYPES)


# ------------------------------------------------------------------------------------ FLEXATTN_DEBUG

# Read once, at import, like FLEXATTN_CHECK_INDICES: an unset variable costs a call nothing.
_DEBUG = debug_enabled()

# What a step of a plan is called in the report, and the constexprs it shows.
_STEP_NAMES = {"forward": "", "dkdv": "dK/dV ", "dq": "dQ ", "partial": "", "merge": "merge "}
_SHOWN = ("BLOCK_M", "BLOCK_N", "NUM_SPLITS", "STAGES", "CONSUMERS", "num_warps", "num_stages")


def _kernel_plan(plan) -> str:
    """The tiles of each step of a kernel family's plan, and the kernel file."""
    steps = []
    for role, step in plan.steps.items():
        if role not in _STEP_NAMES:
            continue  # the backward's preprocess: nothing to choose
        c = step.constexprs
        shown = [f"{key}={c[key]}" for key in _SHOWN if key in c]
        shown += [key for key in ("USE_TMA", "HOST_DESCRIPTORS", "WARP_SPECIALIZE", "UNION_WALK") if c.get(key)]
        steps.append(_STEP_NAMES[role] + " ".join(shown))
    return f"{'; '.join(steps)}, kernel {plan.compiled.module.__file__}"


def _blockwise_mods(call: Call, q, score_captured) -> BlockwiseMods:
    """The call's mods as the PyTorch backend runs them: their graphs on q's device."""
    return BlockwiseMods(call.score.graph_module_on(q.device) if call.score else None, score_captured,
                         call.mask.graph_module_on(q.device) if call.mask else None, call.mask_captured)


def _blockwise_plan(call: Call) -> str:
    q_block, _ = call.block_mask.BLOCK_SIZE
    return (f"blockwise: query tiles of up to {min(q_block, Q_TILE_MAX)} rows, chunks of up to "
            f"{TILE_ELEMENTS} scores, {str(call.index_dtype).replace('torch.', '')} indices")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _debug_report(stage: str, call: Call, q, k, v, plan) -> None:
    """One line on stderr per forward or backward (FLEXATTN_DEBUG=1): the backend and what it ran
    (``plan``, or a function that says it: a run whose launches were only recorded has none)."""
    if ahead.recording():  # [Note] Kernels compiled ahead: nothing ran, and no plan was kept
        return
    plan = plan() if callable(plan) else plan
    q_block, kv_block = call.block_mask.BLOCK_SIZE
    print(
        f"[flexattn] {stage} {call.backend}: q {_shape(q)} k {_shape(k)} v {_shape(v)} "
        f"{str(q.dtype).replace('torch.', '')} on {q.device}, score_mod={call.score.name if call.score else None}, "
        f"mask_mod={call.mask.name if call.mask else None}, BlockMask {q_block}x{kv_block}; {plan}",
        file=sys.stderr,
    )


# ------------------------------------------------------------------------------------ running a call


def run_forward(call: Call, q, k, v, score_captured, need_lse, need_max):
    """``(out, lse or None, max_scores or None)`` from the call's backend; ``out`` in the layout of
    [Note] The output's layout (kernels/launch.py), which the op's fake implementation promises."""
    if call.backend != "PYTORCH" and torch.float8_e4m3fn in (q.dtype, k.dtype, v.dtype) and q.is_cuda:
        _check_e4m3_device(q)
    if call.backend == "TRITON_DECODE":
        kernel = decode_kernel(call.score, call.mask, tanh_approx=use_tanh_approx(q, call.options))
        out, lse = kernel(q, k, v, call.block_mask, call.scale, score_captured, call.mask_captured,
                          need_lse=need_lse, options=call.options)
        if _DEBUG:
            _debug_report("forward", call, q, k, v, lambda: _kernel_plan(kernel.last_plan))
        return out, lse, None
    if call.backend == "TRITON":
        gluon_note = ""
        if q.is_cuda and call.options.get("BACKEND") != "TRITON":
            result, gluon_note = _sm90_forward(call, q, k, v, score_captured, need_lse, need_max)
            if result is not None:
                return result
        kernel = forward_kernel(call.score, call.mask, tanh_approx=use_tanh_approx(q, call.options))
        result = kernel(
            q, k, v, call.block_mask, call.scale, score_captured, call.mask_captured,
            need_lse=need_lse, need_max=need_max, options=call.options,
        )
        if _DEBUG:
            _debug_report("forward", call, q, k, v, lambda: gluon_note + _kernel_plan(kernel.last_plan))
        return result
    if _DEBUG:
        _debug_report("forward", call, q, k, v, _blockwise_plan(call))
    # Key and value in the query's dtype first, as the kernels convert them ([Note] Mixed and FP8
    # dtypes in request.py), so that both paths round the same way.
    k, v = k.to(q.dtype), v.to(q.dtype)
    out, lse, mx = blockwise_forward(
        q, k, v, call.block_mask, call.scale, _blockwise_mods(call, q, score_captured),
        need_max=need_max, index_dtype=call.index_dtype,
    )
    return in_output_layout(out, q), lse, mx


def forward_into(call: Call, q, k, v, score_captured, running: tuple) -> bool:
    """Merge the call's forward into ``running`` = ``(out, lse, max_scores or None)``, the result of
    other keys for the same queries (out in float32, lse and max_scores contiguous float32 [B, Hq,
    L]), in the kernel's epilogue ([Note] Merging into the running result, templates/forward.py.jinja);
    True when it did. False, having run nothing, where the kernel that runs this call has no such
    epilogue: the PyTorch backend, the decode kernels, the Hopper Gluon forward (where run_forward
    would take it, or ``BACKEND='GLUON'`` pins it), and a float64 running result. The caller then
    runs ``run_forward`` and merges the result itself."""
    out, lse, mx = running
    if (call.backend != "TRITON" or call.options.get("BACKEND") == "GLUON" or out.dtype != torch.float32
            or lse.dtype != torch.float32 or not lse.is_contiguous()
            or not (mx is None or mx.dtype == torch.float32 and mx.is_contiguous())):
        return False
    if q.is_cuda:
        if torch.float8_e4m3fn in (q.dtype, k.dtype, v.dtype):
            _check_e4m3_device(q)
        if call.options.get("BACKEND") != "TRITON":
            gluon, reason = sm90_forward_choice(call, q, k, v, mx is not None)
            if gluon is not None and reason is None:
                return False
    kernel = merging_forward_kernel(call.score, call.mask, tanh_approx=use_tanh_approx(q, call.options))
    kernel(q, k, v, call.block_mask, call.scale, score_captured, call.mask_captured, running=running,
           options=call.options)
    if _DEBUG:
        _debug_report("forward, merged", call, q, k, v, lambda: _kernel_plan(kernel.last_plan))
    return True


def forward_relaunch(call: Call, q, k, v, need_max: bool):
    """After ``run_forward(call, q, k, v, score_captured, True, need_max)`` ran: the kernel launch it
    made, as ``relaunch(q, k, v, launch_tables, score_captured, mask_captured) -> (out, lse, max or
    None)`` for later calls of the same problem (same mods, options, shapes, strides, dtypes, 16-byte
    alignment and table statistics; compile/warm.py keys them, [Note] Warm calls of the forward op), or
    None where there is no such single launch to repeat: another backend, FP8 or mixed dtypes, a
    plan still settling, the debug report on. A relaunch whose ``takes_walks`` is true also takes
    ``walks=``, the program walks of the tables it is given (kernels/hopper/forward.py)."""
    if _DEBUG or call.backend != "TRITON" or not q.dtype == k.dtype == v.dtype or q.dtype in FLOAT8_DTYPES:
        return None
    tables = launch_tables(call.block_mask)
    if q.is_cuda and call.options.get("BACKEND") != "TRITON":
        gluon, reason = sm90_forward_choice(call, q, k, v, need_max)
        if gluon is not None and reason is None:
            plan = gluon.kept_plan(q, k, v, call.block_mask, call.scale, need_lse=True)
            return None if plan is None else gluon.warm_launch(plan, q, k, v, call.block_mask, call.scale,
                                                               need_lse=True)
    kernel = forward_kernel(call.score, call.mask, tanh_approx=use_tanh_approx(q, call.options))
    plan = kernel.kept_plan(q, k, v, call.block_mask, call.scale, need_lse=True, need_max=need_max,
                            options=call.options)
    return None if plan is None else kernel.warm_launch(plan, q, k, v, tables, call.scale, need_lse=True,
                                                        need_max=need_max)


def _check_e4m3_device(q) -> None:
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) < (8, 9):
        raise BackendUnavailableError(
            f"float8_e4m3fn inputs need compute capability 8.9 or newer (Ada, Hopper) for the Triton kernels, and "
            f"this GPU is {major}.{minor}: convert them to the query's 16-bit dtype, or run "
            "kernel_options={'BACKEND': 'PYTORCH'}"
        )


# Options that tune the portable forward's launch: a call that sets one means that kernel.
_PORTABLE_TUNING = frozenset({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "AUTOTUNE", "USE_TMA",
                              "HOST_DESCRIPTORS", "WARP_SPECIALIZE"})


def sm90_forward_choice(call: Call, q, k, v, need_max: bool):
    """``(kernel, reason)``: the Hopper Gluon forward family of the call's mods and why this call
    cannot or should not take it (None: it takes it). ``kernel`` is None when the options rule it
    out before any family is built (nothing about the kernel is asked then)."""
    return _forward_choice_now(call, q, k, _fixed_forward_choice(call, q, k, v, need_max))


def _fixed_forward_choice(call: Call, q, k, v, need_max: bool):
    """``(kernel, reason)`` from what _GLUON_FORWARD's key fixes: the options, the family, and the
    problem's reason (kernel.problem_reason); the rest is _forward_choice_now's."""
    def reason(kernel):
        return kernel.problem_reason(q, k, v, call.block_mask, need_max), lambda: None

    return _gluon_choice(call, q, "forward", _PORTABLE_TUNING, hopper_forward_kernel, reason)


def _forward_choice_now(call: Call, q, k, fixed: tuple):
    """``fixed`` (_fixed_forward_choice) with what may change between calls of one key: whether the
    mods' kernels failed to compile (the family remembers it), and AUTO's rule, which reads the
    mask's row statistics."""
    kernel, reason = fixed
    if kernel is None or reason is not None:
        return fixed
    reason = kernel.failed_reason(q, k)
    if reason is None and call.options.get("BACKEND") != "GLUON":
        reason = hopper_auto_reason(q, call.block_mask, call.score is not None, call.mask is not None)
    return kernel, reason


# [Note] The Gluon forward's choice, kept. An eager CUDA call asks whether the Hopper Gluon forward
# takes it (sm90_forward_choice): the options, the family of its mods, the device, and the dtypes,
# shapes, strides and alignment of q, k and v, every call the same for one model's layer. _sm90_forward
# keeps that answer (_fixed_forward_choice) per key of what it reads, and asks per call only what may
# change under one key (_forward_choice_now): a family's kernels that did not compile, and AUTO's rule
# at head dim 64, which reads the mask's row statistics. What the key leaves out, and why that is safe:
# - the mods' captured tensors and numbers, and the tables' content: no reason in the kept part reads
#   them (the auto rule, which reads the tables, is asked per call); the launch reads the call's own;
# - the tensors themselves: only their facts are in the key, nothing that can die (no id()), so a
#   freed tensor's id coming back with other facts is another key;
# - the mods by content: the key holds the TracedMods themselves (compared by identity, kept alive by
#   the key: [Note] Cache keys in kernels/family.py); a mod whose graph changed is traced to another;
# - the process's facts: Triton's version, and the compute capability of a device (the key has the
#   device), fixed for a process (hopper/common.py's _capability is kept per device already); the
#   interpreter flag, which Triton reads when it decorates a kernel (Gluon's jit never interprets),
#   so a process that sets TRITON_INTERPRET after a key's first call keeps launching the compiled
#   Gluon kernel it chose, on the GPU its tensors are on (right numbers);
# - need_lse, the scale: no reason reads them;
# - tanh_approx, which picks the family: from TANH_APPROX (in the options), the device and q's dtype.
# A family evicted from hopper_forward_kernel's table stays alive in an entry and serves it as before.
# tests/test_warm_gluon.py changes each of these after warm calls.
_GLUON_FORWARD: dict = {}
_GLUON_CHOICES_KEPT = 256


def _kept_forward_choice(call: Call, q, k, v, need_max: bool):
    """sm90_forward_choice, its fixed part kept per key ([Note] The Gluon forward's choice, kept)."""
    options = call.options
    key = (call.score, call.mask, tuple(sorted(options.items())) if options else (), need_max, q.device, q.dtype,
           k.dtype, v.dtype, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.data_ptr() & 15,
           k.data_ptr() & 15, v.data_ptr() & 15, call.block_mask.BLOCK_SIZE)
    fixed = _GLUON_FORWARD.get(key)
    if fixed is None:
        fixed = _fixed_forward_choice(call, q, k, v, need_max)
        if len(_GLUON_FORWARD) >= _GLUON_CHOICES_KEPT:
            _GLUON_FORWARD.clear()
        _GLUON_FORWARD[key] = fixed
    return _forward_choice_now(call, q, k, fixed)


def _gluon_choice(call: Call, q, stage: str, portable_tuning: frozenset, family, reasons):
    """The choice both sm90_forward_choice and sm90_backward_choice make: the options first (``BACKEND='TRITON'``, or a tile option
    of the portable ``stage`` without ``BACKEND='GLUON'``), then ``reasons(kernel)``: why this call
    cannot take the family's kernels, and (a callable) why AUTO would not, asked unless pinned."""
    pinned = call.options.get("BACKEND") == "GLUON"
    if call.options.get("BACKEND") == "TRITON":
        return None, "kernel_options BACKEND='TRITON' pins the portable kernels"
    tuning = sorted(portable_tuning & call.options.keys())
    if tuning and not pinned:
        return None, f"kernel_options {', '.join(tuning)} tune the portable {stage}"
    kernel = family(call.score, call.mask, tanh_approx=use_tanh_approx(q, call.options))
    reason, auto_reason = reasons(kernel)
    if reason is None and not pinned:
        reason = auto_reason()
    return kernel, reason


def _sm90_forward(call: Call, q, k, v, score_captured, need_lse, need_max):
    """``(result or None, note)``: the Hopper Gluon forward's result where it applies; else None and,
    for the debug report, why not. With ``BACKEND='GLUON'`` the reason is an error instead. Its
    out and LSE are the portable forward's (same conventions), so either backward follows."""
    def run(kernel):
        out, lse = kernel(q, k, v, call.block_mask, call.scale, score_captured, call.mask_captured, need_lse=need_lse)
        return out, lse, None

    return _run_gluon("forward", call, q, k, v, _kept_forward_choice(call, q, k, v, need_max), run)


def _run_gluon(stage: str, call: Call, q, k, v, choice, run):
    """``(result or None, note)`` of a Gluon family's ``choice`` (``(kernel, reason)``): ``run(kernel)``
    where the reason is None; else None and, for the debug report, why not. A kernel that does not
    compile is remembered by its family and falls back the same way. With ``BACKEND='GLUON'`` every
    reason is an error instead."""
    kernel, reason = choice
    if kernel is not None and reason is None:
        try:
            result = run(kernel)
        except HopperUnavailable as err:  # the mods' kernels did not compile: remembered, not retried
            reason = str(err)
        else:
            if _DEBUG:
                _debug_report(stage, call._replace(backend="GLUON"), q, k, v, lambda: _kernel_plan(kernel.last_plan))
            return result, ""
    if call.options.get("BACKEND") == "GLUON":
        what = "this call" if stage == "forward" else f"this call's {stage}"
        raise InvalidInputError(f"kernel_options BACKEND='GLUON' cannot run {what}: {reason}")
    return None, f"not GLUON ({reason}); "


# Options that tune the portable backward's launch: a call that sets one means those kernels.
_PORTABLE_BACKWARD_TUNING = frozenset({"BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "bwd_num_warps",
                                       "bwd_num_stages", "num_warps", "num_stages", "AUTOTUNE", "USE_TMA"})


def sm90_backward_choice(call: Call, q, k, v, float32_kv_grads: bool = False, grad_out=None):
    """``(kernel, reason)`` for the backward, as sm90_forward_choice is for the forward."""
    return _backward_choice_now(q, k, _fixed_backward_choice(call, q, k, v, float32_kv_grads, grad_out))


def _fixed_backward_choice(call: Call, q, k, v, float32_kv_grads: bool, grad_out):
    """``(kernel, problem's reason, mods' reason)`` from what _GLUON_BACKWARD's key fixes: the options,
    the family, the problem's reason, and the mods' (learnable captured tensors, at these lengths)."""
    def reason(kernel):
        # AUTO takes every call the kernels can run: they were measured faster than the portable
        # backward on every case, rows of three key blocks included (docs/benchmarks_log.md, "The d=64
        # backward: dQ in the dK/dV kernel for every call, and the rule of few key blocks gone").
        return kernel.problem_reason(q, k, v, call.block_mask, float32_kv_grads, grad_out), lambda: None

    kernel, reason_now = _gluon_choice(call, q, "backward", _PORTABLE_BACKWARD_TUNING, hopper_backward_kernel, reason)
    mods_reason = kernel.trainable_reason(q, k) if kernel is not None and reason_now is None else None
    return kernel, reason_now, mods_reason


def _backward_choice_now(q, k, fixed: tuple):
    """``(kernel, reason)`` of ``fixed`` (_fixed_backward_choice), with whether the mods' kernels failed
    to compile asked now (the family remembers it), in unsupported_reason's order."""
    kernel, reason, mods_reason = fixed
    if kernel is None or reason is not None:
        return kernel, reason
    return kernel, kernel.failed_reason(q, k) or mods_reason


# The backward's choice, kept as the forward's is ([Note] The Gluon forward's choice, kept), per key
# of what its fixed part reads: the same facts of q, k and v, and of the output's gradient (read
# through a descriptor like q: its dtype, shape, strides and alignment; None when not given), and
# float32_kv_grads in place of need_max. Left out as there: the mods' values, the tables' content
# (no reason reads them; the backward has no auto rule), the process's facts, the scale, and whether
# the family's kernels failed (asked per call). The mods' reason (learnable captured tensors) is the
# family's kernels' for the lengths in the key, and the key holds the TracedMods, whose captured
# inputs' requires_grad is part of what makes one (trace/cache.py's graph key).
# tests/test_warm_gluon.py (the backward's choice) changes each of these after warm calls.
_GLUON_BACKWARD: dict = {}


def _kept_backward_choice(call: Call, q, k, v, float32_kv_grads: bool, grad_out):
    """sm90_backward_choice, its fixed part kept per key (see _GLUON_BACKWARD)."""
    options = call.options
    grad_facts = None if grad_out is None else (grad_out.dtype, grad_out.shape, grad_out.stride(),
                                                grad_out.data_ptr() & 15)
    key = (call.score, call.mask, tuple(sorted(options.items())) if options else (), float32_kv_grads, q.device,
           q.dtype, k.dtype, v.dtype, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.data_ptr() & 15,
           k.data_ptr() & 15, v.data_ptr() & 15, call.block_mask.BLOCK_SIZE, grad_facts)
    fixed = _GLUON_BACKWARD.get(key)
    if fixed is None:
        fixed = _fixed_backward_choice(call, q, k, v, float32_kv_grads, grad_out)
        if len(_GLUON_BACKWARD) >= _GLUON_CHOICES_KEPT:
            _GLUON_BACKWARD.clear()
        _GLUON_BACKWARD[key] = fixed
    return _backward_choice_now(q, k, fixed)


def _sm90_backward(call: Call, q, k, v, out, lse, grad_out, grad_lse, score_captured, float32_kv_grads):
    """``(grads or None, note)``: the Hopper Gluon backward's gradients where it applies; else None
    and, for the debug report, why not. With ``BACKEND='GLUON'`` the reason is an error instead."""
    def run(kernel):
        return kernel(q, k, v, out, lse, grad_out, grad_lse, call.block_mask, call.scale, score_captured,
                      call.mask_captured, deterministic=deterministic(call.options))

    return _run_gluon("backward", call, q, k, v, _kept_backward_choice(call, q, k, v, float32_kv_grads, grad_out),
                      run)


def prepare_backward(call: Call, q, k, v=None, score_captured=None) -> None:
    """At the forward of a call that needs gradients: lower the score_mod's gradient now (a mod whose
    gradient cannot be lowered fails here, before any kernel runs, not in the middle of
    loss.backward()), and, given the call's v and captured tensors, have the backward's kernels
    compiled ahead, while the forward runs."""
    if call.backend == "TRITON":
        backward_kernel(call.score, call.mask, tanh_approx=use_tanh_approx(q, call.options)).prepare(
            q, k, call.block_mask)
        if v is not None:
            compile_ahead(call, q, k, v, score_captured or [], forward=False, backward=True)


# The problems whose launches were recorded once ([Note] Kernels compiled ahead in kernels/ahead.py);
# the key holds the TracedMods themselves ([Note] Cache keys in kernels/family.py).
_AHEAD_DONE: "OrderedDict[tuple, bool]" = OrderedDict()
_AHEAD_KEPT = 256


def compile_ahead(call: Call, q, k, v, score_captured, *, forward: bool, backward: bool) -> None:
    """Run this problem's forward and/or backward once with launches recorded, not run, so that worker
    processes compile their kernels while this process goes on ([Note] Kernels compiled ahead in
    kernels/ahead.py). Once per problem; never raises: a failure here only means that the kernels
    compile where they launch, as they would without it."""
    if call.backend != "TRITON" or not q.is_cuda or interpreter_enabled() or call.options.get("AUTOTUNE"):
        return
    mask = call.block_mask
    key = (call.score, call.mask, repr(sorted(call.options.items())), forward, backward, q.shape, q.stride(),
           k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
           tuple(mask.kv_num_blocks.shape), mask.full_kv_num_blocks is not None, tuple(mask.BLOCK_SIZE),
           tuple(mask.seq_lengths), call.scale > 0,
           tuple((t.shape, t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else type(t) for t in score_captured))
    if key in _AHEAD_DONE or torch.cuda.is_current_stream_capturing() or not ahead.enabled():
        return
    _AHEAD_DONE[key] = True
    if len(_AHEAD_DONE) > _AHEAD_KEPT:
        _AHEAD_DONE.popitem(last=False)
    try:
        with ahead.compiling_ahead():
            if forward:
                run_forward(call, q, k, v, score_captured, True, False)
            if backward:
                # The forward's outputs and the output's gradient as the backward will see them
                # (the gradient in the output's layout, as a model's usually is): shapes, dtypes and
                # strides only.
                shape, dims = output_layout(q, v.shape[-1])
                out = torch.empty(shape, dtype=q.dtype, device="meta").permute(dims)
                lse = torch.empty(q.shape[:3], dtype=torch.float32, device="meta")
                # empty_strided, not empty_like: a meta tensor's empty_like runs torch's Python
                # reference, which imports sympy (seconds of a warm first call on the GPU).
                grad_out = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
                run_backward(call, q, k, v, out, lse, grad_out, None, score_captured)
    except Exception as err:  # noqa: BLE001 - only the head start is lost
        if _DEBUG:
            print(f"[flexattn] kernels not compiled ahead ({type(err).__name__}: {err})", file=sys.stderr)


def backward_relaunch(call: Call, q, k, v, out, grad_out, grad_lse):
    """After ``run_backward(call, q, k, v, out, lse, grad_out, grad_lse, score_captured)`` ran: its
    launches, as ``relaunch(q, k, v, out, lse, grad_out, grad_lse, launch_tables, backward_tables,
    score_captured, mask_captured) -> (dq, dk, dv)`` for later calls of the same problem (compile/warm.py
    keys them, [Note] Warm calls of the backward op), or None where there is no such fixed set of
    launches to repeat: another backend, mixed dtypes, a gradient copied first, gradients of captured
    tensors, a plan still settling, the debug report on."""
    if _DEBUG or call.backend != "TRITON" or not q.dtype == k.dtype == v.dtype or q.dtype in FLOAT8_DTYPES:
        return None
    if not descriptor_ready(grad_out):  # run_backward copies it: not the tensor the kernels read
        return None
    tables, bwd_tables = launch_tables(call.block_mask), backward_tables(call.block_mask)
    if q.is_cuda and call.options.get("BACKEND") != "TRITON":
        gluon, reason = sm90_backward_choice(call, q, k, v, False, grad_out)
        if gluon is not None and reason is None:
            plan = gluon.kept_plan(q, k, v, out, grad_out, grad_lse, call.block_mask, call.scale,
                                   deterministic(call.options))
            return None if plan is None else gluon.warm_launch(plan, q, k, v, out, grad_out, tables, bwd_tables,
                                                               call.scale)
    kernel = backward_kernel(call.score, call.mask, tanh_approx=use_tanh_approx(q, call.options))
    plan = kernel.kept_plan(q, k, v, out, grad_out, grad_lse, call.block_mask, call.scale, call.options)
    return None if plan is None else kernel.warm_launch(plan, q, k, v, out, grad_out, tables, bwd_tables, call.scale)


def run_backward(call: Call, q, k, v, out, lse, grad_out, grad_lse, score_captured, float32_kv_grads: bool = False):
    """``(dq, dk, dv, [gradient of each captured tensor or None])`` by FlashAttention-2
    recomputation from the saved LSE: the Triton kernels on the Triton backend, the blockwise
    PyTorch backward (the oracle the tests compare with) everywhere else. ``float32_kv_grads``:
    dk and dv in float32 (unrounded partial sums, for a caller that adds several)."""
    if call.backend == "TRITON":
        # The kernels read the gradient as it comes when one tensor descriptor can (both layouts of
        # [Note] The output's layout in kernels/launch.py); others, such as the expanded gradient
        # of a sum, are copied.
        if not descriptor_ready(grad_out):
            grad_out = grad_out.contiguous()
        gluon_note = ""
        if q.is_cuda:
            grads, gluon_note = _sm90_backward(call, q, k, v, out, lse, grad_out, grad_lse, score_captured,
                                               float32_kv_grads)
            if grads is not None:
                return grads
        kernel = backward_kernel(call.score, call.mask, tanh_approx=use_tanh_approx(q, call.options))
        grads = kernel(
            q, k, v, out, lse, grad_out, grad_lse, call.block_mask, call.scale,
            score_captured, call.mask_captured, call.options, float32_kv_grads=float32_kv_grads,
        )
        if _DEBUG:
            _debug_report("backward", call, q, k, v, lambda: gluon_note + _kernel_plan(kernel.last_plan))
        return grads
    if _DEBUG:
        _debug_report("backward", call, q, k, v, _blockwise_plan(call))
    return blockwise_backward(
        q, k, v, out, lse, grad_out, grad_lse, call.block_mask, call.scale, _blockwise_mods(call, q, score_captured),
        index_dtype=call.index_dtype, float32_kv_grads=float32_kv_grads,
    )
