"""flexattn.kernels.launch: the facts that key its direct launches, and the interpreter's ordinary path. The
direct path itself needs a GPU (tests/test_gpu.py runs it with changing alignment and tensors)."""

import pytest
import torch

import flexattn.kernels.launch as launch_module
from flexattn.kernels.launch import _facts


def test_facts_tell_apart_what_triton_specialises_on():
    base = torch.zeros(64, dtype=torch.float32)
    aligned, misaligned = base[:16], base[1:17]
    assert _facts((aligned,)) != _facts((misaligned,))  # 16-byte alignment
    assert _facts((aligned,)) != _facts((aligned.to(torch.float16),))  # dtype
    assert _facts((32,)) != _facts((33,))  # divisible by 16
    assert _facts((1,)) != _facts((3,))  # equal to 1
    assert _facts((2**31 + 16,)) != _facts((16,))  # 32-bit range
    assert _facts((True,)) != _facts((False,)) and _facts((True,)) != _facts((1,))
    assert _facts((48, 0.5)) == _facts((16, 2.0))  # same facts: the same compiled kernel serves both
    assert _facts((aligned, object())) is None  # anything else takes Triton's own launch


def test_gluon_descriptors_are_told_apart_as_triton_specialises_them():
    """Triton 3.6 to 3.9 specialise a Gluon tensor descriptor on its dtype, block shape and shared
    layout only (its shape, strides and base address are launch-time values): the facts cover those
    and match Triton's own key wherever they match."""
    gluon = pytest.importorskip("triton.experimental.gluon.language")
    from triton.backends import BaseBackend
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import native_specialize_impl

    rows = torch.empty(4096, 64, dtype=torch.bfloat16)
    wide = gluon.NVMMASharedLayout.get_default_for([64, 64], gluon.bfloat16)
    narrow = gluon.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    descriptors = [
        TensorDescriptor(rows, [4096, 64], [64, 1], [64, 64], wide),
        TensorDescriptor(rows[8:], [1000, 64], [128, 1], [64, 64], wide),  # other shape, strides, base
        TensorDescriptor(rows, [4096, 64], [64, 1], [128, 64], wide),  # block shape
        TensorDescriptor(rows, [4096, 64], [64, 1], [64, 64], narrow),  # layout
        TensorDescriptor(rows.to(torch.float16), [4096, 64], [64, 1], [64, 64], wide),  # dtype
    ]
    for a in descriptors:
        for b in descriptors:
            same_facts = _facts((a,)) == _facts((b,))
            triton_key = [native_specialize_impl(BaseBackend, d, False, True, True) for d in (a, b)]
            assert same_facts <= (triton_key[0] == triton_key[1])  # never one kernel for two of Triton's
    assert _facts((descriptors[0],)) == _facts((descriptors[1],))
    assert len({_facts((d,)) for d in descriptors}) == 4


