"""The cases tests/test_distributed.py runs on gloo ranks, and the code each rank runs.

One spawn per world size runs every case in the same processes (starting ranks costs seconds;
a case, a fraction of one). Every rank builds the same global inputs from the case's seed, runs
``ContextParallel`` on its shards, and rank 0 compares the unsharded results with single-process
flexattn and with the float64 reference, recording the errors; the test file asserts on them.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
import zlib
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

B, E, EV = 1, 16, 24
BLOCK = 32
SQUARE = 192  # the spatial variants' grids (12 x 16, 4 x 6 x 8); 6 blocks: padded at 4 ranks and for zigzag
ODD = 250  # entries that take any length: a partial last block, and padding


@dataclass(frozen=True)
class Case:
    """One run. ``kind``: "variant" (forward and backward against flexattn and the reference),
    "bytes" (what each rank sent and received), "errors" (disagreeing ranks), or "mesh" (a
    DeviceMesh for the group)."""

    kind: str
    world: int
    variant: str = ""
    balance: str = "mask"
    schedule: str = "ring"
    heads: int = 2
    kv_heads: int = 2
    q_len: int = 0
    kv_len: int = 0
    backend: str = "PYTORCH"
    aux: bool = False

    @property
    def id(self) -> str:
        if self.kind != "variant":
            return f"{self.kind}-{self.world}"
        extra = "".join([f"-gqa{self.heads}:{self.kv_heads}" if self.heads != self.kv_heads else "",
                         f"-{self.q_len}x{self.kv_len}" if self.q_len != self.kv_len else "",
                         "-triton" if self.backend == "TRITON" else "", "-aux" if self.aux else ""])
        return f"{self.variant}-{self.world}ranks-{self.balance}-{self.schedule}{extra}"


def cases(world: int) -> list:
    from flexattn.variants import CATALOGUE

    def lengths(name):
        return (SQUARE, SQUARE) if CATALOGUE[name].square_only else (ODD, ODD)

    found = []
    for name in CATALOGUE:
        L, S = lengths(name)
        for balance in ("mask", "zigzag", "contiguous"):
            found.append(Case("variant", world, name, balance, "ring", q_len=L, kv_len=S))
        found.append(Case("variant", world, name, "mask", "allgather", q_len=L, kv_len=S))
    found += [
        Case("variant", world, "alibi", "mask", "ring", heads=4, kv_heads=2, q_len=ODD, kv_len=ODD, aux=True),
        Case("variant", world, "document_mask", "zigzag", "allgather", heads=4, kv_heads=1, q_len=SQUARE,
             kv_len=SQUARE),
        Case("variant", world, "text_to_image", "zigzag", "ring", q_len=200, kv_len=136),
        Case("variant", world, "text_to_image", "mask", "allgather", q_len=136, kv_len=200),
    ]
    if world == 2:  # through the Triton kernels (the interpreter: slow, so a few)
        found += [
            Case("variant", world, "alibi", "mask", "ring", q_len=ODD, kv_len=ODD, backend="TRITON"),
            Case("variant", world, "document_mask", "contiguous", "allgather", q_len=SQUARE, kv_len=SQUARE,
                 backend="TRITON"),
        ]
    found += [Case("bytes", world), Case("errors", world), Case("mesh", world)]
    return found


def fused_merge_cases(world: int) -> list:
    """Cases through the Triton kernels, whose steps after the first merge in the forward kernel
    ([Note] The merge in the kernel, flexattn/distributed/ring.py): sparse document and window
    masks, GQA with the LSE and max_scores, a score_mod reading a captured tensor (tests/test_cp_fused_merge.py)."""
    return [
        Case("variant", world, "document_mask", "mask", "ring", q_len=SQUARE, kv_len=SQUARE, backend="TRITON"),
        Case("variant", world, "sliding_window", "contiguous", "ring", heads=4, kv_heads=2, q_len=ODD, kv_len=ODD,
             backend="TRITON", aux=True),
        Case("variant", world, "alibi", "zigzag", "ring", q_len=ODD, kv_len=ODD, backend="TRITON"),
    ]


SUITES = {"distributed": cases, "fused_merge": fused_merge_cases}


# ---------------------------------------------------------------------------------------------
# Starting ranks
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(entry, world: int, args: tuple, timeout: float) -> Optional[str]:
    """Start ``world`` processes running ``entry(rank, world, port, *args)`` (spawned, with a free
    port for init_process_group) and wait at most ``timeout`` seconds; returns the failure (a rank's
    exception, or the timeout) or None. Ranks still alive at the end are killed."""
    import torch.multiprocessing as mp

    context = mp.start_processes(entry, args=(world, free_port(), *args), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                failure = f"the {world} ranks did not finish within {timeout:.0f} s"
                break
    except Exception as err:  # a rank raised: its traceback is in its file
        failure = f"a rank failed: {err}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return failure


def run_ranks(world: int, out_dir: str, timeout: float, suite: str = "distributed") -> tuple[dict, Optional[str]]:
    """Start ``world`` gloo ranks that run the cases of ``SUITES[suite](world)``; returns (rank 0's
    results by case id, the failure: a rank's traceback, or a timeout, or None)."""
    failure = spawn_ranks(_rank_main, world, (out_dir, suite), timeout)
    results = {}
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                if rank == 0:
                    results[entry["case"]] = entry
                elif "traceback" in entry:  # a case that failed on another rank fails on rank 0's side too
                    results.setdefault(entry["case"], {}).setdefault("traceback", f"rank {rank}: {entry['traceback']}")
    return results, failure


def ranks_started_once(tmp_path_factory, suite: str, timeout) -> Callable:
    """For a module-scoped fixture: world size -> ``run_ranks``'s (results, failure) for ``suite``,
    each world started once per module. ``timeout``: seconds, or a dict of them by world size."""
    started = {}

    def results(world):
        if world not in started:
            seconds = timeout[world] if isinstance(timeout, dict) else timeout
            started[world] = run_ranks(world, str(tmp_path_factory.mktemp(f"{suite}{world}")), seconds, suite=suite)
        return started[world]

    return results


def _rank_main(rank: int, world: int, port: int, out_dir: str, suite: str) -> None:
    torch.set_num_threads(1)  # world ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    try:
        with open(path, "w") as f:
            for case in SUITES[suite](world):
                try:
                    entry = RUNNERS[case.kind](case, rank)
                except Exception:
                    entry = {"traceback": traceback.format_exc()}
                entry.update(case=case.id, spec=asdict(case))
                f.write(json.dumps(entry) + "\n")
                f.flush()
                dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    finite = torch.isfinite(expected)
    if not torch.equal(finite, torch.isfinite(actual)):
        return float("inf")
    diff = (actual.double() - expected.double())[finite]
    return (diff.norm() / expected.double()[finite].norm().clamp_min(1e-30)).item()


def _seed(case: Case) -> None:
    torch.manual_seed(zlib.crc32(case.id.encode()))


def _variant(case: Case, rank: int) -> dict:
    import flexattn.distributed.ring
    import flexattn.distributed.step
    import flexattn.kernels.backward
    from flexattn import AuxRequest, create_block_mask, flex_attention, noop_mask
    from flexattn.distributed import ContextParallel
    from flexattn.variants import CATALOGUE, apply_sinks

    _seed(case)
    L, S, Hq, Hkv = case.q_len, case.kv_len, case.heads, case.kv_heads
    inst = CATALOGUE[case.variant].make(B, Hq, L, S, "cpu")
    block_mask = create_block_mask(inst.mask_mod or noop_mask, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    q = torch.randn(B, Hq, L, E)
    k, v = torch.randn(B, Hkv, S, E), torch.randn(B, Hkv, S, EV)
    grad_out = torch.randn(B, Hq, L, EV)
    leaves = list(inst.learnable) + ([inst.sinks] if inst.sinks is not None else [])
    gqa = Hq != Hkv
    options = {"BACKEND": case.backend}
    want_aux = inst.sinks is not None or case.aux

    def attend(fn, q, k, v):
        if not want_aux:
            return fn(q, k, v, score_mod=inst.score_mod, enable_gqa=gqa, kernel_options=options), None
        out, aux = fn(q, k, v, score_mod=inst.score_mod, enable_gqa=gqa, kernel_options=options,
                      return_aux=AuxRequest(lse=True, max_scores=case.aux))
        if inst.sinks is not None:
            out = apply_sinks(out, aux.lse, inst.sinks)
        return out, aux

    cp = ContextParallel(block_mask, balance=case.balance, schedule=case.schedule)
    shards = [cp.shard(t).requires_grad_() for t in (q, k, v)]
    backends = set()
    merges = {"in_kernel": 0, "merge_into": 0}  # how the forward's steps after the first merged
    forward, into, merge_into = (flexattn.distributed.step.run_forward, flexattn.distributed.step.forward_into,
                                 flexattn.distributed.ring.merge_into)

    def recording(call, *args, **kwargs):  # which backend each step ran
        backends.add(call.backend)
        return forward(call, *args, **kwargs)

    def recording_into(call, *args, **kwargs):
        merged = into(call, *args, **kwargs)
        if merged:
            backends.add(call.backend)
            merges["in_kernel"] += 1
        return merged

    def counting(*args, **kwargs):
        merges["merge_into"] += 1
        return merge_into(*args, **kwargs)

    flexattn.distributed.step.run_forward = recording
    flexattn.distributed.step.forward_into = recording_into
    flexattn.distributed.ring.merge_into = counting
    try:
        out_l, aux_l = attend(cp.flex_attention, *shards)
    finally:
        flexattn.distributed.step.run_forward = forward
        flexattn.distributed.step.forward_into = into
        flexattn.distributed.ring.merge_into = merge_into
    loss = (out_l * cp.shard(grad_out)).sum()
    if case.aux:  # the LSE's gradient too
        loss = loss + aux_l.lse.sum()
    triton_backwards = flexattn.kernels.backward.launches
    grads = torch.autograd.grad(loss, shards + leaves)
    triton_backwards = flexattn.kernels.backward.launches - triton_backwards
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sorted(backends), triton_backwards, merges))
    for g in grads[3:]:  # each rank holds its queries' share
        dist.all_reduce(g)
    roles = ("query", "query", "key", "key")
    got = [cp.unshard(t, role) for t, role in zip([out_l.detach(), *grads[:3]], roles)] + list(grads[3:])
    if case.aux:
        got += [cp.unshard(aux_l.lse.detach(), "query"), cp.unshard(aux_l.max_scores, "query")]
    if rank != 0:
        return {}

    # Single-process flexattn, same backend, and the float64 reference.
    full = [t.clone().requires_grad_() for t in (q, k, v)]

    def single(q, k, v, **kw):
        return flex_attention(q, k, v, block_mask=block_mask, **kw)

    out, aux = attend(single, *full)
    loss = (out * grad_out).sum() + (aux.lse.sum() if case.aux else 0)
    single_grads = torch.autograd.grad(loss, full + leaves)
    expected = [out.detach()] + list(single_grads)
    if case.aux:
        expected += [aux.lse.detach(), aux.max_scores]

    from flexattn.reference import reference_attention

    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse, ref_max = reference_attention(*ref_in, score_mod=inst.score_mod, mask_mod=inst.mask_mod,
                                                    enable_gqa=gqa)
    if inst.sinks is not None:
        ref_out = apply_sinks(ref_out, ref_lse, inst.sinks.double())
    loss = (ref_out * grad_out.double()).sum() + (ref_lse.sum() if case.aux else 0)
    reference = [ref_out.detach()] + list(torch.autograd.grad(loss, ref_in + leaves))
    if case.aux:
        reference += [ref_lse.detach(), ref_max]

    names = ["out", "dq", "dk", "dv"] + [f"d(learnable {i})" for i in range(len(leaves))]
    names += ["lse", "max_scores"] if case.aux else []
    return {
        "names": names,
        "vs_flexattn": [_rel_err(a, b) for a, b in zip(got, expected)],
        "vs_reference": [_rel_err(a, b) for a, b in zip(got, reference)],
        "nan": [bool(torch.isnan(a).any()) for a in got],
        "shapes_match": [tuple(a.shape) == tuple(b.shape) for a, b in zip(got, expected)],
        "schedule": cp.plan.schedule,
        "backends": sorted({b for ranks_backends, _, _ in gathered for b in ranks_backends}),
        "triton_backwards": sum(n for _, n, _ in gathered),
        "merges": {how: sum(m[how] for _, _, m in gathered) for how in ("in_kernel", "merge_into")},
    }


