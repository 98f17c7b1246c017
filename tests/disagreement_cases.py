"""The disagreement fuzzer's cases: ranks given calls that differ, and the code each rank runs.

A *kind* of difference is one thing a mask or a call can have that differs between ranks (its
lengths, its tables, its code, the tensors or numbers its mods read, the score_mod, options,
dtypes, shapes, whether a gradient is needed), with two *phases*: ``first``, where the first check
of a ContextParallel sees the difference (its construction for a mask's kinds, its first call for
a call's), and ``later``, where the ranks first agree on a construction and a call and then differ.
A case is a kind, a phase, a world size and each rank's *variant* of the kind (0: the agreed call;
1, 2, ...: other ways), so three ranks can differ from each other in two ways.

Every rank runs every case of its spawn in order (gloo, a short timeout) and writes, per case,
what it raised and how long that took; the test asserts that every rank raised the same
RankDisagreementError, promptly, naming the kind's fact and the ranks that differ.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from distributed_cases import spawn_ranks

L, H, E = 128, 2, 16
BLOCK = 32
SPLIT = 40  # the documents' boundary; the variants move it inside the same block (32..63)
# What a hang costs a case (a prompt error takes well under a second); FLEXATTN_FUZZ_TIMEOUT_S sets it.
GLOO_TIMEOUT_S = float(os.environ.get("FLEXATTN_FUZZ_TIMEOUT_S", "20"))
PHASES = ("first", "later")
# "cpu": gloo ranks (the CI); "cuda": NCCL, one GPU per rank (the GPU test sets it).
DEVICE = os.environ.get("FLEXATTN_FUZZ_DEVICE", "cpu")


@dataclass(frozen=True)
class Case:
    kind: str
    phase: str
    world: int
    variants: tuple  # per rank: 0 agrees, 1, 2, ... differ (each in its own way)

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.phase}-{self.world}ranks-" + "".join(map(str, self.variants))

    @property
    def disagree(self) -> bool:
        return len(set(self.variants)) > 1

    @property
    def differing(self) -> list:
        """The ranks not given the agreed variant 0."""
        return [r for r, v in enumerate(self.variants) if v]


@dataclass(frozen=True)
class Kind:
    """One kind of difference. ``first(v)`` and ``later(v)`` run on every rank with its variant
    ``v`` (0: the agreed one); the error must contain ``expect`` (the fact that differs), or
    ``expect_later`` in the later phase when that differs. ``variants``: how many ways of the kind
    there are, 0 included."""

    name: str
    expect: str
    first: Callable[[int], None]
    later: Callable[[int], None]
    variants: int = 2
    expect_later: str = ""

    def expected(self, phase: str) -> str:
        return self.expect_later if phase == "later" and self.expect_later else self.expect


# ---------------------------------------------------------------------------------------------
# What the ranks build
# ---------------------------------------------------------------------------------------------


def _documents(split: int = SPLIT, dtype=torch.int32) -> torch.Tensor:
    doc = torch.zeros(L, dtype=dtype, device=DEVICE)
    doc[split:] = 1
    return doc


def _document_mask(doc: torch.Tensor):
    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return same_document


def _block_mask(mask_mod, length: int = L):
    from flexattn import create_block_mask

    return create_block_mask(mask_mod, None, None, length, length, device=DEVICE, BLOCK_SIZE=BLOCK)


def _cp(block_mask=None, **kwargs):
    from flexattn.distributed import ContextParallel

    if block_mask is None:
        block_mask = _block_mask(_document_mask(_documents()))
    return ContextParallel(block_mask, **kwargs)


def _shards(cp, batch: int = 1, heads: int = H, dtype=torch.float32, requires_grad: bool = False):
    generator = torch.Generator().manual_seed(0)  # the same global tensors on every rank
    lengths = zip(cp.plan.block_mask.seq_lengths + cp.plan.block_mask.seq_lengths[1:], ("query", "key", "key"))
    return [cp.shard(torch.randn(batch, heads, n, E, generator=generator).to(DEVICE, dtype), role)
            .requires_grad_(requires_grad) for n, role in lengths]


# Mods. The variants of a kind pick among these by index.


def _scaled(score, b, h, q_idx, kv_idx):
    return score * 0.5


def _shifted(score, b, h, q_idx, kv_idx):
    return score - 0.25


def _rescaled(score, b, h, q_idx, kv_idx):
    return score * 0.75


def _alibi_mod(slopes: torch.Tensor):
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi


def _soft_cap_mod(cap: float):
    def soft_cap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return soft_cap


def _untraceable(score, b, h, q_idx, kv_idx):
    if score > 0:  # control flow on a tensor: does not trace
        return score
    return -score


def _aux(max_scores: bool):
    from flexattn import AuxRequest

    return AuxRequest(lse=True, max_scores=max_scores)


def _call_kind(name: str, expect: str, call: Callable[[int], dict], inputs: Callable[[int], dict] = lambda v: {},
               variants: int = 2) -> Kind:
    """A kind whose difference is in one call: ``call(v)`` gives cp.flex_attention's keywords and
    ``inputs(v)`` _shards' (v = 0: the agreed call)."""

    def run(cp, v):
        cp.flex_attention(*_shards(cp, **inputs(v)), **call(v))

    def first(v):
        run(_cp(), v)

    def later(v):
        cp = _cp()
        run(cp, 0)
        run(cp, v)

    return Kind(name, expect, first, later, variants)