def test_host_descriptors_are_told_apart_as_triton_specialises_them():
    """The portable forward's host descriptors (triton.tools.tensor_descriptor): Triton 3.6 to 3.9
    specialise them on dtype and block shape only; the facts never join two of Triton's keys."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    from triton.backends import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = torch.empty(4096, 64, dtype=torch.bfloat16)
    descriptors = [
        TensorDescriptor(rows, [4096, 64], [64, 1], [64, 64]),
        TensorDescriptor(rows[8:], [1000, 64], [128, 1], [64, 64]),  # other shape, strides, base
        TensorDescriptor(rows, [4096, 64], [64, 1], [128, 64]),  # block shape
        TensorDescriptor(rows.to(torch.float16), [4096, 64], [64, 1], [64, 64]),  # dtype
        TensorDescriptor(rows.view(4, 1024, 64), [4, 1024, 64], [65536, 64, 1], [1, 64, 64]),  # rank
        TensorDescriptor(rows, [4096, 64], [64, 1], [64, 64], padding="nan"),  # padding
    ]
    for a in descriptors:
        for b in descriptors:
            same_facts = _facts((a,)) == _facts((b,))
            triton_key = [native_specialize_impl(BaseBackend, d, False, True, True) for d in (a, b)]
            assert same_facts <= (triton_key[0] == triton_key[1])
    assert _facts((descriptors[0],)) == _facts((descriptors[1],))  # one kernel serves both
    assert len({_facts((d,)) for d in descriptors}) == 5
    assert _facts((descriptors[0],)) != _facts((descriptors[5],))


def test_interpreted_kernels_take_the_ordinary_launch(monkeypatch):
    calls = []

    class Interpreted:  # like triton.runtime.interpreter.InterpretedFunction: no device_caches
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    before = launch_module.fast_launches
    for _ in range(2):
        launch_module.launch(Interpreted(), (2, 1, 1), (torch.zeros(4), 7), {"BLOCK": 16})
    assert [(grid, len(args), args[1], kwargs) for grid, args, kwargs in calls] == [((2, 1, 1), 2, 7, {"BLOCK": 16})] * 2
    assert launch_module.fast_launches == before


def test_triton_launches_name_the_compile_options(monkeypatch):
    """Launches on Triton's own path pin FP fusion on ([Note] Compile options): the kernels' tuned
    rounding and speed whatever TRITON_DEFAULT_FP_FUSION or a later Triton's default says."""
    from dataclasses import fields

    from triton import knobs
    from triton.backends.nvidia.compiler import CUDAOptions

    assert launch_module.COMPILE_OPTIONS == {"enable_fp_fusion": True}
    assert "enable_fp_fusion" in {f.name for f in fields(CUDAOptions)}  # an option Triton's launch parses
    calls = []

    class Jitted:  # like a JITFunction: it has device caches
        device_caches = {}

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(kwargs)

    monkeypatch.setattr(knobs.runtime, "debug", True)  # the debug knob takes Triton's own launch
    launch_module.launch(Jitted(), (2, 1, 1), (torch.zeros(4), 7), {"BLOCK": 16})
    assert calls == [{"BLOCK": 16, "enable_fp_fusion": True}]


def test_a_profiler_hook_sends_launches_through_triton():
    from triton import knobs

    from flexattn.kernels.launch import _idle

    hook = knobs.runtime.launch_enter_hook
    assert _idle(hook) and _idle(None)
    probe = lambda metadata: None  # noqa: E731
    hook.add(probe)
    try:
        assert not _idle(hook)  # a set hook gets Triton's own launch, with its metadata
    finally:
        hook.remove(probe)


@pytest.mark.parametrize("kind", ["host", "gluon"])
def test_a_descriptor_copied_from_its_template_is_the_one_the_constructor_makes(kind):
    # [Note] Ready launches: warm calls copy their descriptors from a template instead of building
    # them. The copy must be what the constructor makes over the new tensor, field by field, so
    # nothing of the first tensor (its address above all) survives in it; and the template keeps no
    # tensor.
    from flexattn.kernels.launch import descriptor_over, descriptor_template

    first, second = (torch.empty(4096, 64, dtype=torch.bfloat16) for _ in range(2))
    if kind == "host":
        pytest.importorskip("triton.tools.tensor_descriptor")
        from triton.tools.tensor_descriptor import TensorDescriptor

        def make(base):
            return TensorDescriptor(base, [4096, 64], [64, 1], [128, 64])
    else:
        gluon = pytest.importorskip("triton.experimental.gluon.language")
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        layout = gluon.NVMMASharedLayout.get_default_for([128, 64], gluon.bfloat16)

        def make(base):
            return TensorDescriptor(base, [4096, 64], [64, 1], [128, 64], layout)

    template = descriptor_template(make(first))
    assert template is not None and template.base is None
    copied, made = descriptor_over(template, second), make(second)
    assert type(copied) is type(made) and copied.base is second
    assert copied.__dict__.keys() == made.__dict__.keys()
    assert all(copied.__dict__[name] == made.__dict__[name] for name in made.__dict__ if name != "base")
