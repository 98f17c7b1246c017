"""Context parallelism on one GPU (the ranks as streams), and the model of the ring at scale.

    python -m benchmarks.context_parallel --check --out cp.json   # one GPU: check and time
    python -m benchmarks.context_parallel --model                # the predicted table (no GPU)
    python -m benchmarks.context_parallel --smoke                # tiny sizes on the CPU
    python -m benchmarks.context_parallel --masks document,sliding_window --ranks 2 --check --out cp_merge.json
                                                                 # the merge in the kernel against merge_into

**On one GPU** (NCCL needs one GPU per rank, so no real ranks here): R ranks of one plan run in one
process, each with its own shards as separate tensors, its kernels on its own CUDA stream, and each
K/V transfer a device-to-device copy on the sender's copy stream (standing in for NCCL's), ordered
by events exactly as the ring orders them: a shard is copied into a receive buffer once the kernel
that read that buffer two rounds earlier is done, and a kernel starts once its shard arrived. The
steps are the plan's, with the same kernels ``ContextParallel`` runs (``flexattn.distributed.step``).
``--check`` compares the merged output (and, for causal at 2 ranks, the gradients from each step's
backward with the merged statistics) with single-GPU flexattn by the flash-attention rule: the
error against a float32 run at most twice single-GPU flexattn's own. Each step's kernel and the
merge are then timed one at a time (CUDA events, median of repeats), since streams that share
one GPU share its time.

**The merge in the kernel** ([Note] The merge in the kernel, flexattn/distributed/ring.py): each
step is also timed through the portable Triton forward (``BACKEND='TRITON'``), alone and, for the
steps after a rank's first, with its epilogue merging into the running result. Per rank, three
sums: the default kernels (the Hopper Gluon forward where it applies) plus ``merge_into`` after
each, which is what the ring runs where the kernel cannot merge; the portable kernels plus
``merge_into``; and the portable kernels merging in their epilogue, what the ring runs where it
can. The slowest rank's sums stand against one GPU's time for the whole problem. ``--check`` checks
the ring merged in the kernel too (``fused_out_ok``).

**The model** (``--model``): per rank, tiles per step from the plan, kernel time from measured
single-GPU throughput, transfers from link bandwidth (docs/context_parallel.md lists the
assumptions), for flexattn's ring and for torch's all-gather of K/V.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import statistics
import sys
import time

import torch

from flexattn import create_block_mask, flex_attention
from flexattn.distributed import CostModel, Plan, Problem
from flexattn.distributed.cost import allgather_kv_seconds
from flexattn.distributed.step import merge_into, step_call
from flexattn.kernels import interpreter_enabled
from flexattn.lowering import mod_index_dtype
from flexattn.masks import BlockMask
from flexattn.masks.layout import dense_to_ordered
from flexattn.variants import (
    causal_mask, document_ids, generate_alibi_bias, generate_document_mask, generate_sliding_window, split_lengths,
)

MASKS = ("causal", "document", "sliding_window", "alibi")
WINDOW = 4096  # the sliding window (tokens), in the GPU run and in the model
# Mean document length of the document masks: in the GPU run (32k tokens, 16 documents), in the model.
RUN_DOCUMENT_TOKENS, MODEL_DOCUMENT_TOKENS = 2048, 32768

# Measured forward and backward TFLOP/s of single-GPU flexattn on an H100, bf16, d=128, 16k tokens
# (docs/benchmarks_log.md: "Forward before and after the trust fixes", and "Backward: the Triton kernels").
FORWARD_TFLOPS = {"causal": 533.0, "document": 336.0, "sliding_window": 395.0}
BACKWARD_TFLOPS = {"causal": 430.0, "document": 273.0, "sliding_window": 334.0}
LINKS = {"NVLink 4": 450e9, "InfiniBand": 50e9}


def mods_of(name: str, length: int, heads: int, device) -> tuple:
    """(score_mod, mask_mod) of one case of the one-GPU run."""
    if name == "causal":
        return None, causal_mask
    if name == "alibi":
        return generate_alibi_bias(heads, device), causal_mask
    if name == "sliding_window":
        return None, generate_sliding_window(min(WINDOW, length // 4))
    doc = document_ids(split_lengths(length, max(2, length // RUN_DOCUMENT_TOKENS)), device)
    return None, generate_document_mask(doc)


# ------------------------------------------------------------------------------------------------
# R ranks on one device
# ------------------------------------------------------------------------------------------------


class _Streams:
    """Streams and events on CUDA; on the CPU (``--smoke``) work runs as it is enqueued, in an
    order that already respects every dependency, so they are no-ops."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def stream(self):
        return torch.cuda.Stream() if self.cuda else None

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def record(self, stream):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        if self.cuda and event is not None:
            stream.wait_event(event)


