"""The Hopper Gluon forward family (kernels/hopper/forward.py) without a GPU: its template renders for the
catalogue's mods, its reasons for leaving a call to the portable forward, the BACKEND values, a
kernel that does not compile falling back, and CPU calls untouched by it. Where Triton 3.6 and its
ptxas are installed, one rendered kernel is compiled for sm_90 offline.

Gluon kernels do not run in Triton's interpreter: their numbers are checked in tests/test_gpu_hopper_forward.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flexattn.dispatch as dispatch
import flexattn.kernels.hopper.common as hopper_common
import flexattn.kernels.hopper.forward as hopper_forward
from flexattn import create_block_mask, flex_attention
from flexattn.codegen import render
from flexattn.codegen.params import HOPPER_FORWARD
from flexattn.dispatch import Call, pick_backend
from flexattn.errors import BackendUnavailableError, InvalidInputError
from flexattn.kernels.tables import program_walks
from flexattn.lowering import index_bounds, lowering_variants
from flexattn.options import resolve_backend_name
from flexattn.trace import trace_mod
from flexattn.variants import CATALOGUE

L = 256
ROOT = Path(__file__).resolve().parent.parent


def family(variant: str):
    instance = CATALOGUE[variant].make(1, 2, L, L, "cpu")
    score = trace_mod(instance.score_mod, "score_mod")[0] if instance.score_mod else None
    mask = trace_mod(instance.mask_mod, "mask_mod")[0] if instance.mask_mod else None
    return hopper_forward.HopperForwardKernel(score, mask, tanh_approx=True), instance


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def bhnd(B=1, H=2, N=L, D=64, dtype=torch.bfloat16):
    return torch.randn(B, H, N, D, dtype=dtype)


@pytest.mark.parametrize("variant", sorted(CATALOGUE))
def test_template_renders_for_the_catalogue(variant):
    kernel, _ = family(variant)
    source = render(kernel._spec(lowering_variants(kernel.score, kernel.mask, index_bounds(1, 2, L, L))))
    compile(source, variant, "exec")  # valid Python
    assert f"def {HOPPER_FORWARD.name}(" in source
    # The lowered lines reach the hooks in Gluon's spelling ([Note] Gluon spelling in codegen/source.py).
    assert "tl.full(" not in source and "tl.zeros_like(" not in source
    if kernel.mask is not None:
        assert re.search(r"def mask_mod\(.*\n(    .*\n)*    return (?!q_idx >= 0\n)", source)


def test_rendered_module_imports_and_declares_its_kernel():
    kernel, _ = family("document_mask")
    compiled = kernel.compiled(None)
    assert compiled.kernel(HOPPER_FORWARD) is not None
    assert os.path.basename(compiled.module.__file__).startswith("hopper_fwd_identity_document_mask_")


def test_shape_reasons():
    bm = create_block_mask(causal, None, None, L, L, device="cpu")
    q = bhnd()
    assert hopper_common.shape_reason(q, q, q, bm, need_max=False) is None
    assert "float16 or bfloat16" in hopper_common.shape_reason(q.float(), q.float(), q.float(), bm, False)
    q96 = bhnd(D=96)
    assert "64 or 128" in hopper_common.shape_reason(q96, q96, q96, bm, False)
    assert "64 or 128" in hopper_common.shape_reason(q, q, bhnd(D=128), bm, False)
    short = bhnd(N=200)
    bm200 = create_block_mask(causal, None, None, 200, 200, device="cpu")
    assert "multiples of 128" in hopper_common.shape_reason(short, short, short, bm200, False)
    bm64 = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=64)
    assert "BLOCK_SIZE" in hopper_common.shape_reason(q, q, q, bm64, False)
    assert "max_scores" in hopper_common.shape_reason(q, q, q, bm, True)
    odd = torch.randn(1, 2, L, 64 * 3, dtype=torch.bfloat16)[..., ::3]  # no unit last stride
    assert "2-D tensor descriptor" in hopper_common.shape_reason(odd, q, q, bm, False)


def test_device_reasons(monkeypatch):
    device = torch.device("cuda", 0)
    monkeypatch.setattr(hopper_common, "interpreter_enabled", lambda: False)
    for unchecked in ("3.5.1", "3.10.0"):
        monkeypatch.setattr(hopper_common, "_triton_version", lambda: unchecked)
        assert hopper_common.device_reason(device) == f"Gluon kernels validated on Triton 3.6 to 3.9 only (this is Triton {unchecked})"
    for version in ("3.6.0", "3.7.1", "3.8.0", "3.9.0"):
        monkeypatch.setattr(hopper_common, "_capability", lambda index: (9, 0))
        monkeypatch.setattr(hopper_common, "_triton_version", lambda: version)
        assert hopper_common.device_reason(device) is None
    monkeypatch.setattr(hopper_common, "_triton_version", lambda: "3.6.0")
    monkeypatch.setattr(hopper_common, "_capability", lambda index: (8, 0))
    assert "compute capability 9.0" in hopper_common.device_reason(device)
    monkeypatch.setattr(hopper_common, "_capability", lambda index: (10, 0))
    assert "this GPU is 10.0" in hopper_common.device_reason(device)
    monkeypatch.setattr(hopper_common, "_capability", lambda index: (9, 0))
    assert hopper_common.device_reason(device) is None
    monkeypatch.setattr(hopper_common, "interpreter_enabled", lambda: True)
    assert "interpreter" in hopper_common.device_reason(device)
    q = bhnd()
    assert "CUDA device" in hopper_forward.problem_reason(q, q, q, create_block_mask(causal, None, None, L, L, device="cpu"),
                                                False)


def test_views_of_the_layouts_it_reads():
    B, H, N, D = 2, 4, L, 64
    q = torch.randn(B, H, N, D)
    assert hopper_common.tensor_view(q, q.stride()) == hopper_common.View((B * H * N, D), D, H * N, N, 0)
    t = torch.randn(B, N, H, D).transpose(1, 2)  # heads side by side in a row
    assert hopper_common.tensor_view(t, t.stride()) == hopper_common.View((B * N, H * D), H * D, N, 0, D)
    one = torch.randn(1, H, N, D).expand(B, -1, -1, -1)  # a broadcast batch reads batch 0's rows
    assert hopper_common.tensor_view(one, one.stride()).row_z == 0
    wide = torch.randn(B, H, N, 2 * D)[..., :D]  # a slice of the head dim: longer rows, same view
    assert hopper_common.tensor_view(wide, wide.stride()) == hopper_common.View((B * H * N, D), 2 * D, H * N, N, 0)
    assert hopper_common.tensor_view(q.transpose(2, 3), q.transpose(2, 3).stride()) is None


def test_auto_rule_keeps_few_block_rows_at_head_dim_64_portable():
    q = bhnd(N=1024)
    dense = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, 1024, 1024, device="cpu")
    assert "few key blocks" in hopper_forward.auto_reason(q, dense)  # 8 blocks a row
    assert hopper_forward.auto_reason(bhnd(N=1024, D=128), dense) is None
    long = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, 4096, 4096, device="cpu")
    assert hopper_forward.auto_reason(bhnd(N=4096), long) is None  # 32 blocks a row
    causal = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 4096, 4096, device="cpu")
    assert "few key blocks (16.5" in hopper_forward.auto_reason(bhnd(N=4096), causal)  # measured faster portable
    # A score_mod alone takes the Gluon forward on long rows; with a mask_mod too (ALiBi) it does not.
    assert hopper_forward.auto_reason(bhnd(N=4096), long, has_score_mod=True) is None
    assert "few key blocks" in hopper_forward.auto_reason(q, dense, has_score_mod=True)
    assert "score_mod and a mask_mod" in hopper_forward.auto_reason(bhnd(N=4096), causal, has_score_mod=True,
                                                           has_mask_mod=True)
    assert hopper_forward.auto_reason(bhnd(N=4096, D=128), causal, has_score_mod=True, has_mask_mod=True) is None
    assert hopper_forward.auto_reason(bhnd(N=4096, D=128), long, has_score_mod=True) is None


def test_gluon_spellings_by_release():
    # [Note] Gluon API by Triton release (codegen/source.py): the decorator of the partitions'
    # aggregate classes is private before 3.8, public from it; each release's own module has it.
    import triton

    from flexattn.codegen.source import gluon_api

    assert gluon_api("3.6.0")["aggregate"] == gluon_api("3.7.1")["aggregate"] == "triton.language.core._aggregate"
    assert gluon_api("3.8.0")["aggregate"] == gluon_api("3.9.0")["aggregate"] == "gluon.aggregate"
    from triton.experimental import gluon  # the rendered module's name for it

    holder, _, name = gluon_api()["aggregate"].rpartition(".")
    assert callable(getattr({"gluon": gluon, "triton.language.core": triton.language.core}[holder], name))


def test_backend_values():
    assert resolve_backend_name({"BACKEND": "GLUON"}) == "GLUON"
    with pytest.raises(ValueError, match="GLUON"):
        resolve_backend_name({"BACKEND": "CUTE"})
    with pytest.raises(BackendUnavailableError, match="GLUON"):
        pick_backend(bhnd(), {"BACKEND": "GLUON"})  # CPU tensors
    with pytest.raises(BackendUnavailableError, match="GLUON"):
        flex_attention(bhnd(), bhnd(), bhnd(), kernel_options={"BACKEND": "GLUON"})


class _FailingKernel:
    """A family whose kernel does not compile (what an unrenderable mod does on the GPU)."""

    def unsupported_reason(self, *args):
        return None

    def problem_reason(self, *args):
        return None

    def failed_reason(self, *args):
        return None

    def __call__(self, *args, **kwargs):
        raise hopper_common.HopperUnavailable("the Gluon kernel of these mods did not compile (CompilationError: x)")


def test_a_kernel_that_does_not_compile_falls_back_unless_pinned(monkeypatch):
    monkeypatch.setattr(dispatch, "hopper_forward_kernel", lambda *args, **kwargs: _FailingKernel())
    monkeypatch.setattr(dispatch, "_GLUON_FORWARD", {})  # no choice kept from another test's families
    monkeypatch.setattr(dispatch, "hopper_auto_reason", lambda q, block_mask, has_score_mod, has_mask_mod: None)
    q = bhnd()
    bm = create_block_mask(causal, None, None, L, L, device="cpu")
    call = Call("TRITON", bm, 0.125, None, None, [], {}, torch.int32)
    result, note = dispatch._sm90_forward(call, q, q, q, [], True, False)
    assert result is None and "did not compile" in note
    with pytest.raises(InvalidInputError, match="BACKEND='GLUON' cannot run this call: .*did not compile"):
        dispatch._sm90_forward(call._replace(options={"BACKEND": "GLUON"}), q, q, q, [], True, False)
    result, note = dispatch._sm90_forward(call._replace(options={"BLOCK_M": 64}), q, q, q, [], True, False)
    assert result is None and "BLOCK_M" in note


def test_the_family_remembers_a_kernel_that_did_not_compile(monkeypatch):
    kernel, instance = family("document_mask")
    q = bhnd()
    bm = instance.block_mask(1, 2, L, L, "cpu")

    def no_compile(*args, **kwargs):
        raise RuntimeError("error: unsupported operation in Gluon")

    monkeypatch.setattr(kernel, "_launch", no_compile)
    monkeypatch.setattr(hopper_forward, "problem_reason", lambda *args: None)
    with pytest.raises(hopper_common.HopperUnavailable, match="did not compile .*unsupported operation"):
        kernel(q, q, q, bm, 0.125, [], [], need_lse=True)
    assert "unsupported operation" in kernel.unsupported_reason(q, q, q, bm, False)
    assert not kernel._plans  # nothing kept of the failed launch


def test_cpu_calls_never_reach_it():
    before, families = hopper_forward.launches, len(hopper_forward._kernels)
    q = bhnd(D=16).float()
    flex_attention(q, q, q, block_mask=create_block_mask(causal, None, None, L, L, device="cpu"))  # PYTORCH
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        flex_attention(q, q, q, kernel_options={"BACKEND": "TRITON"})
        flex_attention(q, q, q, kernel_options={"BACKEND": "TRITON", "TANH_APPROX": False})
    assert hopper_forward.launches == before and len(hopper_forward._kernels) == families


def _offline_compile_available() -> bool:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except ImportError:
        return False
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return triton.__version__.startswith(hopper_common.GLUON_COMPILES_ON) and os.path.exists(ptxas)


@pytest.mark.skipif(not _offline_compile_available(),
                    reason="needs a Triton of hopper_common.GLUON_COMPILES_ON with its ptxas (offline sm_90 compile)")
@pytest.mark.parametrize("variant, consumers", [("causal", 2), ("noop", 3), ("causal", 3)])
def test_kernel_compiles_for_sm_90_offline(variant, consumers):
    """The rendered kernel through Triton's whole pipeline for sm_90 (causal with two consumer
    warpgroups; noop with three, [Note] Three consumers on an unmasked walk; causal with three, [Note]
    Programs across query blocks): its consumers issue
    wgmma and it fits the shared memory of an H100. In a process of its own without
    TRITON_INTERPRET (under the interpreter @triton.jit hooks cannot be compiled); about 5 s."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = f"import test_hopper_forward; test_hopper_forward.compile_offline({variant!r}, {consumers})"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled" in done.stdout


