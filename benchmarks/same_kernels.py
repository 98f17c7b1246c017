"""Do two versions of flexattn generate the same kernels and compute the same bits?

A change meant to leave behaviour and speed alone (a refactor, a template tidied) is checked with it:
run each step once with the old checkout on PYTHONPATH and once with the new one, then diff. The
file runs on its own (``python path/to/same_kernels.py``), so the flexattn it measures is whichever
PYTHONPATH names::

    PYTHONPATH=OLD python benchmarks/same_kernels.py record old.rec.json     # CPU, Triton interpreter
    PYTHONPATH=OLD python benchmarks/same_kernels.py compile old.rec.json old.sass.json
    PYTHONPATH=NEW python ... (the same two steps for the new checkout)
    python benchmarks/same_kernels.py diff old.sass.json new.sass.json

    PYTHONPATH=OLD python benchmarks/same_kernels.py run old.gpu.json        # on a GPU
    PYTHONPATH=NEW python benchmarks/same_kernels.py run new.gpu.json
    python benchmarks/same_kernels.py diff old.gpu.json new.gpu.json

    PYTHONPATH=OLD python benchmarks/same_kernels.py time old.1.json         # on a GPU, alternately:
    PYTHONPATH=NEW python benchmarks/same_kernels.py time new.1.json         # old, new, old, new
    python benchmarks/same_kernels.py diff old.1.json,old.2.json new.1.json,new.2.json

* ``record`` runs every catalogue variant through the forward (with its backward) and the decode
  kernels at small sizes in Triton's interpreter, and records every launch: kernel name, source,
  argument types and constexprs.
* ``compile`` compiles each recorded kernel for sm_90 (no GPU needed) under GPU-like constexprs
  (pointer and tensor-descriptor loads, several tiles, warps and stages) and keeps a digest of its
  TTIR (locations stripped) and of its SASS (addresses stripped), with registers and shared memory.
* ``run`` runs every catalogue variant on the GPU at d=64 and d=128 (bf16, B2 H4, 1000 tokens, odd,
  so the boundary paths run): the forward with the LSE, the backward (dq, dk, dv and the gradients of
  learnable tensors) and a decoding step of 4 query rows. It keeps a digest of every output's bytes
  and, for every launch, the compiled kernel's registers, spilled bytes and shared memory.
  ``--shard I/N`` takes every N-th variant from the I-th, so several processes can share the
  compile time.
* ``time`` times flexattn alone on the paper benchmarks' cases (the seven paper variants at 16k
  tokens, d=64 and 128: the forward at K/V of 256 MiB, the backward at 128 MiB, as
  flexattn/bench/forward.py and backward.py size them; medians of CUDA-event timings) and on
  decoding steps (one query token, the shapes of flexattn/bench/decode.py, noop, ALiBi and
  soft-cap; the step captured in a CUDA graph and its replays timed, as flexattn/bench/decode.py does), and
  the host time of a call: decoding steps, and a small forward and backward (B1 H8, 1024 tokens,
  d=64, ALiBi + causal), whose kernels take less time than the host needs to launch them.
  ``--warm`` only runs each case once, so that several processes can compile the kernels in
  parallel before the timed rounds, which then run one at a time; ``--only host`` (or ``fwd``,
  ``bwd``, ``decode``) runs one kind of case.
* ``diff`` compares two such files (several, comma-separated, for the shards or rounds of one
  side). The gradients of learnable tensors are summed with float32 atomics, whose order is the
  hardware's: they are compared by relative error, everything else bit for bit. Timings are
  compared case by case: the ratio of the medians over the rounds, beside the spread between the
  rounds of each side.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

TORCH_TO_TRITON = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int32": "i32",
                   "int64": "i64", "bool": "i1", "int8": "i8", "uint8": "u8", "int16": "i16"}


def _spy_on_launches(record) -> None:
    """Wrap the ``launch`` each flexattn module imported (the direct launcher, in every layout so far),
    so that every kernel launch is passed to ``record(jit_fn, grid, args, constexprs, kernel)``."""
    for name, module in list(sys.modules.items()):
        launch = getattr(module, "launch", None) if name.startswith("flexattn") and module else None
        if launch is None or getattr(launch, "spied", False) or getattr(launch, "__name__", "") != "launch":
            continue

        def spy(jit_fn, grid, args, constexprs, _real=launch):
            kernel = _real(jit_fn, grid, args, constexprs)
            record(jit_fn, grid, args, constexprs, kernel)
            return kernel

        spy.spied, spy.__name__ = True, "launch"
        setattr(module, "launch", spy)


# ------------------------------------------------------------------------------------ record, compile


def record(out_path: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: @jit reads it then
    import torch

    import flexattn
    from flexattn.variants import CATALOGUE

    records, case = [], {}

    def keep(jit_fn, grid, args, constexprs, kernel):
        fn = getattr(jit_fn, "fn", jit_fn)
        types = []
        for a in args:
            if isinstance(a, torch.Tensor):
                types.append("*" + TORCH_TO_TRITON[str(a.dtype).replace("torch.", "")])
            elif isinstance(a, bool):
                types.append("i1")
            elif isinstance(a, int):
                types.append("i32" if -2**31 <= a < 2**31 else "i64")
            elif isinstance(a, float):
                types.append("fp32")
            else:
                raise TypeError(f"an argument of type {type(a).__name__}: not recorded")
        records.append(dict(case=dict(case), kernel=fn.__name__, source=open(fn.__code__.co_filename).read(),
                            types=types, constexprs=dict(constexprs)))

    torch.manual_seed(0)
    for name, variant in CATALOGUE.items():
        for length in (256, 200):  # a block multiple and not
            case.update(variant=name, L=length, part="train")
            inst = variant.make(1, 2, length, length, "cpu")
            q, k, v = (torch.randn(1, 2, length, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            mask = inst.block_mask(1, 2, length, length, "cpu")
            _spy_on_launches(keep)
            out = inst.attend(q, k, v, block_mask=mask, kernel_options={"BACKEND": "TRITON"})
            _spy_on_launches(keep)
            out.float().sum().backward()
            if variant.decode and not variant.square_only:
                case["part"] = "decode"
                with torch.no_grad():
                    step = flexattn.decode_block_mask(mask, length - 1, q_len=1) if mask is not None else None
                    _spy_on_launches(keep)
                    inst.attend(torch.randn(1, 2, 1, 32, dtype=torch.bfloat16), k.detach(), v.detach(),
                                block_mask=step, kernel_options={"BACKEND": "TRITON_DECODE"})
    with open(out_path, "w") as f:
        json.dump(records, f)
    print(f"{len(records)} launches recorded")


# GPU-like constexprs each recorded kernel is compiled with (the interpreter's own are not a GPU's).
GPU_CONSTEXPRS = {
    "flex_attention_forward": {
        "ptr_64x128_s3": dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=3, num_stages=3, num_warps=4, USE_TMA=False),
        "tma_128x64_s2": dict(BLOCK_M=128, BLOCK_N=64, NUM_STAGES=2, num_stages=2, num_warps=4, USE_TMA=True),
        "ptr_128x128_w8_max": dict(BLOCK_M=128, BLOCK_N=128, NUM_STAGES=3, num_stages=3, num_warps=8, USE_TMA=False,
                                   OUTPUT_MAX=True),
        # Descriptors built on the host (Q, K, V and OUT arrive as tensor descriptors), and Triton's
        # warp specialisation of the key loop (compiled only for kernels without mods, as launched).
        "host_64x32_s2": dict(BLOCK_M=64, BLOCK_N=32, NUM_STAGES=2, num_stages=2, num_warps=4, USE_TMA=True,
                              HOST_DESCRIPTORS=True),
        "host_64x128_s2": dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2, num_stages=2, num_warps=4, USE_TMA=True,
                               HOST_DESCRIPTORS=True),
        "ws_128x128_s2": dict(BLOCK_M=128, BLOCK_N=128, NUM_STAGES=2, num_stages=2, num_warps=4, USE_TMA=True,
                              WARP_SPECIALIZE=True),
    },
    "flex_attention_backward_dkdv": {
        "tma_64x64_s2": dict(BLOCK_M=64, BLOCK_N=64, NUM_STAGES=2, num_stages=2, num_warps=4, USE_TMA=True),
        "ptr_32x64_w8": dict(BLOCK_M=32, BLOCK_N=64, NUM_STAGES=2, num_stages=2, num_warps=8, USE_TMA=False),
    },
    "flex_attention_backward_dq": {
        "tma_64x64_s2": dict(BLOCK_M=64, BLOCK_N=64, NUM_STAGES=2, num_stages=2, num_warps=4, USE_TMA=True),
        "ptr_128x128_w8": dict(BLOCK_M=128, BLOCK_N=128, NUM_STAGES=2, num_stages=2, num_warps=8, USE_TMA=False),
    },
    "flex_attention_backward_preprocess": {"64": dict(BLOCK_M=64)},
    "flex_attention_decode_partial": {
        "128_s2": dict(BLOCK_N=128, NUM_STAGES=2, num_stages=2, num_warps=4),
        "64_s3": dict(BLOCK_N=64, NUM_STAGES=3, num_stages=3, num_warps=4),
    },
}
_COMPILED_ON_GPU = dict(UPCAST_DOTS=False, HOST_DESCRIPTORS=False, WARP_SPECIALIZE=False)


def _without_locations(ttir: str) -> str:
    ttir = re.sub(r"loc\([^()]*(\([^()]*\))*[^()]*\)", "", ttir)
    return "\n".join(line for line in ttir.splitlines() if not line.startswith("#loc"))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def compile_records(record_path: str, out_path: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    scratch = tempfile.mkdtemp()
    modules, results = {}, {}
    for rec in json.load(open(record_path)):
        for label, changes in GPU_CONSTEXPRS.get(rec["kernel"], {"as_recorded": {}}).items():
            key = "|".join(str(rec["case"][k]) for k in ("variant", "L", "part")) + f"|{rec['kernel']}|{label}"
            if key in results:
                continue
            stem = "k_" + _digest(rec["source"])
            if stem not in modules:
                path = os.path.join(scratch, stem + ".py")
                with open(path, "w") as f:
                    f.write(rec["source"])
                spec = importlib.util.spec_from_file_location(stem, path)
                modules[stem] = importlib.util.module_from_spec(spec)
                sys.modules[stem] = modules[stem]
                spec.loader.exec_module(modules[stem])
            fn = getattr(modules[stem], rec["kernel"])
            constexprs = {**rec["constexprs"], **{k: v for k, v in _COMPILED_ON_GPU.items() if k in rec["constexprs"]},
                          **changes}
            if constexprs.get("WARP_SPECIALIZE") and (constexprs["HAS_SCORE_MOD"] or constexprs["HAS_PARTIAL_BLOCKS"]):
                continue  # never launched with mods in the loop (kernels/forward.py)
            types = list(rec["types"])
            if constexprs.get("HOST_DESCRIPTORS"):
                # Q, K, V and OUT (the first four arguments) are 4-D descriptors with the tiles as blocks.
                dtype = types[0].lstrip("*")
                rows = (constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["BLOCK_N"], constexprs["BLOCK_M"])
                dims = ("QK_HEAD_DIM_P2", "QK_HEAD_DIM_P2", "V_HEAD_DIM_P2", "V_HEAD_DIM_P2")
                for i, (r, d) in enumerate(zip(rows, dims)):
                    types[i] = f"tensordesc<{dtype}[1,1,{r},{constexprs[d]}]>"
            options = {"num_warps": constexprs.pop("num_warps", 4), "num_stages": constexprs.pop("num_stages", 2)}
            signature = {name: types[i] if i < len(types) else "constexpr" for i, name in enumerate(fn.arg_names)}
            fixed = {name: constexprs[name] for name in fn.arg_names[len(types):]}
            try:
                compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=fixed),
                                          target=GPUTarget("cuda", 90, 32), options=options)
            except Exception as err:  # recorded, and compared like a result
                results[key] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
                continue
            cubin = os.path.join(scratch, "kernel.cubin")
            with open(cubin, "wb") as f:
                f.write(compiled.asm["cubin"])
            sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True).stdout
            sass = re.sub(r"/\*[0-9a-f]{4}\*/", "", "\n".join(
                line for line in sass.splitlines() if "Function :" not in line and "code for" not in line))
            usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True).stdout
            regs = re.search(r"REG:(\d+)", usage)
            results[key] = dict(ttir=_digest(_without_locations(compiled.asm["ttir"])), sass=_digest(sass),
                                regs=int(regs.group(1)) if regs else None, shared=compiled.metadata.shared,
                                types=rec["types"], constexprs=rec["constexprs"])
    with open(out_path, "w") as f:
        json.dump({"kind": "compile", "triton": triton.__version__, "results": results}, f, indent=0, sort_keys=True)
    print(f"{len(results)} kernels compiled for sm_90; {sum('error' in r for r in results.values())} errors")


# ------------------------------------------------------------------------------------ run on a GPU


def _bytes_digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:20]


def run(out_path: str, shard: tuple = (0, 1)) -> None:
    import torch
    import triton

    import flexattn
    from flexattn.variants import CATALOGUE

    launches, case = [], {}

    def keep(jit_fn, grid, args, constexprs, kernel):
        launches.append(dict(case, kernel=getattr(jit_fn, "__name__", "?"), grid=list(grid),
                             constexprs=dict(constexprs), regs=getattr(kernel, "n_regs", None),
                             spills=getattr(kernel, "n_spills", None),
                             shared=getattr(getattr(kernel, "metadata", None), "shared", None)))

    results = {}
    names = sorted(CATALOGUE)[shard[0]::shard[1]]
    B, H, L = 2, 4, 1000
    for head_dim in (64, 128):
        for name in names:
            variant = CATALOGUE[name]
            case["case"] = key = f"{name}|{head_dim}"
            torch.manual_seed(1234)
            inst = variant.make(B, H, L, L, "cuda")
            q, k, v = (torch.randn(B, H, L, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            mask = inst.block_mask(B, H, L, L, "cuda")
            _spy_on_launches(keep)
            out, aux = flexattn.flex_attention(q, k, v, score_mod=inst.score_mod, block_mask=mask,
                                               return_aux=flexattn.AuxRequest(lse=True))
            _spy_on_launches(keep)
            leaves = [q, k, v, *inst.learnable]
            grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
            entry = {"out": _bytes_digest(out), "lse": _bytes_digest(aux.lse)}
            for i, grad in enumerate(grads):
                label = ("dq", "dk", "dv")[i] if i < 3 else f"learnable{i - 3}"
                entry[label] = _bytes_digest(grad)
                if i >= 3:
                    entry[label + "_values"] = grad.float().flatten()[:4096].cpu().tolist()
            if variant.decode and not variant.square_only:
                with torch.no_grad():
                    step = flexattn.decode_block_mask(mask, L - 4, q_len=4) if mask is not None else None
                    _spy_on_launches(keep)
                    entry["decode"] = _bytes_digest(flexattn.flex_attention(
                        q[:, :, -4:].detach(), k.detach(), v.detach(), score_mod=inst.score_mod, block_mask=step))
            torch.cuda.synchronize()
            results[key] = entry
            print(key, "ran", flush=True)
    with open(out_path, "w") as f:
        json.dump({"kind": "run", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "results": results, "launches": launches}, f)


# ------------------------------------------------------------------------------------ time on a GPU

PAPER = ("noop", "causal", "alibi", "sliding_window", "prefix_lm", "softcap", "document_mask")
DECODE_CASES = [(8, 16, 16, 16384, 64), (8, 16, 2, 131072, 64), (8, 12, 2, 32768, 128), (8, 16, 2, 16384, 128),
                (1, 16, 2, 131072, 128), (1, 12, 2, 65536, 64)]  # (B, Hq, Hkv, S, D), as flexattn/bench/decode.py


def time_cases(out_path: str, shard: tuple = (0, 1), warm_only: bool = False, only: tuple = ()) -> None:
    import torch
    import triton
    import triton.testing

    import flexattn
    from flexattn.variants import CATALOGUE, generate_alibi_bias, generate_tanh_softcap

    def median_ms(fn) -> float:
        fn()
        if warm_only:
            torch.cuda.synchronize()
            return 0.0
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def graph_ms(fn) -> float:
        """The GPU time of ``fn``'s kernels: captured once in a CUDA graph, replays timed."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return median_ms(graph.replay)

    def host_us(fn, calls: int = 50) -> float:
        """Host time per call: the fastest of five bursts of calls, the GPU not waited on inside one."""
        fn()
        torch.cuda.synchronize()
        if warm_only:
            return 0.0
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
        return best * 1e6

    cases = [("fwd", name, d) for d in (64, 128) for name in PAPER]
    cases += [("bwd", name, d) for d in (64, 128) for name in PAPER]
    cases += [("decode", f"{score}|{B}x{Hq}:{Hkv}x{S}", D) for B, Hq, Hkv, S, D in DECODE_CASES
              for score in ("noop", "alibi", "softcap")]
    cases += [("host", "fwd", 64), ("host", "bwd", 64)]
    if only:  # e.g. ("host",): the host-time cases alone (decoding steps give theirs with their GPU time)
        cases = [c for c in cases if c[0] in only or ("host" in only and c[0] == "decode")]
    results = {}
    L = 16384
    for mode, name, d in cases[shard[0]::shard[1]]:
        torch.manual_seed(0)
        if mode in ("fwd", "bwd"):
            B, H = (256 if mode == "fwd" else 128) * 2**20 // (16 * L * d * 2), 16
            q, k, v = (torch.randn(B, H, L, d, device="cuda", dtype=torch.bfloat16, requires_grad=mode == "bwd")
                       for _ in range(3))
            score_mod, mask_mod = CATALOGUE[name].build(B, H, L, L, "cuda")
            mask = flexattn.create_block_mask(mask_mod, None, None, L, L, device="cuda") if mask_mod else None
            if mode == "fwd":
                ms = median_ms(lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask))
            else:
                out = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)
                grad = torch.randn_like(out)
                ms = median_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
        elif mode == "host":
            q, k, v = (torch.randn(1, 8, 1024, d, device="cuda", dtype=torch.bfloat16, requires_grad=name == "bwd")
                       for _ in range(3))
            alibi = generate_alibi_bias(8, "cuda")
            mask = flexattn.create_block_mask(CATALOGUE["causal"].build(1, 8, 1024, 1024, "cuda")[1], None, None,
                                              1024, 1024, device="cuda")
            if name == "fwd":
                results[f"{mode}|{name}|{d}"] = {"ms": host_us(
                    lambda: flexattn.flex_attention(q, k, v, score_mod=alibi, block_mask=mask)) / 1e3}
            else:
                out = flexattn.flex_attention(q, k, v, score_mod=alibi, block_mask=mask)
                grad = torch.randn_like(out)
                results[f"{mode}|{name}|{d}"] = {"ms": host_us(
                    lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)) / 1e3}
            print(f"host {name}: {results[f'{mode}|{name}|{d}']['ms'] * 1e3:.1f} us", flush=True)
            continue
        else:
            score, shape = name.split("|")
            B, Hq, Hkv, S, D = next(c for c in DECODE_CASES if f"{c[0]}x{c[1]}:{c[2]}x{c[3]}" == shape and c[4] == d)
            q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            score_mod = {"noop": None, "alibi": generate_alibi_bias(Hq, "cuda"),
                         "softcap": generate_tanh_softcap(30.0)}[score]
            def step():
                return flexattn.flex_attention(q, k, v, score_mod=score_mod, enable_gqa=Hq != Hkv)

            ms = 0.0 if warm_only or only == ("host",) else graph_ms(step)
            results[f"host|decode {name}|{d}"] = {"ms": host_us(step) / 1e3}
        results[f"{mode}|{name}|{d}"] = {"ms": ms}
        print(f"{mode} {name} d={d}: {ms:.4f} ms", flush=True)
    with open(out_path, "w") as f:
        json.dump({"kind": "time", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "results": results}, f)


