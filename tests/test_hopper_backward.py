"""The Hopper Gluon backward family (kernels/hopper/backward.py) without a GPU: its template renders
for the catalogue's mods, its reasons for leaving a call to the portable backward, the options that
pin either, a kernel that does not compile falling back, ``flexattn kernel --explain``, and (where
Triton 3.6 and its ptxas are installed) the causal kernels compiled for sm_90 offline.

Gluon kernels do not run in Triton's interpreter: their numbers are checked in
tests/test_gpu_hopper_backward.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_hopper_forward import _offline_compile_available, bhnd, causal

import flexattn.dispatch as dispatch
import flexattn.kernels.hopper.backward as hopper_backward
import flexattn.kernels.hopper.common as hopper_common
from flexattn import create_block_mask
from flexattn.cli.kernel_source import explain
from flexattn.cli.main import main
from flexattn.codegen import render
from flexattn.codegen.params import BACKWARD_PREPROCESS, HOPPER_BACKWARD_DKDV, HOPPER_BACKWARD_DQ
from flexattn.dispatch import Call
from flexattn.kernels.tables import backward_tables, dq_turns
from flexattn.errors import InvalidInputError
from flexattn.lowering import index_bounds, lowering_variants
from flexattn.trace import trace_mod
from flexattn.variants import CATALOGUE

L = 256
ROOT = Path(__file__).resolve().parent.parent


def family(variant: str):
    instance = CATALOGUE[variant].make(1, 2, L, L, "cpu")
    score = trace_mod(instance.score_mod, "score_mod")[0] if instance.score_mod else None
    mask = trace_mod(instance.mask_mod, "mask_mod")[0] if instance.mask_mod else None
    return hopper_backward.HopperBackwardKernel(score, mask, tanh_approx=True), instance


@pytest.mark.parametrize("variant", sorted(CATALOGUE))
def test_template_renders_for_the_catalogue(variant):
    kernel, _ = family(variant)
    source = render(kernel._spec(lowering_variants(kernel.score, kernel.mask, index_bounds(1, 2, L, L))))
    compile(source, variant, "exec")  # valid Python
    for params in (BACKWARD_PREPROCESS, HOPPER_BACKWARD_DKDV, HOPPER_BACKWARD_DQ):
        assert f"def {params.name}(" in source
    # The lowered lines reach the hooks in Gluon's spelling ([Note] Gluon spelling in codegen/source.py).
    assert "tl.full(" not in source and "tl.zeros_like(" not in source


def test_problem_reasons(monkeypatch):
    bm = create_block_mask(causal, None, None, L, L, device="cpu")
    q = bhnd()
    assert "CUDA device" in hopper_backward.problem_reason(q, q, q, bm)
    # Past the device (and the forward's other reasons), the backward's own.
    monkeypatch.setattr(hopper_backward, "common_problem_reason", lambda *args, **kwargs: None)
    assert hopper_backward.problem_reason(q, q, q, bm) is None
    one, two = bhnd(B=1), bhnd(B=2)
    assert "broadcast" in hopper_backward.problem_reason(two, one, one, bm)
    assert "float32" in hopper_backward.problem_reason(q, q, q, bm, float32_kv_grads=True)
    assert hopper_backward.problem_reason(q, q, q, bm, grad_out=q.clone()) is None
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # base 2 bytes off
    assert "gradient" in hopper_backward.problem_reason(q, q, q, bm, grad_out=shifted)
    assert "gradient" in hopper_backward.problem_reason(q, q, q, bm, grad_out=q.float())


def test_learnable_tensors_take_the_portable_backward(monkeypatch):
    monkeypatch.setattr(hopper_backward, "problem_reason", lambda *args: None)
    q = bhnd()
    learnable, instance = family("t5_bias")
    bm = instance.block_mask(1, 2, L, L, "cpu")
    assert "learnable" in learnable.unsupported_reason(q, q, q, bm)
    fixed, instance = family("alibi")
    assert fixed.unsupported_reason(q, q, q, instance.block_mask(1, 2, L, L, "cpu")) is None


def test_auto_takes_rows_of_few_key_blocks(monkeypatch):
    # AUTO's backward has no rule of its own past what the kernels can run: rows of three to nine key
    # blocks at head dim 64 were measured faster here too (dispatch.sm90_backward_choice).
    def everything(b, h, q_idx, kv_idx):
        return q_idx >= 0

    monkeypatch.setattr(hopper_backward, "problem_reason", lambda *args: None)
    for D in (64, 128):
        q = bhnd(N=512, D=D)
        few = create_block_mask(everything, None, None, 512, 512, device="cpu")  # 4 blocks a row
        call = Call("TRITON", few, 0.125, None, trace_mod(everything, "mask_mod")[0], [], {}, torch.int32)
        kernel, reason = dispatch.sm90_backward_choice(call, q, q, q)
        assert isinstance(kernel, hopper_backward.HopperBackwardKernel) and reason is None
        pinned = call._replace(options={"BACKEND": "TRITON"})
        assert dispatch.sm90_backward_choice(pinned, q, q, q) == (
            None, "kernel_options BACKEND='TRITON' pins the portable kernels")


class _FailingKernel:
    """A family whose kernels do not compile (what an unrenderable mod does on the GPU)."""

    def unsupported_reason(self, *args):
        return None

    def problem_reason(self, *args):
        return None

    def failed_reason(self, *args):
        return None

    def trainable_reason(self, *args):
        return None

    def __call__(self, *args, **kwargs):
        raise hopper_common.HopperUnavailable("the Gluon backward of these mods did not compile (CompilationError: x)")


def test_choices_and_a_kernel_that_does_not_compile(monkeypatch):
    monkeypatch.setattr(dispatch, "hopper_backward_kernel", lambda *args, **kwargs: _FailingKernel())
    monkeypatch.setattr(dispatch, "_GLUON_BACKWARD", {})  # no choice kept from another test's families
    q = bhnd()
    bm = create_block_mask(causal, None, None, L, L, device="cpu")
    call = Call("TRITON", bm, 0.125, None, None, [], {}, torch.int32)
    args = (q, q, q, q, torch.zeros(1, 2, L), q, None, [], False)
    grads, note = dispatch._sm90_backward(call, *args)
    assert grads is None and "did not compile" in note
    with pytest.raises(InvalidInputError, match="BACKEND='GLUON' cannot run this call's backward: .*did not compile"):
        dispatch._sm90_backward(call._replace(options={"BACKEND": "GLUON"}), *args)
    kernel, reason = dispatch.sm90_backward_choice(call._replace(options={"BLOCK_M1": 32}), q, q, q)
    assert kernel is None and "BLOCK_M1" in reason
    kernel, reason = dispatch.sm90_backward_choice(call._replace(options={"BACKEND": "TRITON"}), q, q, q)
    assert kernel is None and "BACKEND='TRITON'" in reason


def test_the_family_remembers_kernels_that_did_not_compile(monkeypatch):
    kernel, instance = family("document_mask")
    q = bhnd()
    bm = instance.block_mask(1, 2, L, L, "cpu")

    def no_compile(*args, **kwargs):
        raise RuntimeError("error: unsupported operation in Gluon")

    monkeypatch.setattr(kernel, "_launch", no_compile)
    monkeypatch.setattr(hopper_backward, "problem_reason", lambda *args: None)
    with pytest.raises(hopper_common.HopperUnavailable, match="did not compile .*unsupported operation"):
        kernel(q, q, q, q, torch.zeros(1, 2, L), q, None, bm, 0.125, [], [])
    assert "unsupported operation" in kernel.unsupported_reason(q, q, q, bm)
    assert not kernel._plans


def test_explain_names_each_stage_and_why(monkeypatch):
    score_mod, mask_mod = CATALOGUE["alibi"].build(1, 2, L, L, "cpu")
    lines = dict(explain(score_mod, mask_mod, 1, 2, L, L, 64, torch.bfloat16, "cpu"))
    assert set(lines) == {"forward", "backward", "decode"}
    assert all("blockwise PyTorch" in choice for choice in lines.values())  # AUTO on CPU tensors
    monkeypatch.setattr(dispatch, "pick_backend", lambda q, options: "TRITON")  # as on a GPU
    lines = dict(explain(score_mod, mask_mod, 1, 2, L, L, 64, torch.bfloat16, "cpu"))
    assert "templates/forward.py.jinja" in lines["forward"] and "CUDA device" in lines["forward"]
    assert "templates/backward.py.jinja" in lines["backward"] and "CUDA device" in lines["backward"]


def test_explain_names_the_gluon_backward_form(monkeypatch):
    # Where the Gluon backward runs, --explain says whether dQ joins the dK/dV kernel (head dim 64 or
    # 128: [Note] dQ in the dK/dV kernel; in a fixed order when deterministic, [Note] Ordered dQ
    # additions) or has a kernel of its own.
    monkeypatch.setattr(dispatch, "pick_backend", lambda q, options: "TRITON")
    monkeypatch.setattr(dispatch, "sm90_forward_choice", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(dispatch, "sm90_backward_choice", lambda *args, **kwargs: (None, None))

    def backward(head_dim, mask_mod=None):
        return dict(explain(None, mask_mod, 1, 2, L, L, head_dim, torch.bfloat16, "cpu"))["backward"]

    assert backward(64).endswith("dQ added in the dK/dV kernel, no dQ kernel")
    assert backward(64, causal).endswith("dQ added in the dK/dV kernel, no dQ kernel")
    assert backward(128).endswith("dQ added in the dK/dV kernel, no dQ kernel")
    assert backward(128, causal).endswith("dQ added in the dK/dV kernel, no dQ kernel")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert backward(64).endswith("dQ added in the dK/dV kernel in a fixed order, no dQ kernel")
    assert backward(128).endswith("dQ added in the dK/dV kernel in a fixed order, no dQ kernel")
    assert backward(128, causal).endswith("dK/dV and dQ kernels")  # rows unlike: hopper_backward.ORDERS_DQ
    monkeypatch.setattr(hopper_backward, "ORDERS_DQ", "never")
    assert backward(64).endswith("dK/dV and dQ kernels")


def test_explain_on_the_command_line(capsys):
    assert main(["kernel", "causal", "--explain", "--seq", "512", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "--explain: B=1 H=4 Q_LEN=KV_LEN=512 D=64 bfloat16" in out
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["forward", "backward", "decode"]


@pytest.mark.skipif(not _offline_compile_available(),
                    reason="needs a Triton of hopper_common.GLUON_COMPILES_ON with its ptxas (offline sm_90 compile)")
def test_causal_kernels_compile_for_sm_90_offline():
    """The rendered causal dK/dV and dQ kernels through Triton's whole pipeline for sm_90, in a
    process of its own without TRITON_INTERPRET; about 15 s."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = "import test_hopper_backward; test_hopper_backward.compile_causal_offline()"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 6


