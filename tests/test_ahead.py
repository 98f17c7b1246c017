"""Kernels compiled ahead (kernels/ahead.py, kernels/compile_worker.py) without a GPU: a recorded
launch runs nothing and keeps nothing, a worker process compiles it for sm_90 into Triton's cache,
and the compile the real launch then does finds it there (the same cache key). Triton's driver is
replaced by a stand-in that names an H100 as the target, so all of it runs on a CPU machine.

The numbers the ahead-compiled kernels give are the GPU tests' (tests/test_gpu_compile.py); the
time they save is measured by ``python -m flexattn.bench --mode model --cold``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flexattn.dispatch as dispatch
from flexattn import create_block_mask
from flexattn.kernels import ahead
from flexattn.kernels.launch import empty_output, zeroed_output

from test_hopper_forward import _offline_compile_available

ROOT = Path(__file__).resolve().parent.parent


def test_worker_count_follows_the_environment(monkeypatch):
    monkeypatch.setenv("FLEXATTN_COMPILE_WORKERS", "3")
    assert ahead.worker_count() == 3
    monkeypatch.setenv("FLEXATTN_COMPILE_WORKERS", "0")
    assert ahead.worker_count() == 0 and not ahead.enabled()
    monkeypatch.delenv("FLEXATTN_COMPILE_WORKERS")
    assert 1 <= ahead.worker_count() <= 4


def test_outputs_made_while_recording_are_meta_tensors():
    with ahead.compiling_ahead():
        assert ahead.recording()
        assert empty_output((2, 3), torch.float32, "cpu").device.type == "meta"
        assert zeroed_output((2, 3), torch.float32, "cpu").device.type == "meta"
    assert not ahead.recording()
    assert empty_output((2, 3), torch.float32, "cpu").device.type == "cpu"


def test_recording_is_this_threads_only():
    """Autograd runs backwards in threads of its own: while one thread records, another one's
    launches and outputs are real."""
    import threading

    seen = {}

    def other():
        seen["recording"] = ahead.recording()
        seen["device"] = empty_output((2,), torch.float32, "cpu").device.type

    with ahead.compiling_ahead():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert ahead.recording()
    assert seen == {"recording": False, "device": "cpu"}


def test_compile_ahead_leaves_cpu_calls_alone():
    """Only CUDA calls on the Triton backend, outside the interpreter, record anything."""
    q = torch.randn(1, 2, 128, 16)
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 128, 128, device="cpu")
    call = dispatch.Call("TRITON", mask, 0.25, None, None, [], {}, torch.int32)
    before = len(dispatch._AHEAD_DONE)
    dispatch.compile_ahead(call, q, q, q, [], forward=True, backward=True)
    assert len(dispatch._AHEAD_DONE) == before and not ahead.pending


@pytest.mark.skipif(not _offline_compile_available(),
                    reason="needs a Triton of hopper_common.GLUON_COMPILES_ON with its ptxas (offline sm_90 compile)")
def test_recorded_launches_are_compiled_by_a_worker_into_the_cache_the_real_launch_reads(tmp_path):
    """In a process of its own without TRITON_INTERPRET (recording asks Triton's JIT, which the
    interpreter replaces); about 15 s with one worker."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(tmp_path / "triton"), FLEXATTN_CACHE_DIR=str(tmp_path / "flexattn"),
               FLEXATTN_COMPILE_WORKERS="1")
    code = "import test_ahead; test_ahead.record_compile_and_hit()"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "hit" in done.stdout


def record_compile_and_hit():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    import flexattn.kernels.hopper.backward as hopper_backward
    import flexattn.kernels.hopper.forward as hopper_forward
    from flexattn.trace import trace_mod

    class H100:  # what Triton's JIT asks of its driver, short of running anything
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(H100())
    cache = Path(triton.knobs.cache.dir)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    B, H, L, D = 1, 2, 512, 64
    block_mask = create_block_mask(causal, None, None, L, L, device="cpu")
    traced = trace_mod(causal, "mask_mod")[0]
    # Causal, deterministic, in the two-kernel form (ORDERS_DQ off): the dK/dV and dQ kernels; no mod
    # at all: dQ added in the dK/dV kernel (hopper_backward.dq_form).
    hopper_backward.ORDERS_DQ = "never"  # this process is the test's own
    families = [(hopper_forward.HopperForwardKernel(None, mask, tanh_approx=True),
                 hopper_backward.HopperBackwardKernel(None, mask, tanh_approx=True)) for mask in (traced, None)]
    q = torch.empty(B, H, L, D, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(B, H, L, device="meta")
    launches = (hopper_forward.launches, hopper_backward.launches)

    def run_all():
        for forward, backward in families:
            forward(q, q, q, block_mask, 0.125, [], [], need_lse=True)
            backward(q, q, q, q, lse, q, None, block_mask, 0.125, [], [], deterministic=backward.has_mask_mod)

    # 1. Recorded: nothing compiled or launched here, no plan kept, no launch counted.
    submitted, submit = [], ahead._submit
    ahead._submit = lambda jit_fn, specialization: (submitted.append((jit_fn, specialization)),
                                                    submit(jit_fn, specialization))
    with ahead.compiling_ahead():
        run_all()
    ahead._submit = submit
    recorded = sorted(entry[0].fn.__name__ for entry in ahead.pending.values())
    assert recorded.count("flex_attention_backward_preprocess") == 2, recorded
    assert recorded.count("flex_attention_forward_sm90") == 2 and recorded.count("flex_attention_backward_dkdv_sm90") == 2
    assert recorded.count("flex_attention_backward_dq_sm90") == 1  # the fused form has no dQ kernel
    assert all(not f._plans and not b._plans and f.last_plan is None for f, b in families)
    assert (hopper_forward.launches, hopper_backward.launches) == launches
    assert all(not entry[0].device_caches[0][0] for entry in ahead.pending.values())  # nothing compiled here

    # 2. The worker compiles them; each answered kernel leaves `pending`.
    for entry in list(ahead.pending.values()):
        ahead.wait_for(entry[0])
    assert not ahead.pending
    compiled = set(cache.iterdir())
    assert len(compiled) >= 6, compiled  # two preprocess kernels of the same source share an entry

    # 3. The same launches, compiled here as a real launch would: every one is found in the cache.
    seen = []

    def compile_here(jit_fn, grid, args, constexprs):
        seen.append(jit_fn.fn.__name__)
        assert jit_fn.run(*args, grid=grid, warmup=True, **constexprs) is not None

    import flexattn.kernels.backward as portable_backward  # the preprocess launches from there

    for module in (hopper_forward, hopper_backward, portable_backward):
        module.launch = compile_here
    run_all()
    assert sorted(seen) == recorded, seen
    assert set(cache.iterdir()) == compiled, "a kernel compiled ahead was compiled again"

    # 4. A later process with these caches sends none of those jobs again ([Note] Kernels answered
    # before): the record on disk, read afresh, holds every one of them.
    ahead._answered = None
    ahead._sent.clear()
    workers_before = list(ahead._workers)
    for jit_fn, specialization in submitted:
        ahead._submit(jit_fn, specialization)
    assert not ahead.pending, "a kernel answered before was sent to a worker again"
    assert len(ahead._answered_before()) == len(submitted) and ahead._workers == workers_before

    # 5. A job the worker cannot do (a specialization of another kernel) is answered, not waited on.
    jit_fn = families[0][0].compiled(None).kernel(hopper_forward.HOPPER_FORWARD)
    ahead._submit(jit_fn, '{"name": "elsewhere"}')
    ahead.wait_for(jit_fn)
    assert not ahead.pending
    print("hit")