# ---------------------------------------------------------------------------------------------
# The kinds: masks (construction first), then calls
# ---------------------------------------------------------------------------------------------


def _lengths_first(v):
    _cp(_block_mask(_document_mask(_documents()), length=L + BLOCK * v))


def _lengths_later(v):
    cp = _cp()
    cp.flex_attention(*_shards(cp))
    q, k, w = _shards(cp)
    cp.flex_attention(q[:, :, : q.shape[2] - v], k, w)  # not this rank's shard: raises on this rank


def _tables(v):
    """Tables the mask_mod does not decide (from_kv_blocks, noop mask_mod): row 0 lists blocks
    {0, 3}, {1, 2} or {0, 2}; the first two have the same count and the same sum of indices."""
    from flexattn import BlockMask

    rows = L // BLOCK
    num = torch.full((1, 1, rows), 2, dtype=torch.int32)
    idx = torch.tensor([[0, 3], [0, 1], [0, 2], [2, 3]], dtype=torch.int32)
    idx[0] = torch.tensor([[0, 3], [1, 2], [0, 2]][v])
    return BlockMask.from_kv_blocks(num.to(DEVICE), idx.view(1, 1, rows, 2).to(DEVICE), BLOCK_SIZE=BLOCK,
                                    seq_lengths=(L, L))


def _tables_later(v):
    # Every rank builds one ContextParallel per table; the ranks of variant v call the v-th.
    objects = [_cp(_tables(t)) for t in range(3)]
    objects[0].flex_attention(*_shards(objects[0]))
    objects[v].flex_attention(*_shards(objects[v]))


def _mask_code_first(v):
    doc = _documents()

    def same_document_near(b, h, q_idx, kv_idx):  # another function, the same tables
        return (doc[q_idx] == doc[kv_idx]) & (q_idx - kv_idx < 10 * L)

    _cp(_block_mask(same_document_near if v else _document_mask(doc)))


def _mask_code_later(v):
    doc = _documents()
    rule = [lambda q_idx, kv_idx: doc[q_idx] == doc[kv_idx]]  # code the mask_mod reaches, replaceable

    def by_rule(b, h, q_idx, kv_idx):
        return rule[0](q_idx, kv_idx)

    cp = _cp(_block_mask(by_rule))
    cp.flex_attention(*_shards(cp))
    if v:
        rule[0] = lambda q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (q_idx - kv_idx < 10 * L)
    cp.flex_attention(*_shards(cp))


def _window_mask(window: int):
    def near(b, h, q_idx, kv_idx):  # wider than the sequence: the same tables for every window
        return (q_idx - kv_idx < window) & (kv_idx - q_idx < window)

    return near