def compile_offline(variant: str, consumers: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    kernel, _ = family(variant)
    D = 64
    rows = torch.empty(2 * L, D, dtype=torch.bfloat16)
    half = gl.NVMMASharedLayout.get_default_for([64, D], gl.bfloat16)
    tile = gl.NVMMASharedLayout.get_default_for([128, D], gl.bfloat16)
    descriptor = {64: TensorDescriptor(rows, [2 * L, D], [D, 1], [64, D], half),
                  128: TensorDescriptor(rows, [2 * L, D], [D, 1], [128, D], tile)}
    constexprs = dict(SPARSE_Z=1, SPARSE_HQ=1, GQA_GROUP=1, HEAD_DIM=D, SPARSE_Q_BLOCK_SIZE=128,
                      SPARSE_KV_BLOCK_SIZE=128, BLOCK_M=128, BLOCK_N=128, STAGES=hopper_forward.STAGES[D],
                      CONSUMER_REGS=hopper_common.CONSUMER_REGS if consumers == 2 else hopper_forward.THREE_CONSUMER_REGS,
                      HAS_SCORE_MOD=False, SCALE_FIRST=False, HAS_PARTIAL_BLOCKS=kernel.has_mask_mod,
                      HAS_FULL_BLOCKS=True, OUTPUT_LSE=True, CONSUMERS=consumers, TAKE_TURNS=consumers == 3,
                      UNION_WALK=consumers == 3 and kernel.has_mask_mod,
                      RESIDENT_IN_REGISTERS=consumers == 2 and hopper_common.resident_in_registers("forward", D))
    constexprs["BLOCK_M"] = 64 * consumers
    signature = {}
    for name in HOPPER_FORWARD.names():
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Q", "OUT", "K", "V"):
            signature[name] = mangle_type(descriptor[64 if name in ("Q", "OUT") else 128])
        elif name == "LSE":
            signature[name] = "*fp32"
        elif name in ("KV_NUM_BLKS", "KV_IDX", "FULL_KV_NUM_BLKS", "FULL_KV_IDX", "WALK_NUM", "WALK"):
            signature[name] = "*i32"
        else:
            signature[name] = "fp32" if name == "SM_SCALE" else "i32"
    compiled = triton.compile(GluonASTSource(kernel.compiled(None).kernel(HOPPER_FORWARD), signature, constexprs, {}),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert len(re.findall(r"wgmma\.mma_async", compiled.asm["ptx"])) > 0
    assert compiled.metadata.shared <= 227 * 1024
    print("compiled")


def test_a_plan_is_made_once_and_kept(monkeypatch):
    # The launch path without a GPU: _launch stands in for the kernel (see test_hopper_backward.py).
    kernel, instance = family("causal")
    q = bhnd()
    monkeypatch.setattr(hopper_forward, "problem_reason", lambda *args: None)
    launched = []

    def fake_launch(plan, *args):
        launched.append(plan)
        return "out", "lse"

    monkeypatch.setattr(kernel, "_launch", fake_launch)
    prepared = []  # the second call's: its prepared launch ([Note] Prepared Gluon forward launches)
    monkeypatch.setattr(hopper_forward, "launch", lambda jit_fn, grid, args, constexprs: prepared.append(grid))
    bm = instance.block_mask(1, 2, L, L, "cpu")
    before = hopper_forward.launches
    assert kernel(q, q, q, bm, 0.125, [], [], need_lse=True) == ("out", "lse")
    out, lse = kernel(q, q, q, bm, 0.125, [], [], need_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert len(launched) == 1 and prepared == [launched[0].steps["forward"].grid] and len(kernel._plans) == 1
    assert kernel.prepared_calls == 1
    assert hopper_forward.launches == before + 2 and kernel.last_plan is launched[0]
    assert launched[0].steps["forward"].grid == (L // 128, 2, 1)
    # [Note] Resident tiles in registers: Q is read from registers at head dim 64, from shared memory at 128.
    assert launched[0].steps["forward"].constexprs["RESIDENT_IN_REGISTERS"]
    wide = bhnd(D=128)
    kernel(wide, wide, wide, bm, 0.125, [], [], need_lse=True)
    assert not kernel.last_plan.steps["forward"].constexprs["RESIDENT_IN_REGISTERS"]


def test_three_consumers_only_on_long_walks_at_head_dim_64(monkeypatch):
    # [Note] Three consumers on an unmasked walk: the mask of a call without one (marked every block
    # full by construction), no mask_mod, head dim 64, at least THREE_CONSUMERS_MIN_KEY_BLOCKS key blocks.
    # [Note] Programs across query blocks: with a mask_mod, the union of two query blocks' walks.
    from flexattn.masks import BlockMask, dense_block_mask

    monkeypatch.setattr(hopper_forward, "problem_reason", lambda *args: None)
    launched = []
    noop, _ = family("noop")
    causal_kernel, causal_instance = family("causal")
    for kernel in (noop, causal_kernel):
        monkeypatch.setattr(kernel, "_launch", lambda plan, *args: launched.append(plan) or ("out", "lse"))
    long = hopper_forward.THREE_CONSUMERS_MIN_KEY_BLOCKS * 128
    q, wide = bhnd(N=long), bhnd(N=long, D=128)
    noop(q, q, q, dense_block_mask(long, long, torch.device("cpu")), 0.125, [], [], need_lse=True)
    step = launched[-1].steps["forward"]
    assert step.constexprs["CONSUMERS"] == 3 and step.constexprs["BLOCK_M"] == 192
    assert step.grid == (-(-long // 192), 2, 1) and step.constexprs["CONSUMER_REGS"] == hopper_forward.THREE_CONSUMER_REGS
    assert not step.constexprs["RESIDENT_IN_REGISTERS"]  # 160 registers: Q stays in shared memory
    assert step.constexprs["TAKE_TURNS"]  # [Note] Turns on the tensor cores
    HOPPER_FORWARD.check_constexprs(step.constexprs)
    two = [(noop, wide, dense_block_mask(long, long, torch.device("cpu"))),  # head dim 128
           # too few key blocks
           (noop, bhnd(N=long - 128), dense_block_mask(long - 128, long - 128, torch.device("cpu"))),
           (noop, q, create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, long, long,
                                       device="cpu")),  # a mask the caller built, without a mask_mod
           (causal_kernel, bhnd(N=long - 128), causal_instance.block_mask(1, 2, long - 128, long - 128, "cpu"))]
    # Causal rows of 48 key blocks visit 24.5 on average.
    causal_mask = causal_instance.block_mask(1, 2, 2 * long, 2 * long, "cpu")
    q2 = bhnd(N=2 * long)
    tables = [causal_mask.kv_num_blocks, causal_mask.kv_indices, causal_mask.full_kv_num_blocks,
              causal_mask.full_kv_indices]
    # Rows of fewer key blocks on average than THREE_CONSUMERS_MIN_KEY_BLOCKS (a window of 2 blocks).
    window = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 256), None, None,
                               long, long, device="cpu")
    two.append((causal_kernel, q, window))
    # A mask of another Q_LEN (the public API refuses it; a caller inside might not).
    two.append((causal_kernel, q2, causal_instance.block_mask(1, 2, 2 * long + 128, 2 * long + 128, "cpu")))
    # A compiled call's mask (one call): the walks would be derived at every call.
    two.append((causal_kernel, q2, BlockMask.from_launch_tables((2 * long, 2 * long), *tables, one_call=True)))
    for kernel, x, mask in two:
        kernel(x, x, x, mask, 0.125, [], [], need_lse=True)
        step = launched[-1].steps["forward"]
        assert step.constexprs["CONSUMERS"] == 2 and step.grid[0] == x.shape[2] // 128
        assert not step.constexprs["TAKE_TURNS"] and not step.constexprs["UNION_WALK"]
    causal_kernel(q2, q2, q2, causal_mask, 0.125, [], [], need_lse=True)
    step = launched[-1].steps["forward"]
    assert step.constexprs["CONSUMERS"] == 3 and step.constexprs["UNION_WALK"] and step.constexprs["TAKE_TURNS"]
    assert step.grid == (-(-2 * long // 192), 2, 1)
    # A compiled call's mask whose maker keeps what is derived per table (compile/kept.py): the walks pay.
    kept = BlockMask.from_launch_tables((2 * long, 2 * long), *tables, one_call=True, derived_kept=True)
    assert not kept.serves_one_call
    causal_kernel(q2, q2, q2, kept, 0.125, [], [], need_lse=True)
    assert launched[-1].steps["forward"].constexprs["UNION_WALK"]
    # Its warm launch takes the walks of each call's tables, and launches nothing without them.
    plan = causal_kernel.kept_plan(q2, q2, q2, kept, 0.125, need_lse=True)
    assert plan is launched[-1]
    warm = causal_kernel.warm_launch(plan, q2, q2, q2, kept, 0.125, need_lse=True)
    assert warm.takes_walks
    tables_now = hopper_forward.launch_tables(kept)
    assert warm(q2, q2, q2, tables_now, [], []) is None
    shorter = program_walks(causal_instance.block_mask(1, 2, 2 * long - 128, 2 * long - 128, "cpu"))
    assert warm(q2, q2, q2, tables_now, [], [], walks=shorter) is None
    # A table of the unmasked call's mask written in place (the same values here, so the shared mask
    # stays right): the mark by construction no longer holds, and neither does the shared walk.
    longer = long + 128
    mask = dense_block_mask(longer, longer, torch.device("cpu"))
    x = bhnd(N=longer)
    noop(x, x, x, mask, 0.125, [], [], need_lse=True)
    assert launched[-1].steps["forward"].constexprs["CONSUMERS"] == 3
    mask.full_kv_indices[0, 0, 0, 0] = mask.full_kv_indices[0, 0, 0, 0].clone()
    noop(x, x, x, mask, 0.125, [], [], need_lse=True)
    assert launched[-1].steps["forward"].constexprs["CONSUMERS"] == 2


def brute_force_walks(partial: torch.Tensor, full: torch.Tensor, q_len: int):
    """[Note] Programs across query blocks spelled out: per program of 192 rows (consumers of 64, the
    last clamped to the queries), the key blocks either of its query blocks lists, ascending, with
    what each block is to its first and last query block (0 not listed, 1 partial, 2 full)."""
    kinds = partial.int() + 2 * full.int()
    walks = []
    for start in range(0, q_len, 192):
        rows = [min(start + 64 * c, q_len - 64) // 128 for c in range(3)]
        first, last = kinds[rows[0]], kinds[rows[-1]]
        walks.append([(j, int(first[j]), int(last[j])) for j in range(kinds.shape[1]) if first[j] or last[j]])
    return walks


def decoded(walks, b: int, h: int, program: int) -> list:
    """A program's walk as (key block, kind to its first query block, kind to its last) triples."""
    entries = walks.entries[b, h, program, :walks.num[b, h, program]].tolist()
    return [(e >> 4, (e >> 2) & 3, e & 3) for e in entries]


@pytest.mark.parametrize("q_len, kv_len", [(1280, 1280), (3200, 2048), (128, 384), (1152, 1152)])
def test_program_walks_against_brute_force(q_len, kv_len):
    from flexattn.kernels.tables import program_walks
    from flexattn.masks import BlockMask

    gen = torch.Generator().manual_seed(q_len + kv_len)
    rows, cols = q_len // 128, kv_len // 128
    listed = torch.rand(2, 3, rows, cols, generator=gen)
    partial, full = listed < 0.3, listed > 0.6  # some rows empty, some all full

    def tables(dense):
        num = dense.sum(-1).int()
        idx = torch.argsort(dense.int(), dim=-1, descending=True, stable=True).int()
        return num, idx

    mask = BlockMask.from_kv_blocks(*tables(partial), *tables(full), BLOCK_SIZE=128, seq_lengths=(q_len, kv_len))
    walks = program_walks(mask, 192, 64)
    assert walks.num.shape == (2, 3, -(-q_len // 192)) and walks.entries.shape == (2, 3, -(-q_len // 192), cols)
    for b in range(2):
        for h in range(3):
            want = brute_force_walks(partial[b, h], full[b, h], q_len)
            for p, expected in enumerate(want):
                assert decoded(walks, b, h, p) == expected, (b, h, p)
    assert program_walks(mask, 192, 64) is walks  # kept on the mask
    # A table written in place: the walks are derived again, from the new content.
    mask.full_kv_num_blocks.zero_()
    again = program_walks(mask, 192, 64)
    assert again is not walks
    expected = brute_force_walks(partial[0, 0], torch.zeros_like(full[0, 0]), q_len)
    assert decoded(again, 0, 0, 0) == expected[0]


def test_the_launcher_packs_what_the_kernel_declares(monkeypatch):
    # The real launcher on CPU tensors, the Gluon kernel recorded (see test_hopper_backward.py).
    from test_hopper_backward import _Recorder

    from flexattn.kernels.family import CompiledKernel

    calls = []
    monkeypatch.setattr(CompiledKernel, "kernel", lambda self, params: _Recorder(params, calls))
    monkeypatch.setattr(hopper_forward, "problem_reason", lambda *args: None)
    kernel, instance = family("alibi")
    B, H, E = 2, 2, 64
    q = torch.randn(B, L, H, E, dtype=torch.bfloat16).transpose(1, 2)  # heads side by side in a row
    k, v = (torch.randn(B, H, L, E, dtype=torch.bfloat16) for _ in range(2))
    score_captured = trace_mod(instance.score_mod, "score_mod")[1]
    out, lse = kernel(q, k, v, instance.block_mask(B, H, L, L, "cpu"), 0.125, score_captured, [], need_lse=True)
    assert out.shape == q.shape and lse.shape == (B, H, L)
    [(params, grid, args, constexprs)] = calls
    assert params is HOPPER_FORWARD and grid == kernel.last_plan.steps["forward"].grid
    assert len(args) == HOPPER_FORWARD.argument_count(len(kernel.compiled(None).spec.score_mod.kernel_params))
    HOPPER_FORWARD.check_constexprs(constexprs)
    by_name = dict(zip((n for g in HOPPER_FORWARD.runtime if g.kind != "mods" for n in g.expanded()), args))
    assert (by_name["row_qz"], by_name["row_qh"], by_name["col_qh"]) == (L, 0, E)
    assert (by_name["row_kz"], by_name["row_kh"], by_name["col_kh"]) == (H * L, L, 0)
