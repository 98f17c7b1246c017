"""The custom ops ``flexattn::flex_attention`` and ``flexattn::flex_attention_backward``: their
schemas, bodies, fake implementations and the forward's autograd kernel. A body bundles the schema's
arguments at once (ForwardInputs, BackwardInputs), finds the mods in the registry, and either
repeats a warm launch (compile/warm.py) or builds the Call (request.build_call) on the op's tables
(compile/kept.py) and runs it through dispatch.py, as an eager call does."""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import NamedTuple, Optional

import torch

from ..dispatch import Call, compile_ahead, prepare_backward, run_backward, run_forward
from ..kernels import ahead, output_layout
from ..kernels.tables import RowStats
from ..request import build_call
from ..trace import TracedMod
from .kept import keep_backward_tables, keep_program_walks, op_block_mask
from .registry import ModLayout, mod_inputs, registered_call
from .warm import remember_backward, remember_forward, warm_backward, warm_forward, warm_key

__all__ = ["flex_attention_op", "flex_attention_backward_op", "ForwardInputs", "BackwardInputs"]


# The dispatch state of plain eager code, taken when flexattn is imported.
_DISPATCH_STATE = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())
_NOTHING_TO_ENTER = nullcontext()
try:
    from torch._ops import _len_torch_dispatch_stack_pre_dispatch as _pre_dispatch_modes
except ImportError:  # pragma: no cover - every supported torch has it; without it, always enter
    def _pre_dispatch_modes() -> int:
        return 1


def _as_kernel():
    """The ops' bodies run as eager code, as in an eager call: no dispatch mode around them sees the
    ops inside, and the dispatch state is plain eager's. An op's body is called below autograd (the
    PyTorch backend's backward takes torch.autograd.grad of the score_mod, which needs autograd), and
    a dispatch mode calls ops with the functorch keys off (its torch.vmap fails; AOTAutograd wraps a
    graph's first run in such a mode, its check that a custom op's outputs do not alias its inputs).
    Grad mode stays the caller's: the forward's body runs without grad. Where that state holds
    already (a compiled graph's call, on the steady state's path) nothing is entered."""
    if (not torch._C._len_torch_dispatch_stack() and not _pre_dispatch_modes()
            and torch._C._dispatch_tls_local_include_set() == _DISPATCH_STATE[0]
            and torch._C._dispatch_tls_local_exclude_set() == _DISPATCH_STATE[1]):
        return _NOTHING_TO_ENTER
    stack = ExitStack()
    stack.enter_context(torch.utils._python_dispatch._disable_current_modes())
    stack.enter_context(torch._C._ForceDispatchKeyGuard(*_DISPATCH_STATE))
    return stack


class _Mods(NamedTuple):
    """One op call's mods: the traced mods and their captured values (mod_inputs)."""

    options: dict
    score: Optional[TracedMod]
    score_layout: Optional[ModLayout]
    score_values: list
    mask: Optional[TracedMod]
    mask_values: list


def _mods(call_key: str, score_captured, score_numbers, mask_captured, mask_numbers, device) -> _Mods:
    registered = registered_call(call_key)
    score, score_layout, score_values = mod_inputs(registered.score, score_captured, score_numbers, device)
    mask, _, mask_values = mod_inputs(registered.mask, mask_captured, mask_numbers, device)
    return _Mods(registered.options, score, score_layout, score_values, mask, mask_values)