# ------------------------------------------------------------------------------------ diff


def _load(paths: str) -> dict:
    merged = {"results": {}, "launches": [], "rounds": []}
    for path in paths.split(","):
        data = json.load(open(path))
        merged["kind"] = data["kind"]
        merged["results"].update(data["results"])
        merged["launches"] += data.get("launches", [])
        merged["rounds"].append(data["results"])
    return merged


def _diff_times(a: dict, b: dict) -> bool:
    """Each case's median over the rounds of A and of B, their ratio, and each side's spread (the
    largest relative difference between two of its rounds)."""
    def per_case(rounds):
        times: dict = {}
        for results in rounds:
            for case, r in results.items():
                if r["ms"] > 0:  # 0: not timed in this round (--warm, or --only another kind)
                    times.setdefault(case, []).append(r["ms"])
        return times

    ta, tb = per_case(a["rounds"]), per_case(b["rounds"])
    worst = 0.0
    print(f"{'case':<44}{'A ms':>10}{'B ms':>10}{'B/A':>8}{'spread A':>10}{'spread B':>10}  within")
    outside = 0
    for case in sorted(set(ta) & set(tb)):
        xa, xb = sorted(ta[case]), sorted(tb[case])
        ma, mb = xa[len(xa) // 2], xb[len(xb) // 2]
        spread = max(xa[-1] / xa[0] - 1, xb[-1] / xb[0] - 1)
        ratio = mb / ma
        # Within the spread: B's median no further from A's than the rounds of one side differ.
        within = abs(ratio - 1) <= spread + 1e-12
        outside += not within
        worst = max(worst, abs(ratio - 1))
        print(f"{case:<44}{ma:>10.4f}{mb:>10.4f}{ratio:>8.3f}{xa[-1] / xa[0] - 1:>10.3f}{xb[-1] / xb[0] - 1:>10.3f}"
              f"  {'yes' if within else 'NO'}")
    print(f"time: {len(set(ta) & set(tb))} cases, {outside} outside the run-to-run spread, largest |B/A - 1| "
          f"{worst:.3f}")
    return outside == 0


def diff(paths_a: str, paths_b: str) -> bool:
    a, b = _load(paths_a), _load(paths_b)
    if a["kind"] == "time":
        return _diff_times(a, b)
    ra, rb = a["results"], b["results"]
    only_a, only_b = sorted(set(ra) - set(rb)), sorted(set(rb) - set(ra))
    same = differ = 0
    atomics = []
    for key in sorted(set(ra) & set(rb)):
        for field in sorted(set(ra[key]) | set(rb[key])):
            x, y = ra[key].get(field), rb[key].get(field)
            if field.endswith("_values") or x == y:
                same += not field.endswith("_values")
            elif field.startswith("learnable"):
                p, q = ra[key][field + "_values"], rb[key][field + "_values"]
                norm = math.sqrt(sum(u * u for u in p)) or 1.0
                atomics.append(math.sqrt(sum((u - w) ** 2 for u, w in zip(p, q))) / norm)
            else:
                differ += 1
                print(f"differs: {key} {field}")
    for key in only_a + only_b:
        print(f"only in {'A' if key in ra else 'B'}: {key}")
    print(f"{a['kind']}: {same} fields identical, {differ} differ, {len(only_a)} cases only in A, {len(only_b)} only in B")
    if atomics:
        print(f"learnable-tensor gradients (float32 atomics) not bit-identical: {len(atomics)}, largest relative "
              f"difference {max(atomics):.1e}")
    ok = differ == 0 and not only_a and not only_b
    if a["kind"] == "run":
        def facts(launches):
            return {(r["case"], r["kernel"], json.dumps(r["constexprs"], sort_keys=True)):
                    (r["regs"], r["spills"], r["shared"], tuple(r["grid"])) for r in launches}

        fa, fb = facts(a["launches"]), facts(b["launches"])
        changed = [k for k in set(fa) & set(fb) if fa[k] != fb[k]]
        for k in changed[:20]:
            print(f"kernel differs: {k[0]} {k[1]}: A {fa[k]}, B {fb[k]}")
        print(f"kernels (case, name, constexprs): {len(set(fa) & set(fb)) - len(changed)} with the same registers, "
              f"spills, shared memory and grid; {len(changed)} differ; {len(set(fa) - set(fb))} only in A, "
              f"{len(set(fb) - set(fa))} only in B")
        ok = ok and not changed and set(fa) == set(fb)
    return ok


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "record":
        record(argv[1])
    elif len(argv) >= 3 and argv[0] == "compile":
        compile_records(argv[1], argv[2])
    elif len(argv) >= 2 and argv[0] in ("run", "time"):
        shard = tuple(int(x) for x in argv[argv.index("--shard") + 1].split("/")) if "--shard" in argv else (0, 1)
        if argv[0] == "run":
            run(argv[1], shard)
        else:
            only = tuple(argv[argv.index("--only") + 1].split(",")) if "--only" in argv else ()
            time_cases(argv[1], shard, warm_only="--warm" in argv, only=only)
    elif len(argv) >= 3 and argv[0] == "diff":
        return 0 if diff(argv[1], argv[2]) else 1
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
