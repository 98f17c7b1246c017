"""Model-level benchmark: one training step (forward, backward, AdamW) of a GPT-style model, with
flexattn, torch's flex_attention and SDPA (cuDNN) side by side in one process, eager, compiled and
captured in CUDA graphs.

    python -m flexattn.bench --mode model                       # GPU: 12 layers, d_model 768, 12 heads
    python -m flexattn.bench --mode model --masks causal --seq 4k --impls flexattn,torch
    python -m flexattn.bench --mode model --smoke               # CPU: tiny sizes, the code paths only

The model: token embedding, ``--layers`` pre-norm blocks (attention with ``--heads`` heads of 64,
MLP 4x, GELU), final norm, untied output head, cross-entropy; bf16 weights and activations, AdamW
(fused). Shapes (``--seq``): ``4k`` is 4 sequences of 4096 tokens, ``16k`` one of 16384. Masks
(``--masks``): ``causal``, and ``document`` (causal within packed documents of random lengths, 1k
tokens on average; SDPA has no such mask and is skipped there). Each BlockMask is built once,
outside the timed step.

Execution modes (``--modes``):
* ``eager``: the model in eager mode. torch's flex_attention has no fused eager path, so its
  attention function alone is compiled (how transformers calls it).
* ``compile``: every block compiled on its own with ``torch.compile(fullgraph=True)`` (torchtitan's
  way: one compile serves the 12 blocks); embedding, head and loss eager. ``--scope model`` compiles
  the model's forward whole instead.
* ``reduce-overhead``: the same with ``mode="reduce-overhead"``: each block's forward and backward
  replay from CUDA graphs.

Per case: tokens/s (tokens of a step over its wall time, steps run back to back and waited on at the
end), GPU time per step (CUDA events around each step), host time per step (the wall time of the
Python call of a step, the GPU not waited on), compile time (the first two steps' wall time less two
steady steps), and the SM clock the timed steps ended at (where NVML can be read). Writes a table and a JSON with the device and versions (``--out``).

In one process the implementations share what the first one warmed: Inductor's imports and worker
pool, and any kernel a cache already holds. ``--cold`` measures what a user's first run pays
instead: each case runs in a process of its own with empty caches (Triton's, Inductor's and
flexattn's, in a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn

import flexattn
from flexattn.bench.common import git_commit

IMPLS = ("flexattn", "torch", "sdpa")
MODES = ("eager", "compile", "reduce-overhead")
SHAPES = {"4k": (4, 4096), "16k": (1, 16384)}
MASKS = ("causal", "document")
SMOKE = dict(layers=2, dim=64, heads=2, vocab=512, shapes={"256": (2, 256)}, warmup=2, steps=2)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_ids(batch: int, seq: int, device, mean_length: int = 1024) -> torch.Tensor:
    """Packed documents of random lengths (mean ``mean_length``): ``[batch, seq]`` document ids."""
    generator = torch.Generator().manual_seed(0)
    starts = torch.rand(batch, seq, generator=generator) < 1.0 / mean_length
    starts[:, 0] = True
    return (torch.cumsum(starts.int(), dim=1) - 1).to(device)


def document_mask(ids: torch.Tensor):
    def same_document(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    return same_document


def attention_for(impl: str, mode: str, mask: str, batch: int, seq: int, device):
    """``attend(q, k, v)`` for one implementation and the mask it needs, built once here."""
    if impl == "sdpa":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [SDPBackend.CUDNN_ATTENTION] if device.type == "cuda" else [SDPBackend.MATH]

        def attend(q, k, v):
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return attend
    mask_mod = causal if mask == "causal" else document_mask(document_ids(batch, seq, device))
    mask_batch = None if mask == "causal" else batch
    if impl == "flexattn":
        block_mask = flexattn.create_block_mask(mask_mod, mask_batch, None, seq, seq, device=device)
        flex = flexattn.flex_attention
    else:
        from torch.nn.attention import flex_attention as torch_flex_module

        block_mask = torch_flex_module.create_block_mask(mask_mod, mask_batch, None, seq, seq, device=device)
        flex = torch_flex_module.flex_attention
        if mode == "eager":
            flex = torch.compile(flex, dynamic=False)

    def attend(q, k, v):
        return flex(q, k, v, block_mask=block_mask)

    return attend


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attend(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(B, L, D))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, attend):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attend) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def run_case(impl, mode, mask, batch, seq, cfg, device, backend, scope="blocks") -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = GPT(cfg["vocab"], cfg["dim"], cfg["heads"], cfg["layers"],
                attention_for(impl, mode, mask, batch, seq, device)).to(device, dtype)
    if mode != "eager":
        options = dict(fullgraph=True, backend=backend)
        if mode == "reduce-overhead":
            options["mode"] = "reduce-overhead"
        if scope == "model":
            model.forward = torch.compile(model.forward, **options)
        else:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch.compile(block, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, cfg["vocab"], (batch, seq), device=device)

    captured = mode == "reduce-overhead"

    def step():
        if captured:  # a new step: the graphs' outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    first = []
    for _ in range(cfg["warmup"]):
        start = time.perf_counter()
        step()
        sync()
        first.append(time.perf_counter() - start)
    host, gpu = [], []
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(cfg["steps"])] if cuda else []
    sync()
    wall_start = time.perf_counter()
    for i in range(cfg["steps"]):
        if cuda:
            events[i][0].record()
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        if cuda:
            events[i][1].record()
    sync()
    wall = (time.perf_counter() - wall_start) / cfg["steps"]
    if cuda:
        gpu = [a.elapsed_time(b) / 1e3 for a, b in events]
    clock = sm_clock_mhz(device)  # read right after the timed steps: the clock they ended at
    result = {
        "impl": impl, "mode": mode, "mask": mask, "batch": batch, "seq": seq,
        "tokens_per_s": batch * seq / wall, "step_ms": wall * 1e3,
        "host_ms": 1e3 * sorted(host)[len(host) // 2],
        "gpu_ms": 1e3 * sorted(gpu)[len(gpu) // 2] if gpu else None,
        "compile_s": max(0.0, sum(first[:2]) - 2 * wall) if mode != "eager" or impl == "torch" else 0.0,
        "sm_clock_mhz": clock,
    }
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return result


def sm_clock_mhz(device) -> Optional[int]:
    """The GPU's SM clock now (MHz, through NVML where torch can read it), else None. Steps run back to
    back can hold a GPU at its power cap, below its top clock, and an implementation whose kernels
    spend more energy gets a lower clock (docs/benchmarks_log.md, "Where the compiled steps' time
    goes, unprofiled: the power cap; warm backward calls"): the column tells a reader which state a
    row was measured in."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # noqa: BLE001 - no NVML (pynvml) here: no clock
        return None


def run_cold(impl: str, mode: str, mask: str, shape: str, args) -> dict:
    """One case in a fresh process whose Triton, Inductor and flexattn caches start empty."""
    with tempfile.TemporaryDirectory(prefix="flexattn-cold-") as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"), FLEXATTN_CACHE_DIR=os.path.join(tmp, "flexattn"))
        out = os.path.join(tmp, "case.json")
        argv = [sys.executable, "-m", "flexattn.bench", "--mode", "model", "--impls", impl, "--modes", mode,
                "--masks", mask, "--seq", shape, "--layers", str(args.layers), "--dim", str(args.dim),
                "--heads", str(args.heads), "--vocab", str(args.vocab), "--scope", args.scope, "--out", out]
        argv += ["--quick"] if args.quick else []
        argv += ["--smoke"] if args.smoke else []
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if not os.path.exists(out):
            raise RuntimeError(f"the case's process failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        (result,) = json.loads(Path(out).read_text())["results"]
    if "error" in result:
        raise RuntimeError(result["error"])
    return dict(result, cold=True)


def environment(device) -> dict:
    import triton

    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "flexattn": flexattn.__version__,
           "flexattn_commit": git_commit()}
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def table(results: list) -> str:
    lines = ["| impl | mode | mask | tokens | tok/s | step ms | GPU ms | host ms | compile s | SM MHz |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['mode']} | {r['mask']} | {r['batch']}x{r['seq']} | failed: "
                         f"{r['error'][:60]} | | | | | |")
            continue
        gpu = f"{r['gpu_ms']:.1f}" if r["gpu_ms"] is not None else "-"
        clock = r.get("sm_clock_mhz") or "-"
        lines.append(f"| {r['impl']} | {r['mode']} | {r['mask']} | {r['batch']}x{r['seq']} | "
                     f"{r['tokens_per_s'] / 1e3:.0f}k | {r['step_ms']:.1f} | {gpu} | {r['host_ms']:.1f} | "
                     f"{r['compile_s']:.1f} | {clock} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexattn.bench --mode model", description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--seq", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--masks", default=",".join(MASKS), help=f"comma-separated, of {', '.join(MASKS)}")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--scope", choices=("blocks", "model"), default="blocks",
                        help="what the compiled modes compile: each block (default) or the model's forward whole")
    parser.add_argument("--quick", action="store_true", help="fewer warm-up and timed steps (2 and 4)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on any device: the code paths only")
    parser.add_argument("--cold", action="store_true",
                        help="each case in a fresh process with empty kernel and compile caches (first-run compile time)")
    parser.add_argument("--out", default="bench_model.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("the model benchmark needs a CUDA GPU (or --smoke, for tiny sizes anywhere)", file=sys.stderr)
        return 2
    cfg = dict(layers=args.layers, dim=args.dim, heads=args.heads, vocab=args.vocab, warmup=3, steps=10)
    if args.quick:
        cfg.update(warmup=2, steps=4)
    shapes = {name: SHAPES[name] for name in args.seq.split(",")} if not args.smoke else SMOKE["shapes"]
    impls, modes, masks = args.impls.split(","), args.modes.split(","), args.masks.split(",")
    if args.smoke:
        cfg.update({k: SMOKE[k] for k in ("layers", "dim", "heads", "vocab", "warmup", "steps")})
        # On a CPU: torch's compiled flex_attention would compile a CPU template per case, and CUDA graphs need CUDA.
        impls = [i for i in impls if device.type == "cuda" or i != "torch"]
        modes = [m for m in modes if device.type == "cuda" or m != "reduce-overhead"]
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    results = []
    for shape in shapes:
        batch, seq = shapes[shape]
        for mask in masks:
            for impl in impls:
                if impl == "sdpa" and mask != "causal":
                    continue  # SDPA has no document mask (a dense one would time another kernel)
                for mode in modes:
                    try:
                        if args.cold:
                            r = run_cold(impl, mode, mask, shape, args)
                        else:
                            r = run_case(impl, mode, mask, batch, seq, cfg, device, backend, args.scope)
                    except Exception as err:  # one failing case must not lose the others' numbers
                        r = {"impl": impl, "mode": mode, "mask": mask, "batch": batch, "seq": seq,
                             "error": f"{type(err).__name__}: {err}".splitlines()[0]}
                    results.append(r)
                    print(table([r]).splitlines()[-1], flush=True)
    print()
    print(table(results))
    cfg.update(scope=args.scope, cold=args.cold)
    Path(args.out).write_text(json.dumps({"env": environment(device), "config": cfg, "results": results}, indent=1))
    print(f"\nwritten: {args.out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