def _call(mods: _Mods, query, key_t, tables, block_size, seq_lengths, scale, needs_grad, need_max,
          stats: Optional[RowStats] = None) -> Call:
    """The Call of one op call (request.build_call), on the op's tables as a BlockMask."""
    block_mask = op_block_mask(query, key_t, tables, block_size, seq_lengths, query.shape[1] // key_t.shape[1], stats)
    return build_call(query, key_t.shape[2], block_mask, mods.score, mods.mask, mods.mask_values, mods.options, scale,
                      needs_grad, need_max)


# [Note] The ops' registration. The ops are defined with torch.library.Library and their bodies
# registered for CompositeExplicitAutograd directly, not through torch.library.custom_op: that
# wraps each body in a Dynamo-disabling context and an aliasing check, which cost more host time
# than the body itself, paid by every layer's forward and backward of a compiled step (measured:
# docs/benchmarks_log.md, "The first run's compile time, and the op's host cost"). The bodies
# return fresh tensors only, which is what that check checks.
_LIBRARY = torch.library.Library("flexattn", "DEF")
_LIBRARY.define(
    "flex_attention(Tensor query, Tensor key, Tensor value, Tensor? kv_num_blocks, Tensor? kv_indices, "
    "Tensor? full_kv_num_blocks, Tensor? full_kv_indices, Tensor[] score_captured, Tensor[] mask_captured, "
    "Scalar[] score_numbers, Scalar[] mask_numbers, str call_key, SymInt[] block_size, SymInt[] seq_lengths, "
    "float scale, bool needs_grad, bool need_max) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(
    "flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, Tensor grad_out, "
    "Tensor? grad_lse, Tensor? kv_num_blocks, Tensor? kv_indices, Tensor? full_kv_num_blocks, "
    "Tensor? full_kv_indices, Tensor[] score_captured, Tensor[] mask_captured, Scalar[] score_numbers, "
    "Scalar[] mask_numbers, str call_key, SymInt[] block_size, SymInt[] seq_lengths, float scale, "
    "bool[] captured_grads) -> (Tensor, Tensor, Tensor, Tensor[])")


class ForwardInputs(NamedTuple):
    """The forward op's arguments, named and ordered as its schema (above)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_num_blocks: Optional[torch.Tensor]
    kv_indices: Optional[torch.Tensor]
    full_kv_num_blocks: Optional[torch.Tensor]
    full_kv_indices: Optional[torch.Tensor]
    score_captured: list
    mask_captured: list
    score_numbers: list
    mask_numbers: list
    call_key: str
    block_size: list
    seq_lengths: list
    scale: float
    needs_grad: bool
    need_max: bool


class BackwardInputs(NamedTuple):
    """The backward op's arguments, named and ordered as its schema (above)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    grad_out: torch.Tensor
    grad_lse: Optional[torch.Tensor]
    kv_num_blocks: Optional[torch.Tensor]
    kv_indices: Optional[torch.Tensor]
    full_kv_num_blocks: Optional[torch.Tensor]
    full_kv_indices: Optional[torch.Tensor]
    score_captured: list
    mask_captured: list
    score_numbers: list
    mask_numbers: list
    call_key: str
    block_size: list
    seq_lengths: list
    scale: float
    captured_grads: list


def _tables(inputs) -> tuple:
    """The op's four BlockMask tables (ForwardInputs or BackwardInputs), None where absent."""
    return inputs.kv_num_blocks, inputs.kv_indices, inputs.full_kv_num_blocks, inputs.full_kv_indices


def _forward_body(*args, **kwargs):
    """``(out, lse, max_scores)`` of the forward op's arguments (ForwardInputs); max_scores is empty
    unless asked for."""
    with _as_kernel():
        return _forward(ForwardInputs(*args, **kwargs))


def _forward(inputs: ForwardInputs):
    query, key, value = inputs.query, inputs.key, inputs.value
    needs_grad, need_max = inputs.needs_grad, inputs.need_max
    tables = _tables(inputs)
    mods = _mods(inputs.call_key, inputs.score_captured, inputs.score_numbers, inputs.mask_captured,
                 inputs.mask_numbers, query.device)
    problem = None
    if inputs.kv_num_blocks is not None:
        problem = forward_problem(inputs, mods)
        outputs = None if problem is None else warm_forward(problem, query, key, value, tables, mods.score_values,
                                                            mods.mask_values)
        if outputs is not None:
            return _forward_outputs(query, *outputs, need_max)
    call = _call(mods, query, key, tables, inputs.block_size, inputs.seq_lengths, inputs.scale, needs_grad, need_max)
    score = mods.score_values
    if needs_grad:
        prepare_backward(call, query, key, value, score)
    out, lse, mx = run_forward(call, query, key, value, score, True, need_max)
    if inputs.kv_num_blocks is not None:
        keep_program_walks(call.block_mask)
    if problem is not None:
        remember_forward(problem, call, query, key, value, tables, need_max)
    return _forward_outputs(query, out, lse, mx, need_max)


def forward_problem(inputs: ForwardInputs, mods: _Mods) -> Optional[tuple]:
    """The key of [Note] Warm calls of the forward op (compile/warm.py); None for tables without a
    version counter. The traced mods as well as the call key: the constants among the numbers chose
    them (mod_inputs); the numbers' values are read at launch ([Note] Numbers under torch.compile)."""
    return warm_key([inputs.call_key, mods.score, mods.mask, tuple(inputs.block_size), tuple(inputs.seq_lengths),
                     inputs.scale, inputs.needs_grad, inputs.need_max],
                    (inputs.query, inputs.key, inputs.value, *inputs.score_captured, *inputs.mask_captured),
                    _tables(inputs))


def _forward_outputs(query, out, lse, mx, need_max: bool):
    mx = mx.contiguous() if need_max else query.new_empty(0, dtype=torch.float32)
    return out, lse.contiguous(), mx  # out already in its layout (run_forward)


_LIBRARY.impl("flex_attention", _forward_body, "CompositeExplicitAutograd")
flex_attention_op = torch.ops.flexattn.flex_attention


@torch.library.register_fake("flexattn::flex_attention", lib=_LIBRARY)
def _(*args, **kwargs):
    inputs = ForwardInputs(*args, **kwargs)
    _compile_ahead_while_tracing(inputs)
    query = inputs.query
    B, Hq, L, _ = query.shape
    shape, dims = output_layout(query, inputs.value.shape[3])  # the layout the kernels write, strides and all
    out = query.new_empty(shape).permute(dims)
    lse = query.new_empty((B, Hq, L), dtype=torch.float32)
    mx = query.new_empty((B, Hq, L) if inputs.need_max else (0,), dtype=torch.float32)
    return out, lse, mx


# [Note] Kernels compiled while the graph is traced. The fake implementation is the first place a
# compiled call's shapes are known: Dynamo calls it while tracing, seconds before Inductor has
# compiled the graph and the op first runs. There, once per problem, the op's forward and backward
# run on stand-ins with their launches recorded ([Note] Kernels compiled ahead in kernels/ahead.py),
# so that worker processes compile the kernels while Inductor works. The stand-ins: empty q, k, v
# with the real sizes, strides and dtype (allocated for that moment: the kernels' choices read
# their layout and alignment), zero tables of the real shapes with the row statistics assumed of
# tables whose contents are not known (every row visits every listed column), and zero captured
# tensors. A guess that differs from the real call (the real tables' statistics choose other
# kernels) costs a worker's time, never a result: the real call compiles what it launches.
_TRACED_AHEAD: set = set()


def _compile_ahead_while_tracing(inputs: ForwardInputs) -> None:
    query, key, value, tables = inputs.query, inputs.key, inputs.value, _tables(inputs)
    score_captured, mask_captured = inputs.score_captured, inputs.mask_captured
    score_numbers, mask_numbers, needs_grad = inputs.score_numbers, inputs.mask_numbers, inputs.needs_grad
    if query.device.type != "cuda" or not ahead.enabled():
        return
    given = [query, key, value, *[t for t in tables if t is not None], *score_captured, *mask_captured]
    if not all(isinstance(s, int) for t in given for s in (*t.shape, *t.stride())):  # dynamic shapes
        return
    if not all(type(n) in (bool, int, float) for n in (*score_numbers, *mask_numbers)):  # symbolic numbers
        return
    problem = (inputs.call_key,
               tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad) for t in given),
               tuple(t is None for t in tables), tuple(inputs.block_size), tuple(inputs.seq_lengths), inputs.scale > 0,
               needs_grad, query.device)
    if problem in _TRACED_AHEAD:
        return
    if len(_TRACED_AHEAD) >= 1024:
        _TRACED_AHEAD.clear()
    _TRACED_AHEAD.add(problem)
    try:
        with _as_kernel(), torch.no_grad():
            def like(t):
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)

            def zeros(t):
                return None if t is None else torch.zeros(t.shape, dtype=t.dtype, device=t.device)

            q, k, v = like(query), like(key), like(value)
            stand_in = [zeros(t) for t in tables]
            stats = None if tables[1] is None else RowStats(float(tables[1].shape[-1]), False, False)
            mods = _mods(inputs.call_key, [zeros(t).requires_grad_(t.requires_grad) for t in score_captured], score_numbers,
                         [zeros(t) for t in mask_captured], mask_numbers, q.device)
            call = _call(mods, q, k, stand_in, inputs.block_size, inputs.seq_lengths, inputs.scale, needs_grad, False,
                         stats)
            compile_ahead(call, q, k, v, mods.score_values, forward=True, backward=needs_grad)
    except Exception:  # noqa: BLE001 - only the head start is lost (an out-of-memory GPU, a mod's probe)
        return