def shard(x: torch.Tensor, layout, rank: int) -> torch.Tensor:
    """``rank``'s shard of ``x`` (what ContextParallel.shard gives that rank)."""
    pad = layout.padded_length - layout.length
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.index_select(2, layout.positions(rank).to(x.device)).contiguous()


class SimulatedRanks:
    """The R ranks of a plan on one device (see the module docstring)."""

    def __init__(self, plan: Plan, q, k, v, score_mod, scale: float, needs_grad: bool = False) -> None:
        self.plan, self.world = plan, plan.world_size
        device = q.device
        self.streams = _Streams(device)
        q_len, kv_len = plan.block_mask.seq_lengths
        position_dtype = (mod_index_dtype(score_mod, "score_mod", q.shape[0], q.shape[1], q_len, kv_len)
                          if score_mod else torch.int32)
        self.score_mod, self.scale, self.position_dtype = score_mod, scale, position_dtype
        self.q = [shard(q, plan.q_layout, r) for r in range(self.world)]
        self.k = [shard(k, plan.kv_layout, r) for r in range(self.world)]
        self.v = [shard(v, plan.kv_layout, r) for r in range(self.world)]
        self.rank_plans = [plan.rank_plan(r, "ring") for r in range(self.world)]
        self.calls = [[step_call(step, score_mod, position_dtype, self.q[r], {}, scale, needs_grad, False)
                       for step in self.rank_plans[r].steps] for r in range(self.world)]
        # The portable Triton forward's, which merges in its epilogue; None where it cannot run (the CPU
        # without Triton's interpreter).
        self.portable = None
        if device.type == "cuda" or interpreter_enabled():
            self.portable = [[step_call(step, score_mod, position_dtype, self.q[r], {"BACKEND": "TRITON"}, scale,
                                        False, False) for step in self.rank_plans[r].steps] for r in range(self.world)]

    def _keys(self, sc, rank, buffers):
        if sc.step.round is None:
            return self.k[rank], self.v[rank]
        return buffers[sc.step.round % 2]

    def forward(self, fused: bool = False):
        """Every rank's merged (out, lse), with the ring's transfers and streams; ``fused``: through
        the portable kernels, each step after a rank's first merging in its epilogue."""
        calls = self.portable if fused else self.calls
        st, world = self.streams, self.world
        compute = [st.stream() for _ in range(world)]
        copy = [st.stream() for _ in range(world)]
        buffers = [[None, None] for _ in range(world)]
        freed = [[None, None] for _ in range(world)]  # per receive buffer: its last reader is done
        arrived = [dict() for _ in range(world)]
        results = [None] * world
        inputs_ready = st.record(torch.cuda.current_stream()) if st.cuda else None

        def transfer(index):
            for rank in range(world):
                rnd = self.rank_plans[rank].rounds[index]
                if not rnd.recv_from:
                    continue
                source, slot = rnd.recv_from[0], index % 2
                if buffers[rank][slot] is None:
                    buffers[rank][slot] = (torch.empty_like(self.k[rank]), torch.empty_like(self.v[rank]))
                with st.on(copy[source]):
                    st.wait(copy[source], inputs_ready)
                    st.wait(copy[source], freed[rank][slot])
                    buffers[rank][slot][0].copy_(self.k[source], non_blocking=True)
                    buffers[rank][slot][1].copy_(self.v[source], non_blocking=True)
                    arrived[rank][index] = st.record(copy[source])

        def run(rank, sc):
            with st.on(compute[rank]):
                st.wait(compute[rank], inputs_ready)
                if sc.step.round is not None:
                    st.wait(compute[rank], arrived[rank][sc.step.round])
                keys = self._keys(sc, rank, buffers[rank])
                if results[rank] is not None and fused and sc.forward_into(self.q[rank], *keys,
                                                                           (*results[rank], None)):
                    pass
                else:
                    out, lse, _ = sc.forward(self.q[rank], *keys, False)
                    if results[rank] is None:
                        results[rank] = (out.float(), lse)
                    else:
                        merge_into(*results[rank], out, lse)
                if sc.step.round is not None:
                    freed[rank][sc.step.round % 2] = st.record(compute[rank])

        rounds = self.world - 1
        if rounds:
            transfer(0)
        for rank in range(world):
            for sc in calls[rank]:
                if sc.step.round is None:
                    run(rank, sc)
        for index in range(rounds):
            if index + 1 < rounds:
                transfer(index + 1)
            for rank in range(world):
                for sc in calls[rank]:
                    if sc.step.round == index:
                        run(rank, sc)
        if st.cuda:
            for stream in compute + copy:
                torch.cuda.current_stream().wait_stream(stream)
        return [(out.to(self.q[r].dtype), lse) for r, (out, lse) in enumerate(results)]

    def backward(self, results, grad_out):
        """dq, dk, dv of every rank's shards: each step's backward with its rank's merged out and
        lse, dK/dV summed at the shard's owner (one stream: the gradients are checked, not timed)."""
        world = self.world
        dq = [torch.zeros_like(self.q[r], dtype=torch.float32) for r in range(world)]
        dk = [torch.zeros_like(self.k[r], dtype=torch.float32) for r in range(world)]
        dv = [torch.zeros_like(self.v[r], dtype=torch.float32) for r in range(world)]
        for rank in range(world):
            out, lse = results[rank]
            for sc in self.calls[rank]:
                (source,) = sc.step.sources
                gq, gk, gv, _ = sc.backward(self.q[rank], self.k[source], self.v[source], out, lse,
                                            grad_out[rank], None)
                dq[rank] += gq
                dk[source] += gk
                dv[source] += gv
        return dq, dk, dv

    def unshard(self, shards, layout):
        whole = shards[0].new_empty(*shards[0].shape[:2], layout.padded_length, *shards[0].shape[3:])
        for rank, shard in enumerate(shards):
            whole[:, :, layout.positions(rank).to(shard.device)] = shard.to(whole.dtype)
        return whole[:, :, :layout.length]

    def step_times(self, reps: int) -> list:
        """Per rank, per step, each timed alone (median of ``reps``): the default kernel and
        ``merge_into`` (kernel_ms, merge_ms); with the portable kernels, the kernel alone and, for a
        step after the rank's first, the kernel that merges in its epilogue (portable_kernel_ms,
        fused_ms; the first step's fused_ms is its plain kernel's, which writes as it always does)."""
        times = []
        for rank in range(self.world):
            row = []
            for index, sc in enumerate(self.calls[rank]):
                (source,) = sc.step.sources
                keys = (self.k[source], self.v[source])
                out, lse, _ = sc.forward(self.q[rank], *keys, False)
                acc_out, acc_lse = out.float(), lse.clone()
                kernel = _median_ms(lambda: sc.forward(self.q[rank], *keys, False), reps)
                merge = _median_ms(lambda: merge_into(acc_out, acc_lse, out, lse), reps)
                entry = {"sources": list(sc.step.sources), "full_tiles": sc.step.full_tiles,
                         "partial_tiles": sc.step.partial_tiles, "kernel_ms": kernel, "merge_ms": merge,
                         "portable_kernel_ms": None, "fused_ms": None}
                if self.portable is not None:
                    portable = self.portable[rank][index]
                    entry["portable_kernel_ms"] = _median_ms(lambda: portable.forward(self.q[rank], *keys, False), reps)
                    # Merging again and again into one running result: the timing's inputs, not a result.
                    running = (acc_out, acc_lse, None)
                    entry["fused_ms"] = (entry["portable_kernel_ms"] if index == 0 else
                                         _median_ms(lambda: _merged(portable, self.q[rank], keys, running), reps))
                row.append(entry)
            times.append(row)
        return times


