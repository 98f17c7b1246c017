"""Soft-cap's Hopper backward kernels compiled for sm_90 on the CPU, with the cap a kernel argument
and a literal: their SASS instruction counts side by side (issue 50's open soft-cap row).

    env -u TRITON_INTERPRET PYTHONPATH=. python -m benchmarks.softcap_sass

Needs a Triton that compiles Gluon offline (kernels/hopper/common.py GLUON_COMPILES_ON) with its
bundled ptxas and nvdisasm; no GPU. See docs/tracing.md, "Numbers" ([Note] Dividing by a number
argument in flexattn/lowering/ops.py).
"""
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type
import flexattn.kernels.hopper.backward as hopper_backward
import flexattn.kernels.hopper.common as hopper_common
from flexattn.codegen.params import HOPPER_BACKWARD_DKDV, HOPPER_BACKWARD_DQ
from flexattn.trace import trace_mod
import benchmarks.number_inputs as ni

L = 256
def compile_one(fn, params, D, block_m, fused):
    traced = trace_mod(fn, "score_mod")[0]
    kernel = hopper_backward.HopperBackwardKernel(traced, None, tanh_approx=True)
    rows = torch.empty(2 * L, D, dtype=torch.bfloat16)
    descriptor = {r: TensorDescriptor(rows, [2 * L, D], [D, 1], [r, D],
                                      gl.NVMMASharedLayout.get_default_for([r, D], gl.bfloat16)) for r in (64, 128)}
    sums = TensorDescriptor(torch.empty(2 * L, D), [2 * L, D], [D, 1], [64, hopper_backward.DQ_BOX_COLUMNS],
                            hopper_backward._dq_acc_layout())
    stages = (hopper_backward.DKDV_STAGES if params is HOPPER_BACKWARD_DKDV else hopper_backward.DQ_STAGES)[D]
    constexprs = dict(SPARSE_Z=1, SPARSE_HQ=1, GQA_GROUP=1, HEAD_DIM=D, SPARSE_Q_BLOCK_SIZE=128,
                      SPARSE_KV_BLOCK_SIZE=128, BLOCK_M=block_m, BLOCK_N=128, STAGES=stages,
                      CONSUMER_REGS=240, HAS_SCORE_MOD=True, SCALE_FIRST=False,
                      HAS_PARTIAL_BLOCKS=False, HAS_FULL_BLOCKS=True)
    if fused is not None:
        constexprs.update(FUSED_DQ=fused, ORDERED_DQ=False,
                          RESIDENT_IN_REGISTERS=hopper_common.resident_in_registers("dkdv", D))
    jit = kernel.compiled(None).kernel(params)
    signature = {}
    for name in jit.arg_names:
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
            signature[name] = "fp32" if name in ("SM_SCALE", "sm_cap") else "i32"
    compiled = triton.compile(GluonASTSource(jit, signature, constexprs, {}),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    dis = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    sass = subprocess.run([dis, "-c", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(2)] += 1
    return ops, compiled.metadata

rt = ni.runtime_mods(1024, 2048, 20.0)["softcap"][0]
lt = ni.literal_mods(1024, 2048, 20.0)["softcap"][0]
for label, params, D, bm, fused in (("dkdv fused d128", HOPPER_BACKWARD_DKDV, 128, 64, True),
                                    ("dq d128", HOPPER_BACKWARD_DQ, 128, 128, None)):
    res = {}
    for form, fn in (("runtime", rt), ("literal", lt)):
        try:
            res[form] = compile_one(fn, params, D, bm, fused)[0]
        except Exception as e:
            print(label, form, "failed:", repr(e)[:400]); res[form] = collections.Counter()
    keys = sorted({k for c in res.values() for k in c if k.startswith(("MUFU", "FMUL", "FFMA", "FADD", "FSETP", "BRA", "CALL", "HMMA", "WGMMA"))
                   or "DIV" in k or "RCP" in k})
    print(label, "total", {f: sum(c.values()) for f, c in res.items()})
    for k in keys:
        print(f"  {k:24} runtime {res['runtime'][k]:6} literal {res['literal'][k]:6}")
