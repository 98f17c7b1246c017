"""kernel_options as torch spells them, the CHECK_INDICES debug mode, and what a failed Triton import says."""

import importlib
import os
import subprocess
import sys
import warnings

import pytest
import torch
from numerics import rel_err

import flexattn.kernels.family as family
import flexattn.kernels.forward as rt
import flexattn.request as front_door
from flexattn import create_block_mask, flex_attention
from flexattn.errors import BackendUnavailableError, InvalidInputError
from flexattn.reference import reference_attention
from flexattn.variants import causal_mask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="Triton on CPU tensors needs TRITON_INTERPRET=1"
)
TRITON = {"BACKEND": "TRITON"}


def qkv(B=1, H=2, L=128, S=128, E=32):
    return torch.randn(B, H, L, E), torch.randn(B, H, S, E), torch.randn(B, H, S, E)


def reference(q, k, v, **mods):
    return reference_attention(q.double(), k.double(), v.double(), **mods)[0]


# ------------------------------------------------------------------------------ torch's kernel_options


@needs_interpreter
def test_torch_keys_are_accepted_fwd_keys_honoured_and_ignored_ones_named_once(monkeypatch, one_thread):
    monkeypatch.setattr(front_door, "_reported_ignored", set())
    # Only this test's kernel in the table: earlier tests built causal kernels of their own.
    monkeypatch.setattr(rt, "_kernels", type(rt._kernels)())
    q, k, v = qkv()
    bm = create_block_mask(causal_mask, 1, 1, 128, 128, device="cpu", BLOCK_SIZE=64)
    options = {**TRITON, "PRESCALE_QK": True, "ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True,
               "bwd_BLOCK_M": 32, "WRITE_DQ": False, "BLOCK_M": 64, "fwd_BLOCK_M": 32, "fwd_num_warps": 2}
    with pytest.warns(UserWarning, match="ignored by flexattn") as caught:
        out = flex_attention(q, k, v, block_mask=bm, kernel_options=options)
    (warning,) = [w for w in caught if "ignored by flexattn" in str(w.message)]
    for key in ("PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "bwd_BLOCK_M", "WRITE_DQ"):
        assert key in str(warning.message)
    assert "bwd_BLOCK_M (not a backward option" in str(warning.message)
    assert "fwd_BLOCK_M" not in str(warning.message)
    assert rel_err(out, reference(q, k, v, mask_mod=causal_mask)) < 2e-5
    (kernel,) = [kern for kern in rt._kernels.values() if kern.last_plan and kern.has_mask_mod
                 and kern.mask.name == "causal_mask" and not kern.has_score_mod]
    # fwd_BLOCK_M wins over BLOCK_M (the interpreter's default tile would be 64 here).
    constexprs = kernel.last_plan.constexprs("forward")
    assert constexprs["BLOCK_M"] == 32 and constexprs["num_warps"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process: no second warning
        flex_attention(q, k, v, block_mask=bm, kernel_options=options)


def test_unknown_keys_stay_errors():
    q, k, v = qkv()
    for bad in ({"BLOCK_SIZE": 64}, {"fwd_NOT_AN_OPTION": 1}, {"bwd_whatever": 2}):
        with pytest.raises(InvalidInputError, match="unknown kernel_options"):
            flex_attention(q, k, v, kernel_options=bad)


def test_prefixed_options_on_the_pytorch_backend(monkeypatch):
    monkeypatch.setattr(front_door, "_reported_ignored", set())
    q, k, v = qkv()
    with pytest.warns(UserWarning, match=r"bwd_BLOCK_N \(not a backward option"):
        out = flex_attention(q, k, v, kernel_options={"BACKEND": "PYTORCH", "fwd_BLOCK_N": 32, "bwd_BLOCK_N": 16,
                                                      "bwd_BLOCK_N2": 16})
    assert rel_err(out, reference(q, k, v)) < 1e-5


# ------------------------------------------------------------------------------ CHECK_INDICES


def _rel_bias(L):
    table = torch.randn(2 * L)  # covers q_idx - kv_idx + L for q_idx, kv_idx < L

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + L]

    return rel_bias


@pytest.mark.parametrize("backend", ["PYTORCH", pytest.param("TRITON", marks=needs_interpreter)])
def test_check_indices_names_the_mod_tensor_index_and_position(backend, one_thread):
    q, k, v = qkv(L=96, S=320)
    built_for = _rel_bias(96)  # but the keys are longer: q_idx - kv_idx + 96 goes down to -223 ...
    doc = torch.zeros(128, dtype=torch.int32)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]  # ... and kv_idx >= 128 reads past the end of doc

    with pytest.raises(InvalidInputError) as err:
        flex_attention(q, k, v, score_mod=built_for, kernel_options={"BACKEND": backend, "CHECK_INDICES": True})
    # Indices down to -192 wrap, as in torch; -193 (first at q_idx=0, kv_idx=289) is out of range.
    message = str(err.value)
    assert "score_mod 'rel_bias' reads table at index -193 in dim 0 (size 192), outside [-192, 192)" in message
    assert "at b=0, h=0, q_idx=0, kv_idx=289" in message and "test_kernel_options.py" in message
    assert "clamp" in message
    bm = create_block_mask(causal_mask, 1, 1, 96, 320, device="cpu")
    with pytest.raises(InvalidInputError, match=r"mask_mod 'same_doc' reads doc at index 128 in dim 0 \(size 128\)"):
        flex_attention(q, k, v, block_mask=_with_mask_mod(bm, same_doc), kernel_options={"CHECK_INDICES": True})