def _mask_number_later(v):
    window = 4 * L

    def near(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < window) & (kv_idx - q_idx < window)

    cp = _cp(_block_mask(near))
    cp.flex_attention(*_shards(cp))
    if v:
        window = 4 * L + v  # rebinds the cell the mask_mod reads
    cp.flex_attention(*_shards(cp))


def _mask_tensor_first(v):
    _cp(_block_mask(_document_mask(_documents(SPLIT + v))))  # a boundary moved inside one tile (issue 50, 7)


def _mask_tensor_later(v):
    doc = _documents()
    cp = _cp(_block_mask(_document_mask(doc)))
    cp.flex_attention(*_shards(cp))
    if v:
        doc[SPLIT:SPLIT + v] = 0  # in place: the same tensor, code and shape, other contents
    cp.flex_attention(*_shards(cp))


def _mask_dtype_first(v):
    _cp(_block_mask(_document_mask(_documents(dtype=torch.int64 if v else torch.int32))))


def _mask_dtype_later(v):
    docs = [_documents()]

    def same_document(b, h, q_idx, kv_idx):
        return docs[0][q_idx] == docs[0][kv_idx]

    cp = _cp(_block_mask(same_document))
    cp.flex_attention(*_shards(cp))
    if v:
        docs[0] = docs[0].long()  # the same values in another dtype
    cp.flex_attention(*_shards(cp))


_BALANCES = ("mask", "zigzag", "contiguous")
_SCHEDULES = ("ring", "allgather")


def _objects_later(v, **options_of_variant):
    """Every rank builds one ContextParallel per variant, agreed; the ranks of variant v call the
    v-th (two objects over one group, mixed up)."""
    (name, values), = options_of_variant.items()
    objects = [_cp(**{name: value}) for value in values]
    objects[0].flex_attention(*_shards(objects[0]))
    objects[v].flex_attention(*_shards(objects[v]))  # its own shards: only which object differs


def _auto_setup(limit_of_variant: Callable[[int], int], v: int):
    """A mask and a cost model under which schedule="auto" picks the gather at this world size
    (where fixed costs per step dominate: the step latency at 3 ranks and more, the merge of a
    cross-attention's long query shards at 2), and the ranks of variant v a gather limit."""
    from flexattn import create_block_mask
    from flexattn.distributed import CostModel, Plan, Problem

    world = dist.get_world_size()
    latency = CostModel(flops_per_s=1e15, link_bytes_per_s=1e12, step_latency_s=1.0, memory_bytes_per_s=1e12)
    memory = CostModel(flops_per_s=1e15, link_bytes_per_s=1e15, step_latency_s=0.0, memory_bytes_per_s=1e3)
    cross = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 4 * L, L, device=DEVICE,
                              BLOCK_SIZE=BLOCK)
    for block_mask, model in ((_block_mask(_document_mask(_documents())), latency), (cross, memory)):
        plan = Plan(block_mask, world, "mask", "auto", model)
        if plan.choose_schedule(Problem(1, H, 1, H, E, E, 4)) == "allgather":
            break
    else:
        raise AssertionError(f"no setup of the cost_model kind picks the gather at {world} ranks")
    most_received = max(int(row.sum()) for row in plan.needs)  # the own shard included: an upper bound
    batch_one = most_received * Problem(1, H, 1, H, E, E, 4).shard_bytes(plan.kv_layout.local_length)
    limit = limit_of_variant(batch_one) if v else 1 << 40
    return block_mask, CostModel(**{**vars(model), "gather_limit_bytes": limit})


def _cost_model_first(v):
    # The ranks of variant v may hold no gather at all: they pick the ring.
    block_mask, model = _auto_setup(lambda batch_one: 1, v)
    cp = _cp(block_mask, schedule="auto", cost_model=model)
    cp.flex_attention(*_shards(cp))