def compile_causal_offline():
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    kernel, _ = family("causal")
    # dK/dV with dQ added by the copy engine ([Note] dQ in the dK/dV kernel: turns at head dim 64,
    # each consumer's columns at 128) and without, then dQ.
    # The deterministic form of each fused one adds in order ([Note] Ordered dQ additions).
    for params, D, block_m, fused, ordered in (
            (HOPPER_BACKWARD_DKDV, 64, 64, True, False), (HOPPER_BACKWARD_DKDV, 64, 64, False, False),
            (HOPPER_BACKWARD_DQ, 64, 128, None, None), (HOPPER_BACKWARD_DKDV, 128, 64, True, False),
            (HOPPER_BACKWARD_DKDV, 64, 64, True, True), (HOPPER_BACKWARD_DKDV, 128, 64, True, True)):
        rows = torch.empty(2 * L, D, dtype=torch.bfloat16)
        descriptor = {r: TensorDescriptor(rows, [2 * L, D], [D, 1], [r, D],
                                          gl.NVMMASharedLayout.get_default_for([r, D], gl.bfloat16)) for r in (64, 128)}
        sums = TensorDescriptor(torch.empty(2 * L, D), [2 * L, D], [D, 1], [64, hopper_backward.DQ_BOX_COLUMNS],
                                hopper_backward._dq_acc_layout())
        stages = (hopper_backward.DKDV_STAGES if params is HOPPER_BACKWARD_DKDV else hopper_backward.DQ_STAGES)[D]
        constexprs = dict(SPARSE_Z=1, SPARSE_HQ=1, GQA_GROUP=1, HEAD_DIM=D, SPARSE_Q_BLOCK_SIZE=128,
                          SPARSE_KV_BLOCK_SIZE=128, BLOCK_M=block_m, BLOCK_N=128, STAGES=stages,
                          CONSUMER_REGS=240, HAS_SCORE_MOD=False, SCALE_FIRST=False,
                          HAS_PARTIAL_BLOCKS=True, HAS_FULL_BLOCKS=True)
        if fused is not None:
            constexprs.update(FUSED_DQ=fused, ORDERED_DQ=ordered,
                              RESIDENT_IN_REGISTERS=hopper_common.resident_in_registers("dkdv", D))
        signature = {}
        for name in params.names():
            if name in constexprs:
                signature[name] = "constexpr"
            elif name == "DQ_ACC":
                signature[name] = mangle_type(sums if fused else descriptor[64])
            elif name in ("Q", "DO", "DQ", "DK", "DV", "K", "V"):
                signature[name] = mangle_type(descriptor[128 if name in ("K", "V") else 64])
            elif name in ("LSE", "DELTA"):
                signature[name] = "*fp32"
            elif name.endswith(("NUM_BLKS", "_IDX", "_TURNS", "_ADDED", "_FIRST")):
                signature[name] = "*i32"
            else:
                signature[name] = "fp32" if name == "SM_SCALE" else "i32"
        compiled = triton.compile(GluonASTSource(kernel.compiled(None).kernel(params), signature, constexprs, {}),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        assert len(re.findall(r"wgmma\.mma_async", compiled.asm["ptx"])) > 0
        assert compiled.metadata.shared <= 227 * 1024
        assert ("cp.reduce.async.bulk.tensor" in compiled.asm["ptx"]) == bool(fused)
        if fused:
            # The copy engine's box is the box the template adds by: a smaller one would add part of
            # each tile ([Note] The float32 dQ tile in shared memory). Both consumers' code adds a
            # 64-column tile, one box at a time.
            boxes = [meta["block_size"] for meta in compiled.metadata.tensordesc_meta if meta["elem_size"] == 4]
            assert boxes == [[64, hopper_backward.DQ_BOX_COLUMNS]]
            # The ordered form's writer warp adds for both consumers: both halves at 128, one tile at 64.
            adds = (2 if not ordered or D == 128 else 1) * 64 // hopper_backward.DQ_BOX_COLUMNS
            assert compiled.asm["ptx"].count("cp.reduce.async.bulk.tensor") == adds
        # The ordered form waits for its additions to land in memory, not only to be read (.read).
        waits = re.findall(r"cp\.async\.bulk\.wait_group(\.read)?\s", compiled.asm["ptx"])
        assert ("" in waits) == bool(ordered)
        assert ("ld.acquire.gpu" in compiled.asm["ptx"]) == bool(ordered)
        print("compiled")


def test_which_calls_add_dq_in_the_dkdv_kernel(monkeypatch):
    # [Note] dQ in the dK/dV kernel: head dims 64 and 128, whatever the mods; deterministic calls in a
    # fixed order ([Note] Ordered dQ additions) where the mask's rows visit every key block and every
    # program of a pair fits on the GPU at once, the two kernels otherwise.
    def form(D, deterministic, alike=True, S=L):
        return hopper_backward.dq_form(bhnd(D=D), bhnd(D=D, N=S), deterministic, alike)

    assert form(64, False) == form(128, False) == form(64, False, alike=False) == (True, False)
    assert form(64, True) == form(128, True) == (True, True)
    assert form(64, True, alike=False) == form(128, True, alike=False) == (False, False)
    assert form(96, False) == form(256, True) == (False, False)
    monkeypatch.setattr(hopper_backward, "sm_count", lambda device: 4)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert form(64, True, S=4 * 128) == (True, True)
    assert form(64, True, S=5 * 128) == (False, False)  # five programs a pair on four SMs: two kernels
    assert form(64, False, S=5 * 128) == (True, False)
    monkeypatch.setattr(hopper_backward, "ORDERS_DQ", "always")
    assert form(64, True, alike=False, S=4 * 128) == (True, True)
    monkeypatch.setattr(hopper_backward, "ORDERS_DQ", "never")
    assert form(128, True, S=4 * 128) == (False, False)


@pytest.mark.parametrize("variant", ["noop", "causal", "document_mask", "prefix_lm", "sliding_window"])
def test_dq_turns_follow_the_walks(variant):
    # [Note] Ordered dQ additions: each query block's additions go in the order the rotated walks
    # reach it (step, then key block), every listed entry has its own turn, and walks that begin at
    # the same query block start apart.
    B, H, N = 2, 3, 2048
    mask_mod = CATALOGUE[variant].build(B, H, N, N, "cpu")[1] or (lambda b, h, q_idx, kv_idx: q_idx >= 0)
    bm = create_block_mask(mask_mod, B, H, N, N, device="cpu")
    bwd, turns = backward_tables(bm), dq_turns(bm)
    lists = [(bwd.q_num_blocks, bwd.q_indices, turns.q_turns)]
    if bwd.full_q_indices is not bwd.q_indices:
        lists.append((bwd.full_q_num_blocks, bwd.full_q_indices, turns.full_q_turns))
    for z in range(B):
        for h in range(H):
            arrivals, begins = {}, []
            for c in range(bwd.q_num_blocks.shape[2]):
                walk = [(ix[z, h, c, j].item(), tn[z, h, c, j].item()) for num, ix, tn in lists
                        for j in range(num[z, h, c].item())]
                first = turns.walk_first[z, h, c].item()
                assert 0 <= first < max(len(walk), 1)
                if walk:
                    assert first == sum(b == walk[0][0] for b in begins) % len(walk)
                    begins.append(walk[0][0])
                for position, (block, turn) in enumerate(walk):
                    arrivals.setdefault(block, []).append(((position - first) % len(walk), c, turn))
            for block, seen in arrivals.items():
                assert [turn for _, _, turn in sorted(seen)] == list(range(len(seen))), (variant, z, h, block)


def test_dq_turns_follow_tables_changed_in_place():
    # The turns are kept on the mask per table content ([Note] Derived data in masks/block_mask.py):
    # the same mask object whose tables are overwritten with another mask's gets that mask's turns.
    N = 1024
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, 1, 2, N, N, device="cpu")
    other = create_block_mask(causal, 1, 2, N, N, device="cpu")
    before = dq_turns(bm)
    assert before.walk_first.any()  # every walk begins at query block 0: they start apart
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        getattr(bm, name).copy_(getattr(other, name))
    after, expected = dq_turns(bm), dq_turns(other)
    for mine, theirs in zip(after, expected):
        assert torch.equal(mine, theirs)
    assert not after.walk_first.any()  # causal walks begin at their own diagonal blocks


