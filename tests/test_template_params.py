"""Each kernel's parameters are declared once (flexattn/codegen/params.py): the signature a template
renders, the tuple a launch passes and the spec's ``pack`` agree, for every kernel of every family.

A drift between them would otherwise surface as a wrong argument bound to a wrong parameter inside
Triton; here it fails by name, before any kernel runs.
"""

import ast
import os

import pytest
import torch

import flexattn
import flexattn.kernels.backward as backward_module
import flexattn.kernels.decode as decode_module
import flexattn.kernels.forward as runtime_module
from flexattn.codegen.params import FORWARD, KERNELS, KernelParams, mods_group
from flexattn.kernels import (
    backward_kernel, decode_kernel, forward_kernel, hopper_backward_kernel, hopper_forward_kernel, merging_forward_kernel,
)
from flexattn.trace import trace_mod
from flexattn.variants import CATALOGUE

FAMILY_KERNELS = {"forward": forward_kernel, "backward": backward_kernel, "decode": decode_kernel,
                  "hopper_forward": hopper_forward_kernel, "hopper_backward": hopper_backward_kernel}
# No mods, a mask only, a score_mod with a captured tensor and a mask, learnable tables (their
# gradient buffers are parameters of the backward kernels).
VARIANTS = ("noop", "causal", "alibi", "t5_bias", "graphormer")


def compiled(family: str, variant: str):
    instance = CATALOGUE[variant].make(1, 2, 128, 128, "cpu")
    score = trace_mod(instance.score_mod, "score_mod")[0] if instance.score_mod else None
    mask = trace_mod(instance.mask_mod, "mask_mod")[0] if instance.mask_mod else None
    return FAMILY_KERNELS[family](score, mask).compiled(None)


def mods_of(spec):
    """The mods' parameters the kernels of ``spec`` take: the score_mod's (in the backward, those of
    its gradient: the score_mod's, then the gradient buffers), then the mask_mod's."""
    score = spec.score_mod.kernel_params if spec.score_mod else ()
    if spec.family in ("backward", "hopper_backward") and spec.score_grad is not None:
        assert spec.score_grad.kernel_params[:len(score)] == score
        score = spec.score_grad.kernel_params
    return mods_group(score, spec.mask_mod.kernel_params if spec.mask_mod else ())


def rendered_params(source: str, kernel: str) -> list:
    """(name, is constexpr) of each parameter of the kernel ``kernel`` in ``source``."""
    function = next(node for node in ast.parse(source).body
                    if isinstance(node, ast.FunctionDef) and node.name == kernel)
    return [(a.arg, isinstance(a.annotation, ast.Attribute) and a.annotation.attr == "constexpr")
            for a in function.args.args]


def pack_values(kernel: KernelParams, by_name: dict, mods) -> dict:
    """``kernel.pack``'s keywords from one value per runtime parameter name (strides as tuples)."""
    values = {}
    for group in kernel.runtime:
        if group.kind == "strides":
            for tensor, axes in zip(group.names, group.axes):
                values[f"stride_{tensor}"] = tuple(by_name[f"stride_{tensor}{axis}"] for axis in axes)
        elif group.kind == "mods":
            values["mods"] = [by_name[n] for n in mods.names]
        else:
            values.update((n, by_name[n]) for n in group.names)
    return values


def mismatches(kernel: KernelParams, source: str, mods) -> list:
    """How the kernel rendered in ``source`` disagrees with its declaration (empty: it does not)."""
    params = rendered_params(source, kernel.name)
    names = [n for n, _ in params]
    runtime = [n for n, constexpr in params if not constexpr]
    problems = []
    if names != list(kernel.names(mods)):
        problems.append(f"{kernel.name}: rendered {names}, declared {list(kernel.names(mods))}")
    if {n for n, constexpr in params if constexpr} != kernel.constexpr_names:
        problems.append(f"{kernel.name}: constexprs differ")
    try:
        # Each runtime parameter's value is its own name here, so the packed tuple spells its order.
        packed = kernel.pack(**pack_values(kernel, {n: n for n in names}, mods))
    except (KeyError, TypeError) as error:
        problems.append(f"{kernel.name}: pack failed: {error!r}")
    else:
        if list(packed) != runtime:
            problems.append(f"{kernel.name}: packs {list(packed)}, the kernel takes {runtime}")
    if kernel.argument_count(len(mods.names)) != len(runtime):
        problems.append(f"{kernel.name}: argument_count {kernel.argument_count(len(mods.names))} != {len(runtime)}")
    return problems


