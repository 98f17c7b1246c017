"""A rank's peak memory under context parallelism against one GPU's, on one device.

    python -m benchmarks.cp_memory --tokens 131072 --ranks 2,4 --chunks 1,auto --out mem.json
    python -m benchmarks.cp_memory --model --tokens 131072     # the model alone (memory.py), no device

Each rank runs alone, one after the other, with the real RankRun (flexattn/distributed/ring.py) and
a loopback exchange: a receive of K/V copies the sender's shard (made before the measurement, so
not counted); a receive of dK/dV parts fills zeros (this rank's memory is the same; dk and dv are
then not checked). The rank's peak is ``max_memory_allocated`` above what was allocated before its
own tensors (q, k, v, the output's gradient) were made, and the live tensor bytes of its ops
(benchmarks/live_bytes.py). One GPU's peak is flexattn forward and backward of the whole sequence,
measured the same way. ``--old PACKAGE`` measures another copy of flexattn.distributed (the code
before head chunks) with the same harness. Checked: each rank's out and dq against one GPU's
(causal: rows of a rank see only keys the plan delivers, so both are exact up to the sum's order).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch

from benchmarks.live_bytes import LiveBytes
from flexattn import create_block_mask, flex_attention
from flexattn.distributed import Plan
from flexattn.distributed.memory import RankShapes, choose_head_chunks, held_bytes, working_bytes
from flexattn.variants import causal_mask


class _Done:
    def wait(self):
        return None


class Loopback:
    """Exchange.post for one rank of a simulated world: receives served from every rank's shards."""

    def __init__(self, rank: int, k_shards: list, v_shards: list) -> None:
        self.rank, self.k, self.v = rank, k_shards, v_shards

    def post(self, sends, recvs):
        taken = {}
        for tensor, peer in recvs:
            n = taken.get(peer, 0)
            taken[peer] = n + 1
            if tensor.dtype == self.k[peer].dtype and n < 2:  # K then V of the peer's shard
                tensor.copy_((self.k if n == 0 else self.v)[peer])
            else:  # dK/dV parts of this rank's shard (float32): memory only
                tensor.zero_()
        return [_Done()]


def _peak(fn, device):
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with LiveBytes() as live:
        result = fn(live)
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - base, live.peak