def test_a_plan_is_made_once_and_kept(monkeypatch):
    # The launch path without a GPU: _launch stands in for the kernels; the first call plans and
    # keeps the plan, the second reuses it, a mask of other content gets its own. ALiBi (a score_mod
    # and a causal mask) at head dim 64 adds dQ in the dK/dV kernel.
    kernel, instance = family("alibi")
    q = bhnd()
    monkeypatch.setattr(hopper_backward, "problem_reason", lambda *args: None)
    launched = []

    def fake_launch(plan, *args):
        launched.append(plan)
        return "grads"

    monkeypatch.setattr(kernel, "_launch", fake_launch)
    bm = instance.block_mask(1, 2, L, L, "cpu")
    before = hopper_backward.launches
    for _ in range(2):
        assert kernel(q, q, q, q, torch.zeros(1, 2, L), q, None, bm, 0.125, [], []) == "grads"
    assert launched[0] is launched[1] and len(kernel._plans) == 1
    assert hopper_backward.launches == before + 2 and kernel.last_plan is launched[0]
    steps = launched[0].steps  # head dim 64: dQ is added in the dK/dV kernel, no dQ kernel
    assert steps["dkdv"].grid == (L // 128, 2, 1) and "dq" not in steps and steps["dkdv"].constexprs["FUSED_DQ"]
    assert steps["dkdv"].constexprs["BLOCK_M"] == 64
    # [Note] Resident tiles in registers (kernels/hopper/common.py): K and V at head dim 64; the dQ kernel has no such flag.
    assert steps["dkdv"].constexprs["RESIDENT_IN_REGISTERS"]
    monkeypatch.setattr(hopper_backward, "ORDERS_DQ", "always")
    kernel(q, q, q, q, torch.zeros(1, 2, L), q, None, bm, 0.125, [], [], deterministic=True)
    steps = kernel.last_plan.steps  # a deterministic call: dQ in order ([Note] Ordered dQ additions)
    assert len(kernel._plans) == 2 and "dq" not in steps and steps["dkdv"].constexprs["ORDERED_DQ"]
    monkeypatch.setattr(hopper_backward, "ORDERS_DQ", "rows alike")
    kernel(q, q, q, q, torch.zeros(1, 2, L), q, None, bm, 0.125, [], [], deterministic=True)
    steps = kernel.last_plan.steps  # a causal mask's rows differ: the two kernels, each row one writer
    assert len(kernel._plans) == 3 and not steps["dkdv"].constexprs["FUSED_DQ"]
    assert steps["dq"].grid == (L // 128, 2, 1) and steps["dq"].constexprs["BLOCK_M"] == 128
    assert steps["dkdv"].constexprs["RESIDENT_IN_REGISTERS"] and "RESIDENT_IN_REGISTERS" not in steps["dq"].constexprs
    window = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 64), None, None, L, L, device="cpu")
    kernel(q, q, q, q, torch.zeros(1, 2, L), q, None, window, 0.125, [], [])
    assert len(kernel._plans) == 4
    wide = bhnd(D=128)  # head dim 128: K and V stay in shared memory (in registers they spilled)
    kernel(wide, wide, wide, wide, torch.zeros(1, 2, L), wide, None, bm, 0.125, [], [])
    assert not kernel.last_plan.steps["dkdv"].constexprs["RESIDENT_IN_REGISTERS"]