def _bytes(case: Case, rank: int) -> dict:
    """Count every p2p op this rank posts, forward and backward, for masks that skip shards."""
    from flexattn import create_block_mask
    from flexattn.distributed import ContextParallel
    from flexattn.variants import causal_mask, generate_sliding_window

    posted = []
    original = dist.batch_isend_irecv

    def counting(ops):
        for op in ops:
            kind = "send" if op.op is dist.isend else "recv"
            posted.append((kind, op.peer, op.tensor.numel() * op.tensor.element_size()))
        return original(ops)

    L = 256
    report = {}
    dist.batch_isend_irecv = counting
    try:
        for label, mask_mod, balance in (("causal", causal_mask, "contiguous"),
                                         ("sliding_window", generate_sliding_window(40), "contiguous"),
                                         ("sliding_window_mask", generate_sliding_window(40), "mask")):
            for schedule in ("ring", "allgather"):
                _seed(case)
                bm = create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
                cp = ContextParallel(bm, balance=balance, schedule=schedule)
                q, k, v = (cp.shard(torch.randn(B, 2, L, E)).requires_grad_() for _ in range(3))
                posted.clear()
                out = cp.flex_attention(q, k, v)
                forward = list(posted)
                posted.clear()
                out.sum().backward()
                backward = list(posted)
                shard_bytes = k.numel() * k.element_size()
                report[f"{label}-{schedule}"] = {
                    "forward": forward, "backward": backward, "shard_bytes": shard_bytes,
                    "needs": cp.plan.needs.int().tolist(),
                }
    finally:
        dist.batch_isend_irecv = original
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    return {"ranks": gathered} if rank == 0 else {}