@pytest.mark.parametrize("family", sorted(FAMILY_KERNELS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_signatures_are_the_declared_ones(family, variant):
    if family == "decode" and not CATALOGUE[variant].decode:
        pytest.skip("no decode kernel for this variant")
    kernels = compiled(family, variant)
    mods = mods_of(kernels.spec)
    for kernel in KERNELS[family]:
        assert mismatches(kernel, kernels.source, mods) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_merging_forward_takes_the_forward_declaration(variant):
    # The merge into a running result reads and writes OUT, LSE and MAX_SCORES: no parameter of its own.
    instance = CATALOGUE[variant].make(1, 2, 128, 128, "cpu")
    score = trace_mod(instance.score_mod, "score_mod")[0] if instance.score_mod else None
    mask = trace_mod(instance.mask_mod, "mask_mod")[0] if instance.mask_mod else None
    kernels = merging_forward_kernel(score, mask).compiled(None)
    assert "def merge_into_running(" in kernels.source
    assert mismatches(FORWARD, kernels.source, mods_of(kernels.spec)) == []


def test_learnable_tables_add_gradient_buffers():
    mods = mods_of(compiled("backward", "t5_bias").spec)
    assert any(n.endswith("_grad_ptr") for n in mods.names)


def test_a_declaration_that_drifted_is_caught():
    kernels = compiled("forward", "alibi")
    mods = mods_of(kernels.spec)
    strides = next(i for i, g in enumerate(FORWARD.groups) if g.kind == "strides")
    without_strides = KernelParams(FORWARD.name, FORWARD.groups[:strides] + FORWARD.groups[strides + 1:])
    assert mismatches(without_strides, kernels.source, mods)
    assert mismatches(FORWARD, kernels.source, mods_group(mods.names[:-1]))  # a mod parameter lost
    with pytest.raises(TypeError):  # a forgotten name is an error before Triton runs
        values = pack_values(FORWARD, {n: n for n in FORWARD.names(mods)}, mods)
        del values["SM_SCALE"]
        FORWARD.pack(**values)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available(),
                    reason="the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
def test_launches_pass_what_the_declaration_packs(monkeypatch, one_thread):
    """A real forward, backward and decode: each launch's tuple is the spec's pack of its values,
    as long as the rendered kernel's runtime parameters, and its constexprs are the declared ones."""
    launches = []

    def recording(module):
        original = module.launch

        def launch(jit_fn, grid, args, constexprs):
            launches.append((getattr(jit_fn, "fn", jit_fn), args, constexprs))
            return original(jit_fn, grid, args, constexprs)

        monkeypatch.setattr(module, "launch", launch)

    for module in (runtime_module, backward_module, decode_module):
        recording(module)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    L = 128
    instance = CATALOGUE["t5_bias"].make(1, 2, L, L, device)
    q, k, v = (torch.randn(1, 2, L, 16, device=device, requires_grad=True) for _ in range(3))
    block_mask = instance.block_mask(1, 2, L, L, device)
    instance.attend(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "TRITON"}).sum().backward()
    with torch.no_grad():
        instance.attend(torch.randn(1, 2, 1, 16, device=device), k.detach(), v.detach(),
                        block_mask=flexattn.decode_block_mask(block_mask, L - 1, q_len=1),
                        kernel_options={"BACKEND": "TRITON_DECODE", "DECODE_NUM_SPLITS": 2})  # and a merge

    # The Gluon kernels run only on a Hopper GPU, through their own launches (tests/test_gpu_hopper_*.py).
    declared = {kernel.name: kernel for family, kernels in KERNELS.items() for kernel in kernels
                if not family.startswith("hopper")}
    assert {fn.__name__ for fn, _, _ in launches} == set(declared)
    for fn, args, constexprs in launches:
        kernel = declared[fn.__name__]
        kernel.check_constexprs(constexprs)
        with open(fn.__code__.co_filename) as file:
            params = rendered_params(file.read(), kernel.name)
        runtime = [n for n, constexpr in params if not constexpr]
        assert len(args) == len(runtime), kernel.name
        mods = mods_group([n for n in runtime if n not in kernel.names()])
        packed = kernel.pack(**pack_values(kernel, dict(zip(runtime, args)), mods))
        assert len(packed) == len(runtime) and all(a is b for a, b in zip(packed, args)), kernel.name