class _Recorder:
    """Stands in for a Gluon kernel: records each launch's grid, arguments and constexprs."""

    def __init__(self, params, calls):
        self.params, self.calls = params, calls

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.calls.append((self.params, grid, args, constexprs))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                    reason="the preprocess kernel runs in Triton's interpreter on CPU tensors")
def test_the_launcher_packs_what_the_kernels_declare(monkeypatch):
    # The real launcher on CPU tensors: the portable preprocess runs (interpreter), the two Gluon
    # kernels are recorded: as many arguments as their declarations take, their plan's constexprs,
    # and the 2-D views of [B, H, N, D] storage.
    from flexattn.kernels.family import CompiledKernel

    calls = []
    real_kernel = CompiledKernel.kernel
    monkeypatch.setattr(CompiledKernel, "kernel", lambda self, params: (
        real_kernel(self, params) if params is BACKWARD_PREPROCESS else _Recorder(params, calls)))
    monkeypatch.setattr(hopper_backward, "problem_reason", lambda *args: None)
    kernel, instance = family("alibi")
    B, H, E = 2, 2, 64
    q, k, v, out, grad_out = (torch.randn(B, H, L, E, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(B, H, L)
    bm = instance.block_mask(B, H, L, L, "cpu")
    score_captured = trace_mod(instance.score_mod, "score_mod")[1]  # ALiBi's slopes
    assert len(score_captured) == 1
    # Head dim 64 adds dQ in the dK/dV kernel, a deterministic call in a fixed order ([Note] Ordered dQ
    # additions); without that order, a deterministic call runs the dQ kernel instead.
    for deterministic, ordered in ((False, "always"), (True, "always"), (True, "never")):
        monkeypatch.setattr(hopper_backward, "ORDERS_DQ", ordered)
        dq, dk, dv, captured = kernel(q, k, v, out, lse, grad_out, None, bm, 0.125, score_captured, [],
                                      deterministic=deterministic)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and captured == [None]
        assert dq.dtype == q.dtype
    fused, in_order, two_pass = [plan for plan in kernel._plans.values()]
    assert [(params, grid) for params, grid, _, _ in calls] == [
        (HOPPER_BACKWARD_DKDV, fused.steps["dkdv"].grid), (HOPPER_BACKWARD_DKDV, in_order.steps["dkdv"].grid),
        (HOPPER_BACKWARD_DKDV, two_pass.steps["dkdv"].grid), (HOPPER_BACKWARD_DQ, two_pass.steps["dq"].grid)]
    # The ordered call's turns (kernels/tables.py DqTurns) and a zeroed count per 64 rows and 64 columns.
    names = HOPPER_BACKWARD_DKDV.names()
    ordered_args = calls[1][2]
    turns = dq_turns(bm)
    assert ordered_args[names.index("Q_TURNS")] is turns.q_turns
    assert ordered_args[names.index("WALK_FIRST")] is turns.walk_first
    added = ordered_args[names.index("DQ_ADDED")]
    assert added.dtype == torch.int32 and added.numel() == 2 * B * H * L // 64 and not added.any()
    assert calls[1][3]["ORDERED_DQ"] and not calls[0][3]["ORDERED_DQ"]
    assert ordered_args[names.index("TAIL_PAIRS")] == 1  # the grid's order
    sums = calls[0][2][HOPPER_BACKWARD_DKDV.names().index("DQ_ACC")]
    # 64-row boxes of 32 columns under the 128-byte swizzle ([Note] The float32 dQ tile in shared memory).
    assert sums.shape == [B * H * L, E] and sums.block_shape == [64, 32] and sums.base.dtype == torch.float32
    assert sums.layout.swizzle_byte_width == 128
    assert calls[0][3]["FUSED_DQ"] and calls[1][3]["FUSED_DQ"] and not calls[2][3]["FUSED_DQ"]
    mods = len(kernel.compiled(None).spec.score_grad.kernel_params)  # the slopes and their stride
    for params, _, args, constexprs in calls:
        assert len(args) == params.argument_count(mods)
        params.check_constexprs(constexprs)
        by_name = dict(zip((n for g in params.runtime if g.kind != "mods" for n in g.expanded()), args))
        assert (by_name["row_qz"], by_name["row_qh"], by_name["col_qh"]) == (H * L, L, 0)
        assert by_name["Q_LEN"] == L and by_name["SM_SCALE"] == 0.125