def _merged(sc, q, keys, running) -> None:
    if not sc.forward_into(q, *keys, running):
        raise RuntimeError(f"the portable forward did not merge in its kernel ({sc.call.backend})")


def _median_ms(fn, reps: int) -> float:
    if not torch.cuda.is_available():
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - start))
        return statistics.median(samples)
    fn()
    samples = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop))
    return statistics.median(samples)


CHECKS = ("out_ok", "fused_out_ok", "dq_ok", "dk_ok", "dv_ok")


def _max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def run_case(name: str, world: int, length: int, heads: int, kv_heads: int, dim: int, dtype, device,
             check: bool, backward: bool, reps: int) -> dict:
    torch.manual_seed(0)
    score_mod, mask_mod = mods_of(name, length, heads, device)
    block_mask = create_block_mask(mask_mod, None, None, length, length, device=device)
    q = torch.randn(1, heads, length, dim, device=device, dtype=dtype)
    k = torch.randn(1, kv_heads, length, dim, device=device, dtype=dtype)
    v = torch.randn(1, kv_heads, length, dim, device=device, dtype=dtype)
    gqa = heads != kv_heads
    scale = dim ** -0.5
    plan = Plan(block_mask, world, balance="mask", schedule="ring")
    ranks = SimulatedRanks(plan, q, k, v, score_mod, scale, needs_grad=backward)
    row = {"mask": name, "ranks": world, "tokens": length, "plan": plan.describe()}

    def single(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)

    results = ranks.forward()
    if check:
        reference_dtype = torch.float64 if device.type == "cpu" else torch.float32
        out = ranks.unshard([o for o, _ in results], plan.q_layout)
        with torch.no_grad():
            ours_single = single(q, k, v)
            reference = single(q.to(reference_dtype), k.to(reference_dtype), v.to(reference_dtype))
        row["out_err"], row["single_gpu_err"] = _max_err(out, reference), _max_err(ours_single, reference)
        row["out_ok"] = row["out_err"] <= 2 * row["single_gpu_err"] + 1e-6
        if ranks.portable is not None:
            fused = ranks.unshard([o for o, _ in ranks.forward(fused=True)], plan.q_layout)
            row["fused_out_err"] = _max_err(fused, reference)
            row["fused_out_ok"] = row["fused_out_err"] <= 2 * row["single_gpu_err"] + 1e-6
        if backward:
            grad_out = torch.randn_like(q)
            shards = [shard(grad_out, plan.q_layout, r) for r in range(world)]
            grads = ranks.backward(results, shards)
            ours = [ranks.unshard(g, layout) for g, layout in zip(grads, (plan.q_layout, plan.kv_layout,
                                                                           plan.kv_layout))]
            low_in = [t.clone().requires_grad_() for t in (q, k, v)]
            want_low = torch.autograd.grad(single(*low_in), low_in, grad_out)
            ref_in = [t.to(reference_dtype).requires_grad_() for t in (q, k, v)]
            want = torch.autograd.grad(single(*ref_in), ref_in, grad_out.to(reference_dtype))
            for label, got, low, ref in zip(("dq", "dk", "dv"), ours, want_low, want):
                row[f"{label}_err"], row[f"{label}_single_gpu_err"] = _max_err(got, ref), _max_err(low, ref)
                row[f"{label}_ok"] = row[f"{label}_err"] <= 2 * row[f"{label}_single_gpu_err"] + 1e-6
    if device.type == "cuda":  # the whole simulated ring, all streams together (one GPU's time)
        row["simulated_ring_ms"] = _median_ms(ranks.forward, max(3, reps // 4))
        row["simulated_fused_ring_ms"] = _median_ms(lambda: ranks.forward(fused=True), max(3, reps // 4))
    row["single_gpu_ms"] = _median_ms(lambda: single(q, k, v), reps)
    row["steps"] = ranks.step_times(reps)
    kernels = [sum(s["kernel_ms"] for s in steps) for steps in row["steps"]]
    merges = [sum(s["merge_ms"] for s in steps[1:]) for steps in row["steps"]]
    row["sum_of_step_kernels_ms"] = sum(kernels)
    row["slowest_rank_kernels_ms"] = max(kernels)
    row["slowest_rank_merges_ms"] = max(merges)
    # The slowest rank's kernels and merges: merged apart (default and portable kernels), and in the kernel.
    row["slowest_rank_separate_ms"] = max(k + m for k, m in zip(kernels, merges))
    if ranks.portable is not None:
        portable = [sum(s["portable_kernel_ms"] for s in steps) for steps in row["steps"]]
        row["slowest_rank_portable_separate_ms"] = max(k + m for k, m in zip(portable, merges))
        row["slowest_rank_fused_ms"] = max(sum(s["fused_ms"] for s in steps) for steps in row["steps"])
    return row


def _print_runs(rows) -> None:
    print("| mask | ranks | single GPU ms | sum of step kernels ms (all ranks) | slowest rank: kernels ms "
          "| its merges ms | merge / kernel | steps per rank | check |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        slowest = max(range(len(row["steps"])), key=lambda r: sum(s["kernel_ms"] for s in row["steps"][r]))
        kernels = sum(s["kernel_ms"] for s in row["steps"][slowest])
        merges = sum(s["merge_ms"] for s in row["steps"][slowest][1:])
        checks = [row[key] for key in CHECKS if key in row]
        check = "-" if not checks else ("pass" if all(checks) else "FAIL")
        print(f"| {row['mask']} | {row['ranks']} | {row['single_gpu_ms']:.3f} | {row['sum_of_step_kernels_ms']:.3f} "
              f"| {kernels:.3f} | {merges:.3f} | {merges / max(kernels, 1e-9):.1%} "
              f"| {[len(s) for s in row['steps']]} | {check} |")
    print()
    print("The merge in the kernel: the slowest rank's kernels and merges (ms), against one GPU's whole problem")
    print("| mask | ranks | single GPU ms | default kernels + merge_into | portable kernels + merge_into "
          "| portable kernels, merged in the kernel | in-kernel / default | in-kernel / portable + merge_into |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        separate, fused = row["slowest_rank_separate_ms"], row.get("slowest_rank_fused_ms")
        portable = row.get("slowest_rank_portable_separate_ms")
        if fused is None:
            print(f"| {row['mask']} | {row['ranks']} | {row['single_gpu_ms']:.3f} | {separate:.3f} | - | - | - | - |")
            continue
        print(f"| {row['mask']} | {row['ranks']} | {row['single_gpu_ms']:.3f} | {separate:.3f} | {portable:.3f} "
              f"| {fused:.3f} | {fused / separate:.2f} | {fused / portable:.2f} |")


# ------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------


def model_block_mask(name: str, length: int, block: int = 128) -> BlockMask:
    """The BlockMask of a model case, its tiles classified from token ranges per block (no
    mask_mod evaluation: a million tokens are 10^12 pairs)."""
    rows = torch.arange(-(-length // block))
    first, last = rows * block, (rows * block + block).clamp(max=length) - 1
    r, c = rows.view(-1, 1), rows.view(1, -1)
    if name == "causal":
        full, visited = r > c, r >= c
        mask_mod = causal_mask
    elif name == "sliding_window":
        window = min(WINDOW, length // 4)
        low = first.view(-1, 1) - last.view(1, -1)  # the smallest q - kv of the tile
        high = last.view(-1, 1) - first.view(1, -1)
        full, visited = (low >= 0) & (high <= window), (high >= 0) & (low <= window)
        mask_mod = generate_sliding_window(window)
    else:
        doc = document_ids(split_lengths(length, max(2, length // MODEL_DOCUMENT_TOKENS)), "cpu")
        doc_first, doc_last = doc[first].long(), doc[last].long()
        one_doc = doc_first == doc_last
        same = one_doc.view(-1, 1) & one_doc.view(1, -1) & (doc_first.view(-1, 1) == doc_first.view(1, -1))
        overlap = (doc_first.view(-1, 1) <= doc_last.view(1, -1)) & (doc_first.view(1, -1) <= doc_last.view(-1, 1))
        full, visited = same & (r > c), overlap & (r >= c)
        mask_mod = generate_document_mask(doc)
    partial = visited & ~full
    if length % block:  # the last row and column stick out
        full[-1, :] = False
        full[:, -1] = False
        partial = visited & ~full
    num, idx = dense_to_ordered(partial.view(1, 1, *partial.shape))
    full_num, full_idx = dense_to_ordered(full.view(1, 1, *full.shape))
    width = max(1, int(num.max()))
    full_width = max(1, int(full_num.max()))
    return BlockMask((length, length), num, idx[..., :width].contiguous(), full_num,
                     full_idx[..., :full_width].contiguous(), None, None, None, None,
                     BLOCK_SIZE=block, mask_mod=mask_mod)


def model_rows(lengths, worlds, masks, links, problem: Problem, forward_tflops: dict, backward_tflops: dict,
               latency_s: float = 30e-6) -> list:
    """One row per (mask, length, ranks, link): flexattn's plan (the balance, "mask" or
    "contiguous", and the schedule the model predicts faster) against torch's all-gather design,
    which balances work as evenly as the "mask" plan and computes the same tiles."""
    rows = []
    for name in masks:
        for length in lengths:
            block_mask = model_block_mask(name, length)
            for world in worlds:
                plans = {balance: Plan(block_mask, world, balance=balance) for balance in ("mask", "contiguous")}
                full, partial = plans["mask"].rank_tiles()
                heaviest = int((full + partial).argmax())
                flops = (full + partial).sum().item() * problem.tile_flops(block_mask.BLOCK_SIZE)
                for link, bandwidth in links.items():
                    # Measured throughput already counts partial tiles at their cost.
                    forward = CostModel(flops_per_s=forward_tflops[name] * 1e12, link_bytes_per_s=bandwidth,
                                        step_latency_s=latency_s, memory_bytes_per_s=3.0e12, partial_tile_cost=1.0)
                    backward = dataclasses.replace(forward, flops_per_s=backward_tflops[name] * 1e12)
                    ours = []
                    for balance, plan in plans.items():
                        schedule = plan.choose_schedule(problem, forward)
                        fwd = max(plan.predicted_seconds(problem, schedule, model=forward))
                        bwd = max(plan.predicted_seconds(problem, schedule, backward=True, model=backward))
                        received = [int(plan.needs[r].sum()) - int(plan.needs[r, r]) for r in range(world)]
                        # K/V shards held at once: the own and two in flight, or the own and every gathered one.
                        held = 1 + (min(2, max(received)) if schedule == "ring" else max(received))
                        ours.append((fwd + bwd, fwd, balance, schedule, max(received), held))
                    train, fwd, balance, schedule, received, held = min(ours)
                    shard_mib = problem.shard_bytes(plans["mask"].kv_layout.local_length) / 2**20
                    args = (problem, block_mask.BLOCK_SIZE, plans["mask"].kv_layout.local_length, world,
                            int(full[heaviest]), int(partial[heaviest]))
                    torch_fwd = allgather_kv_seconds(forward, *args)
                    torch_train = torch_fwd + allgather_kv_seconds(backward, *args, backward=True)
                    rows.append({
                        "mask": name, "tokens": length, "ranks": world, "link": link, "balance": balance,
                        "schedule": schedule, "shards_received_max": received,
                        "ours_kv_mib": held * shard_mib, "torch_kv_mib": world * shard_mib,
                        "ours_fwd_ms": 1e3 * fwd, "torch_fwd_ms": 1e3 * torch_fwd,
                        "ours_train_ms": 1e3 * train, "torch_train_ms": 1e3 * torch_train,
                        "ours_train_tflops_per_gpu": 3.5 * flops / train / world / 1e12,
                        "torch_train_tflops_per_gpu": 3.5 * flops / torch_train / world / 1e12,
                    })
    return rows


def _tokens(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}k"


def _print_model(rows) -> None:
    print("| mask | tokens | ranks | link | balance, schedule | K/V shards received (max of R-1) "
          "| K/V MiB held per rank, per layer: ours / torch "
          "| forward ms: ours / torch | fwd+bwd ms: ours / torch | fwd+bwd TFLOP/s per GPU: ours / torch | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['mask']} | {_tokens(row['tokens'])} | {row['ranks']} | {row['link']} "
              f"| {row['balance']}, {row['schedule']} "
              f"| {row['shards_received_max']} of {row['ranks'] - 1} "
              f"| {row['ours_kv_mib']:.0f} / {row['torch_kv_mib']:.0f} "
              f"| {row['ours_fwd_ms']:.2f} / {row['torch_fwd_ms']:.2f} "
              f"| {row['ours_train_ms']:.2f} / {row['torch_train_ms']:.2f} "
              f"| {row['ours_train_tflops_per_gpu']:.0f} / {row['torch_train_tflops_per_gpu']:.0f} "
              f"| {row['torch_train_ms'] / row['ours_train_ms']:.2f}x |")


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="store_true", help="print the model's table (no GPU needed)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: the GPU run's code and the model")
    parser.add_argument("--check", action="store_true", help="compare with single-GPU flexattn (flash-attention rule)")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--masks", default=",".join(MASKS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    worlds = [int(r) for r in args.ranks.split(",")]
    report = {"torch": torch.__version__, "python": platform.python_version()}
    if args.model or args.smoke:
        lengths = [1024, 2048] if args.smoke else [131072, 262144, 524288, 1048576]
        problem = Problem(batch=1, q_heads=16, kv_batch=1, kv_heads=4, head_dim=128, value_dim=128, itemsize=2)
        rows = model_rows(lengths, [2, 4, 8], ("causal", "document", "sliding_window"), LINKS, problem,
                          FORWARD_TFLOPS, BACKWARD_TFLOPS)
        _print_model(rows)
        report["model"] = {"problem": problem._asdict(), "forward_tflops": FORWARD_TFLOPS,
                           "backward_tflops": BACKWARD_TFLOPS, "rows": rows}
    if not args.model or args.smoke:
        if args.smoke:
            device, dtype, length, heads, kv_heads, dim, reps = torch.device("cpu"), torch.float32, 512, 4, 2, 32, 2
        elif not torch.cuda.is_available():
            print("the one-GPU run needs a CUDA device (--smoke runs it small on the CPU, --model needs none)",
                  file=sys.stderr)
            return 2
        else:
            device, dtype, length, heads, kv_heads, dim, reps = (torch.device("cuda"), torch.bfloat16, args.tokens,
                                                                 16, 4, 128, args.reps)
            import triton

            report.update(device=torch.cuda.get_device_name(), triton=triton.__version__, cuda=torch.version.cuda)
        rows = []
        for name in args.masks.split(","):
            for world in worlds:
                backward = args.check and name == "causal" and world == worlds[0]
                rows.append(run_case(name, world, length, heads, kv_heads, dim, dtype, device,
                                     args.check or args.smoke, backward or args.smoke, reps))
                print(f"{name} at {world} ranks done", file=sys.stderr, flush=True)
        _print_runs(rows)
        report["runs"] = rows
        failed = [row for row in rows if not all(row.get(k, True) for k in CHECKS)]
        if failed:
            print("check failed: " + ", ".join(f"{r['mask']} at {r['ranks']} ranks" for r in failed), file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if "runs" in report and failed else 0


if __name__ == "__main__":
    sys.exit(main())