def _errors(case: Case, rank: int) -> dict:
    """What ranks that disagree, and calls that do not fit the plan, are told."""
    from flexattn import create_block_mask
    from flexattn.distributed import ContextParallel
    from flexattn.errors import InvalidInputError
    from flexattn.variants import causal_mask, document_ids, generate_document_mask, generate_sliding_window

    messages = {}

    def expect(label, fn):
        try:
            fn()
        except InvalidInputError as err:
            messages[label] = str(err)
        else:
            messages[label] = None

    L = 128
    # A document mask built from different document ids on the last rank.
    lengths = [40, 88] if rank != dist.get_world_size() - 1 else [72, 56]
    doc = document_ids(lengths, "cpu")
    expect("masks differ", lambda: ContextParallel(
        create_block_mask(generate_document_mask(doc), None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)))
    # The same tables, but a different mask_mod (the window is inside every tile that both keep).
    window = 200 if rank == 0 else 300
    expect("mask_mods differ", lambda: ContextParallel(
        create_block_mask(generate_sliding_window(window), None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)))
    expect("balances differ", lambda: ContextParallel(
        create_block_mask(causal_mask, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK),
        balance="mask" if rank == 0 else "zigzag"))

    cp = ContextParallel(create_block_mask(causal_mask, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK))
    q = torch.randn(1 + (rank == 1), 2, L, E)
    expect("batches differ", lambda: cp.flex_attention(cp.shard(q), cp.shard(q), cp.shard(q)))
    whole = torch.randn(1, 2, L, E)
    expect("unsharded input", lambda: cp.flex_attention(whole, whole, whole))
    expect("bad length for shard", lambda: cp.shard(torch.randn(1, 2, L - 1, E)))
    return {"messages": messages} if rank == 0 else {}


def _mesh(case: Case, rank: int) -> dict:
    """A 1-D DeviceMesh serves as the group, with the default group's result."""
    from torch.distributed.device_mesh import init_device_mesh

    from flexattn import create_block_mask
    from flexattn.distributed import ContextParallel
    from flexattn.variants import causal_mask

    _seed(case)
    bm = create_block_mask(causal_mask, None, None, 128, 128, device="cpu", BLOCK_SIZE=BLOCK)
    q, k, v = (torch.randn(B, 2, 128, E) for _ in range(3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    outs = []
    for group in (None, mesh["cp"]):
        cp = ContextParallel(bm, group=group)
        outs.append(cp.unshard(cp.flex_attention(cp.shard(q), cp.shard(k), cp.shard(v))))
    return {"same": bool(torch.equal(*outs))} if rank == 0 else {}


RUNNERS = {"variant": _variant, "bytes": _bytes, "errors": _errors, "mesh": _mesh}