def _cost_model_later(v):
    # The ranks of variant v may hold a batch-1 call's gather, not a batch-2 call's.
    block_mask, model = _auto_setup(lambda batch_one: batch_one, v)
    cp = _cp(block_mask, schedule="auto", cost_model=model)
    cp.flex_attention(*_shards(cp))
    cp.flex_attention(*_shards(cp, batch=2))


def _score_tensor_first(v):
    cp = _cp()
    cp.flex_attention(*_shards(cp), score_mod=_alibi_mod(torch.tensor([0.5, 0.25], device=DEVICE) * (1 + v)))


def _score_tensor_later(v):
    slopes = torch.tensor([0.5, 0.25], device=DEVICE)
    alibi = _alibi_mod(slopes)
    cp = _cp()
    cp.flex_attention(*_shards(cp), score_mod=alibi)
    if v:
        slopes.mul_(1 + v)  # in place: the same callable, tensor, code and shape, other contents
    cp.flex_attention(*_shards(cp), score_mod=alibi)


def _number_first(v):
    cp = _cp()
    cp.flex_attention(*_shards(cp), score_mod=_soft_cap_mod(20.0 + 10 * v))


def _number_later(v):
    cap = 20.0

    def soft_cap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    cp = _cp()
    cp.flex_attention(*_shards(cp), score_mod=soft_cap)
    if v:
        cap = 20.0 + 10 * v  # rebinds the cell the same callable reads
    cp.flex_attention(*_shards(cp), score_mod=soft_cap)


def _unshard_first(v):
    cp = _cp()
    shard = _shards(cp)[0]
    cp.unshard(shard[:, :1] if v else shard)


def _unshard_later(v):
    cp = _cp()
    out = cp.flex_attention(*_shards(cp))
    cp.unshard(out[:, :1] if v else out)


KINDS = {kind.name: kind for kind in [
    Kind("lengths", "Q_LEN, KV_LEN", _lengths_first, _lengths_later, expect_later="raised InvalidInputError"),
    Kind("tables", "partial tiles", lambda v: _cp(_tables(v)), _tables_later, variants=3,
         expect_later="the ContextParallel called"),
    Kind("mask_mod code", "the mask_mod's traced graph", _mask_code_first, _mask_code_later),
    # A Python number the mask_mod reads: in its traced graph today, a kernel argument once numbers
    # are passed at run time; either way a difference must raise.
    Kind("mask_mod number", "the mask_mod", lambda v: _cp(_block_mask(_window_mask(4 * L + v))), _mask_number_later,
         variants=3),
    Kind("mask_mod tensor", "the contents of the mask_mod's captured input 'doc'", _mask_tensor_first,
         _mask_tensor_later, variants=3),
    Kind("mask_mod tensor dtype", "the dtype and shape of the mask_mod's captured input", _mask_dtype_first,
         _mask_dtype_later),
    Kind("balance", "balance", lambda v: _cp(balance=_BALANCES[v]),
         lambda v: _objects_later(v, balance=_BALANCES), variants=3, expect_later="the ContextParallel called"),
    Kind("schedule", "schedule", lambda v: _cp(schedule=_SCHEDULES[v]),
         lambda v: _objects_later(v, schedule=_SCHEDULES), expect_later="the ContextParallel called"),
    Kind("cost_model", "schedule chosen", _cost_model_first, _cost_model_later),
    _call_kind("score_mod code", "the score_mod's traced graph",
               lambda v: {"score_mod": (_scaled, _shifted, _rescaled)[v]}, variants=3),
    _call_kind("score_mod given", "score_mod given", lambda v: {"score_mod": _scaled if v else None}),
    Kind("score_mod tensor", "the contents of the score_mod's captured input 'slopes'", _score_tensor_first,
         _score_tensor_later, variants=3),
    # A Python number a mod reads: in its traced graph today, a kernel argument once numbers are
    # passed at run time; either way a difference must raise.
    Kind("number", "the score_mod", _number_first, _number_later, variants=3),
    _call_kind("scale", "scale", lambda v: {"scale": 0.25 * (1 + v)}, variants=3),
    _call_kind("kernel_options", "kernel_options", lambda v: {"kernel_options": {"BACKEND": "PYTORCH"} if v else None}),
    _call_kind("max_scores", "max_scores requested", lambda v: {"return_aux": _aux(bool(v))}),
    _call_kind("enable_gqa", "enable_gqa", lambda v: {"enable_gqa": bool(v)}),
    _call_kind("dtype", "dtype", lambda v: {}, lambda v: {"dtype": (torch.float32, torch.float64, torch.bfloat16)[v]},
               variants=3),
    _call_kind("batch", "batch", lambda v: {}, lambda v: {"batch": 1 + v}, variants=3),
    _call_kind("heads", "heads", lambda v: {}, lambda v: {"heads": H * (1 + v)}),
    _call_kind("gradient", "gradient needed", lambda v: {}, lambda v: {"requires_grad": bool(v)}),
    _call_kind("untraceable score_mod", "raised ModTraceError", lambda v: {"score_mod": _untraceable if v else None}),
    Kind("unshard", "cp.unshard", _unshard_first, _unshard_later),
]}