def _with_mask_mod(bm, mask_mod):
    bm.mask_mod = mask_mod
    return bm


def test_check_indices_passes_mods_that_stay_in_range_and_wrap_negatives(one_thread):
    L = 64
    rel = torch.randn(L)

    def wrapped(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx]  # -63..63: negative indices wrap, as in torch

    q, k, v = qkv(L=L, S=L)
    out = flex_attention(q, k, v, score_mod=wrapped, kernel_options={"CHECK_INDICES": True})
    assert rel_err(out, reference(q, k, v, score_mod=wrapped)) < 1e-5


def test_check_indices_from_the_environment(tmp_path):
    child = (
        "import torch, flexattn\n"
        "table = torch.randn(8)\n"
        "def bias(score, b, h, q_idx, kv_idx):\n"
        "    return score + table[q_idx]\n"
        "q = torch.randn(1, 1, 16, 8)\n"
        "try:\n"
        "    flexattn.flex_attention(q, q, q, score_mod=bias)\n"
        "except flexattn.errors.InvalidInputError as err:\n"
        "    print('raised:', err)\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "FLEXATTN_CHECK_INDICES": "1"}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert "raised: CHECK_INDICES: score_mod 'bias' reads table at index 8" in done.stdout, done.stderr[-2000:]


# ------------------------------------------------------------------------------ a failed Triton import


def test_failed_triton_import_names_the_missing_module(monkeypatch):
    real = importlib.import_module

    def import_module(name, *args):
        if name == "triton":
            raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", import_module)
    monkeypatch.setattr(rt, "_kernels", type(rt._kernels)())
    failed = r"triton is installed but importing it failed.*'numpy'.*pip install numpy"
    with pytest.raises(BackendUnavailableError, match=failed):
        rt.forward_kernel(None, None)

    def no_triton(name, *args):
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    monkeypatch.setattr(importlib, "import_module", no_triton)
    with pytest.raises(BackendUnavailableError, match=r"needs the 'triton' package \(pip install triton\)"):
        rt.forward_kernel(None, None)


def test_interpreter_without_numpy_says_so():
    child = (
        "import sys\n"
        "sys.modules['numpy'] = None  # as in a fresh virtualenv: Triton's interpreter cannot import it\n"
        "import torch, flexattn\n"
        "q = torch.randn(1, 1, 16, 16)\n"
        "try:\n"
        "    flexattn.flex_attention(q, q, q, kernel_options={'BACKEND': 'TRITON'})\n"
        "except flexattn.errors.BackendUnavailableError as err:\n"
        "    print('raised:', err)\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert "raised: triton is installed but importing it failed" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "pip install numpy" in done.stdout


# ---- [Note] Tiles the compiler made costly: the plan after the first compiled launch ----

def _default_plan(BLOCK_M=64, BLOCK_N=128, stages=3, L=1000):
    from flexattn.codegen.params import FORWARD

    constexprs = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_stages=stages, NUM_STAGES=stages, EVEN_M=L % BLOCK_M == 0,
                      QK_HEAD_DIM_P2=64, V_HEAD_DIM_P2=64, num_warps=4)
    return family.Plan(None, {"forward": family.Step(FORWARD, (-(-L // BLOCK_M), 16, 4), constexprs)}, (L, L), 2,
                       check_compiled=True)


def _compiled(spills=0, shared=0):
    from types import SimpleNamespace

    return SimpleNamespace(n_spills=spills, metadata=SimpleNamespace(shared=shared))


def _after(plan, kernel, has_mods=True):
    forward = rt.ForwardKernel(object() if has_mods else None, None, tanh_approx=False)
    return forward._plan_after_compile(plan, {"forward": kernel})


def test_a_spilling_default_tile_gets_half_the_key_tile_then_half_the_query_tile():
    plan = _default_plan()
    tiles = 2 * (64 * 64 + 3 * 128 * 128)  # within the staged tiles: only the spills count here
    after = _after(plan, _compiled(spills=132, shared=tiles))
    assert (after.constexprs("forward")["BLOCK_M"], after.constexprs("forward")["BLOCK_N"]) == (64, 64)
    assert after.check_compiled and after.steps["forward"].grid == plan.steps["forward"].grid
    assert plan.constexprs("forward")["BLOCK_N"] == 128
    after = _after(_default_plan(BLOCK_N=32), _compiled(spills=132))
    assert (after.constexprs("forward")["BLOCK_M"], after.constexprs("forward")["BLOCK_N"]) == (32, 32)
    assert after.steps["forward"].grid == (32, 16, 4) and after.constexprs("forward")["EVEN_M"] is False
    # Nothing smaller than 32 x 32: the plan is kept and marked as seen.
    smallest = _default_plan(BLOCK_M=32, BLOCK_N=32)
    after = _after(smallest, _compiled(spills=500))
    assert after.constexprs("forward") == smallest.constexprs("forward") and not after.check_compiled


def test_a_few_spilled_bytes_keep_the_tile():
    # The H100 census: 2 to 62 bytes at d=128 cost less than half the key tile does.
    after = _after(_default_plan(), _compiled(spills=family.SPILL_LIMIT_BYTES))
    assert after.constexprs("forward")["BLOCK_N"] == 128 and not after.check_compiled


def test_staged_gathers_cost_a_pipeline_stage_for_mods_only():
    plan = _default_plan(BLOCK_M=64, BLOCK_N=64, stages=3)
    tiles = family._tile_bytes(plan.constexprs("forward"), rt.ForwardKernel.TILE_ROLES["forward"], 2)
    assert tiles == 2 * (64 * 64 + 3 * 64 * 128)  # the query tile once, K and V tiles per stage
    staged = _compiled(shared=tiles + family.STAGED_GATHER_BYTES)
    after = _after(plan, staged)
    assert after.constexprs("forward")["num_stages"] == after.constexprs("forward")["NUM_STAGES"] == 2
    assert after.check_compiled
    # Without mods the extra memory is the kernel's own (descriptors, the output tile): kept.
    assert not _after(plan, staged, has_mods=False).check_compiled
    # Within the tiles: kept.
    near = _compiled(shared=tiles + family.STAGED_GATHER_BYTES - 1)
    assert _after(plan, near).constexprs("forward")["num_stages"] == 3
    # One stage is the floor.
    one = _default_plan(stages=1)
    assert not _after(one, _compiled(shared=1 << 20)).check_compiled


@needs_interpreter
def test_the_interpreter_never_replans_after_compiling():
    q, k, v = qkv()
    flex_attention(q, k, v, block_mask=create_block_mask(causal_mask, None, None, 128, 128), kernel_options=TRITON)
    kernel = list(rt._kernels.values())[-1]
    assert kernel._plans and not any(plan.check_compiled for plan in kernel._plans.values())