def _backward_body(*args, **kwargs):
    """``(dq, dk, dv, [gradient of each score_mod tensor marked in captured_grads])`` of the backward
    op's arguments (BackwardInputs)."""
    with _as_kernel():
        return _backward_impl(BackwardInputs(*args, **kwargs))


def _backward_impl(inputs: BackwardInputs):
    query, key, value, out, lse = inputs.query, inputs.key, inputs.value, inputs.out, inputs.lse
    grad_out, grad_lse, mask_captured = inputs.grad_out, inputs.grad_lse, inputs.mask_captured
    block_size, seq_lengths, scale = inputs.block_size, inputs.seq_lengths, inputs.scale
    captured_grads = inputs.captured_grads
    tables = _tables(inputs)
    # Saved tensors come back without requires_grad; the PyTorch backend reads it to know which
    # gradients to compute.
    score_captured = [t.detach().requires_grad_(wanted) for t, wanted in zip(inputs.score_captured, captured_grads)]
    mods = _mods(inputs.call_key, score_captured, inputs.score_numbers, mask_captured, inputs.mask_numbers,
                 query.device)
    problem = None
    if inputs.kv_num_blocks is not None and not any(captured_grads):
        problem = warm_key([inputs.call_key, mods.score, mods.mask, tuple(block_size), tuple(seq_lengths), scale,
                            "backward"],
                           (query, key, value, out, lse, grad_out, grad_lse, *score_captured, *mask_captured), tables,
                           grad_flags=False)  # the first backward of a compiled graph may see other flags
        grads = None if problem is None else warm_backward(problem, query, key, value, out, lse, grad_out, grad_lse,
                                                           tables, mods.score_values, mods.mask_values)
        if grads is not None:
            dq, dk, dv = grads
            return dq.to(query.dtype).contiguous(), dk.to(key.dtype).contiguous(), dv.to(value.dtype).contiguous(), []
    call = _call(mods, query, key, tables, block_size, seq_lengths, scale, True, False)
    dq, dk, dv, d_all = run_backward(call, query, key, value, out, lse, grad_out, grad_lse, mods.score_values)
    if inputs.kv_num_blocks is not None:
        keep_backward_tables(call.block_mask)
        if problem is not None:
            remember_backward(problem, call, query, key, value, out, grad_out, grad_lse, tables)
    # The gradients of the noted tensors the op was asked for, in the op's order: each from the
    # captured input it is (ModLayout.tensors), zero where the mod does not read it.
    traced = call.score
    d_noted: list = [None] * len(score_captured)
    if traced is not None:
        users = [(c, g) for c, g in zip(traced.captured, d_all) if c.walk_index is not None]
        for (captured, grad), (position, _, _) in zip(users, mods.score_layout.tensors):
            if captured_grads[position] and not captured.requires_grad:  # the traced mod would drop it
                raise RuntimeError(f"flexattn: score_mod '{traced.name}' was traced with '{captured.name}' not "
                                   "requiring grad, but the compiled graph passes it requiring grad")
            d_noted[position] = grad
    d_captured = [_gradient_like(g, t) for g, t, wanted in zip(d_noted, score_captured, captured_grads) if wanted]
    return dq.to(query.dtype).contiguous(), dk.to(key.dtype).contiguous(), dv.to(value.dtype).contiguous(), d_captured