# ---------------------------------------------------------------------------------------------
# Which cases run
# ---------------------------------------------------------------------------------------------


def ci_cases(world: int) -> list:
    """Every kind in both phases; at 2 ranks rank 1 differs, at 3 ranks rank 1 differs one way and
    rank 2 another where the kind has two ways (else rank 1 alone). Then the same calls with every
    rank agreeing, which must not raise (the facts are the same in every process)."""
    found = []
    for kind in KINDS.values():
        for phase in PHASES:
            if world == 2:
                variants = (0, 1)
            else:
                variants = (0, 1, 2) if kind.variants > 2 else (0, 1, 0)
            found.append(Case(kind.name, phase, world, variants))
    found += [Case(kind.name, phase, world, (0,) * world) for kind in KINDS.values() for phase in PHASES]
    return found


def long_cases(world: int, seed: int, count: int) -> list:
    """Random cases: a kind, a phase, and for each rank a variant (at least one rank differs)."""
    chooser = random.Random(seed * 1000 + world)
    found = []
    for _ in range(count):
        kind = chooser.choice(list(KINDS.values()))
        variants = [chooser.randrange(kind.variants) for _ in range(world)]
        while len(set(variants)) == 1:  # at least two ways among the ranks
            variants[chooser.randrange(world)] = chooser.randrange(kind.variants)
        found.append(Case(kind.name, chooser.choice(PHASES), world, tuple(variants)))
    return found


# ---------------------------------------------------------------------------------------------
# Running them
# ---------------------------------------------------------------------------------------------


def run(world: int, cases: list, out_dir: str, timeout: float):
    """Run ``cases`` on ``world`` gloo ranks; returns (per case id, every rank's outcome, in rank
    order), the failure or None)."""
    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump([asdict(c) for c in cases], f)
    failure = spawn_ranks(_rank_main, world, (out_dir,), timeout)
    outcomes: dict = {}
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    entry = json.loads(line)
                    outcomes.setdefault(entry["case"], [None] * world)[rank] = entry
    return outcomes, failure


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # the ranks share 2 cores
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    with open(os.path.join(out_dir, "cases.json")) as f:
        cases = [Case(c["kind"], c["phase"], c["world"], tuple(c["variants"])) for c in json.load(f)]
    try:
        with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "w") as f:
            for case in cases:
                kind = KINDS[case.kind]
                variant = case.variants[rank]
                start = time.monotonic()
                entry = {"case": case.id, "raised": None}
                try:
                    (kind.first if case.phase == "first" else kind.later)(variant)
                except Exception as err:
                    entry.update(raised=type(err).__name__, message=str(err),
                                 traceback=None if type(err).__name__ == "RankDisagreementError"
                                 else traceback.format_exc())
                entry["seconds"] = time.monotonic() - start
                f.write(json.dumps(entry) + "\n")
                f.flush()
                dist.barrier()  # a case that left the ranks out of step ends the run here, not later
    finally:
        dist.destroy_process_group()