def run(args) -> dict:
    device = torch.device("cuda")
    L, H, Hkv, D, dtype = args.tokens, args.heads, args.kv_heads, args.dim, torch.bfloat16
    bm = create_block_mask(causal_mask, None, None, L, L, device=device)
    torch.manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, h, L, D, device=device, dtype=dtype) for h in (H, Hkv, Hkv, H))
    report = {"tokens": L, "heads": H, "kv_heads": Hkv, "dim": D, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": []}

    def single(live):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        g = grad_out.clone()
        live.hold(*leaves, g)
        out = flex_attention(*leaves, block_mask=bm, enable_gqa=True)
        out.backward(g)
        return out.detach(), leaves[0].grad

    single(LiveBytes())  # warm-up: kernels compiled
    (want_out, want_dq), single_peak, single_live = _peak(single, device)
    report["single"] = {"peak": single_peak, "live": single_live}
    print(f"one GPU: peak {single_peak / 2**30:.2f} GiB", flush=True)
    packages = {"new": "flexattn.distributed"} | ({"old": args.old} if args.old else {})
    for world in [int(r) for r in args.ranks.split(",")]:
        plan = Plan(bm, world, balance="mask", schedule="ring")
        shard = [lambda t, r=r: t.index_select(2, plan.q_layout.positions(r).to(device)).contiguous()
                 for r in range(world)]
        qs, ks, vs, gs = ([shard[r](t) for r in range(world)] for t in (q, k, v, grad_out))
        for name, package in packages.items():
            for chunks in (args.chunks.split(",") if name == "new" else ["-"]):
                row = {"ranks": world, "code": name, "chunks": chunks, "peak": [], "live": [], "ok": []}
                for r in range(world):
                    rank_plan = plan.rank_plan(r, "ring")
                    shapes = RankShapes(1, H, 1, Hkv, qs[r].shape[2], ks[r].shape[2], D, D, 2)
                    n = choose_head_chunks(shapes, world, "ring") if chunks == "auto" else int(chunks)
                    built = _rank_run(package, rank_plan, n, qs[r], Hkv, Loopback(r, ks, vs))
                    row["chunks_used"] = n if name == "new" else 1

                    def rank(live, r=r, built=built):
                        leaves = [t.clone() for t in (qs[r], ks[r], vs[r])]
                        g = gs[r].clone()
                        live.hold(*leaves, g)
                        out, lse, _ = built.forward(*leaves)
                        dq, dk, dv, _ = built.backward(*leaves, out, lse, g, None)
                        return out, dq

                    rank(LiveBytes())
                    (out, dq), peak, live = _peak(rank, device)
                    row["peak"].append(peak)
                    row["live"].append(live)
                    err_out = (out.float() - shard[r](want_out).float()).abs().max().item()
                    err_dq = (dq.float() - shard[r](want_dq).float()).abs().max().item()
                    row["ok"].append(err_out < 2e-2 and err_dq < 5e-2)
                    row.setdefault("errors", []).append((err_out, err_dq))
                row["ratio"] = max(row["peak"]) / single_peak
                row["model_ratio"] = (held_bytes(shapes) + sum(working_bytes(shapes, world, "ring", row["chunks_used"])
                                                              .values())) / held_bytes(RankShapes(1, H, 1, Hkv, L, L, D, D, 2))
                print(f"{world} ranks, {name} code, chunks {chunks} ({row['chunks_used']}): peak per rank "
                      f"{max(row['peak']) / 2**30:.2f} GiB = {row['ratio']:.3f}x one GPU (model {row['model_ratio']:.3f}x); "
                      f"checks {'pass' if all(row['ok']) else 'FAIL'} {row['errors']}", flush=True)
                report["rows"].append(row)
    return report


def _rank_run(package: str, rank_plan, chunks: int, q, kv_heads: int, exchange):
    """A RankRun of ``package`` (this flexattn.distributed, or an older copy without head chunks)."""
    ring, step = importlib.import_module(f"{package}.ring"), importlib.import_module(f"{package}.step")
    scale = q.shape[-1] ** -0.5
    if hasattr(step, "chunk_step_calls"):
        chunked = step.chunk_step_calls(rank_plan.steps, chunks, None, torch.int32, q, kv_heads, {}, scale, True, False)
        return ring.RankRun(rank_plan, [ring.HeadChunk(*c) for c in chunked], exchange, False, [])
    calls = [step.step_call(s, None, torch.int32, q, {}, scale, True, False) for s in rank_plan.steps]
    return ring.RankRun(rank_plan, calls, exchange, False, [])


def model(args) -> None:
    print("| ranks | chunks | rank's peak / one GPU's (model) |")
    print("|---|---|---|")
    for world in [int(r) for r in args.ranks.split(",")]:
        local = args.tokens // world
        shapes = RankShapes(1, args.heads, 1, args.kv_heads, local, local, args.dim, args.dim, 2)
        one = held_bytes(RankShapes(1, args.heads, 1, args.kv_heads, args.tokens, args.tokens, args.dim, args.dim, 2))
        for chunks in [c for c in range(1, args.kv_heads + 1) if args.kv_heads % c == 0]:
            total = held_bytes(shapes) + sum(working_bytes(shapes, world, "ring", chunks).values())
            print(f"| {world} | {chunks} | {total / one:.3f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--chunks", default="1,auto")
    parser.add_argument("--old", help="a package holding the older flexattn.distributed (ring.py, step.py)")
    parser.add_argument("--model", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.model:
        model(args)
        return 0
    report = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(all(r["ok"]) for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