def _gradient_like(grad: Optional[torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    if grad is None:  # the mod's value does not depend on it
        return torch.zeros(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return grad.to(tensor.dtype).reshape(tensor.shape).contiguous()


_LIBRARY.impl("flex_attention_backward", _backward_body, "CompositeExplicitAutograd")
flex_attention_backward_op = torch.ops.flexattn.flex_attention_backward


@torch.library.register_fake("flexattn::flex_attention_backward", lib=_LIBRARY)
def _(*args, **kwargs):
    inputs = BackwardInputs(*args, **kwargs)
    query, key, value = inputs.query, inputs.key, inputs.value
    d_captured = [t.new_empty(t.shape) for t, wanted in zip(inputs.score_captured, inputs.captured_grads) if wanted]
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), d_captured


def _setup_context(ctx, inputs, output):
    (query, key, value, nb, idx, fnb, fidx, score_captured, mask_captured, score_numbers, mask_numbers, call_key,
     block_size, seq_lengths, scale, needs_grad, need_max) = inputs
    out, lse, _ = output
    ctx.save_for_backward(query, key, value, out, lse, nb, idx, fnb, fidx, *score_captured, *mask_captured)
    ctx.counts = (len(score_captured), len(mask_captured))
    ctx.static = (score_numbers, mask_numbers, call_key, block_size, seq_lengths, scale)
    ctx.captured_grads = [t.requires_grad for t in score_captured]
    ctx.mark_non_differentiable(output[2])


def _backward(ctx, grad_out, grad_lse, grad_max):
    query, key, value, out, lse, nb, idx, fnb, fidx, *captured = ctx.saved_tensors
    n_score, n_mask = ctx.counts
    score_captured, mask_captured = captured[:n_score], captured[n_score:]
    score_numbers, mask_numbers, call_key, block_size, seq_lengths, scale = ctx.static
    dq, dk, dv, d_given = flex_attention_backward_op(
        query, key, value, out, lse, grad_out, grad_lse, nb, idx, fnb, fidx, score_captured, mask_captured,
        score_numbers, mask_numbers, call_key, block_size, seq_lengths, scale, ctx.captured_grads)
    d_given = iter(d_given)
    d_captured = [next(d_given) if wanted else None for wanted in ctx.captured_grads]
    # A list of numbers takes None (its structure to autograd: a leaf), an empty one the empty list.
    no_grad = [None if numbers else [] for numbers in (score_numbers, mask_numbers)]
    return (dq, dk, dv, None, None, None, None, d_captured, [None] * n_mask, *no_grad, None, None, None, None, None, None)


# [Note] The forward op's autograd kernel. A compiled graph calls the op with gradients off (the
# graph's own backward takes care of them), yet every call passes through the op's autograd kernel:
# the one torch.library.register_autograd installs checks for gradients in Python and then
# redispatches below autograd, a second trip through the dispatcher, C++ and back, before the body
# runs (a quarter of the op's host time; measured: docs/benchmarks_log.md, "Even ring depths in the
# Hopper kernels", paragraph "The op's autograd kernel, shortened"). So the kernel
# registered here calls the body itself when no gradient is needed and nothing sits between autograd
# and the device's own kernel: no tensor subclass or dispatch mode (fake tensors, functionalization:
# the Python key), no functionalization wrapper. Everything else, gradients included, goes through
# the kernel register_autograd would have made (torch._library.autograd.make_autograd_impl; where a
# torch release lacks it, register_autograd itself, without the shortcut).
_BODY_RUNS_ON = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)


def _register_forward_autograd() -> None:
    op = flex_attention_op.default
    try:
        from torch._library.autograd import Info, make_autograd_impl

        with_autograd = make_autograd_impl(op, Info(_backward, _setup_context))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - a torch release without them
        torch.library.register_autograd("flexattn::flex_attention", _backward, setup_context=_setup_context)
        return
    after_autograd = torch._C._after_autograd_keyset
    in_place_or_view = torch._C.DispatchKey.ADInplaceOrView
    any_requires_grad = torch._C._any_requires_grad

    def autograd_kernel(keyset, *args):
        below = (keyset & after_autograd).remove(in_place_or_view)
        if (below.highestPriorityTypeId() in _BODY_RUNS_ON
                and not (torch.is_grad_enabled() and any_requires_grad(*args))):
            return _forward_body(*args)
        return with_autograd(keyset, *args)

    _LIBRARY.impl("flex_attention", autograd_kernel, "Autograd", with_keyset=True)


_register_forward_autograd()
