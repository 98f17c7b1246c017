"""Context parallelism (flexattn.distributed) on gloo ranks started from this file, and its plan.

Two spawns (2 and 4 ranks) run every case of tests/distributed_cases.py in the same processes:
every catalogue entry, forward and backward (gradients of q, k, v and of learnable tensors), in
all three balance modes with the ring, and with the gather; GQA, cross-attention lengths, the LSE
and max_scores, a few cases through the Triton kernels (the interpreter); the bytes each rank
sends and receives; and the errors of disagreeing ranks. Rank 0 compares the unsharded results
with single-process flexattn and the float64 reference. The plan's tests (balance, padding,
skipping, the cost model's choice) need no ranks.
"""

import pytest
import torch
from distributed_cases import ODD, cases, ranks_started_once

from flexattn import create_block_mask
from flexattn.distributed import CostModel, Plan, Problem
from flexattn.distributed.step import merge_into
from flexattn.errors import InvalidInputError
from flexattn.variants import (
    causal_mask, document_ids, generate_document_mask, generate_sliding_window, split_lengths,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FLEXATTN_TOL = 1e-5  # against single-process flexattn: the same kernels, summed in another order
FWD_TOL = 2e-5  # against the float64 reference, as tests/test_variants.py
LEARNABLE_TOL = 1e-4
WORLDS = (2, 4)
TIMEOUT = {2: 240, 4: 300}

CASES = [case for world in WORLDS for case in cases(world)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """World size -> (rank 0's results by case id, failure or None), each world started once."""
    return ranks_started_once(tmp_path_factory, "distributed", TIMEOUT)


def _result(ranks, case):
    results, failure = ranks(case.world)
    entry = results.get(case.id)
    if entry is None:
        pytest.fail(f"no result for {case.id}: {failure}")
    if "traceback" in entry:
        pytest.fail(f"{case.id} raised on rank 0:\n{entry['traceback']}")
    return entry


@pytest.mark.parametrize("case", [c for c in CASES if c.kind == "variant"], ids=lambda c: c.id)
def test_variant(ranks, case):
    entry = _result(ranks, case)
    assert entry["schedule"] == case.schedule
    assert entry["backends"] == [case.backend]
    if case.backend == "TRITON":
        assert entry["triton_backwards"] > 0, "the backward did not run the Triton kernels"
        # Every step after a row's first merged in its kernel ([Note] The merge in the kernel, ring.py).
        assert entry["merges"]["merge_into"] == 0, entry["merges"]
    else:
        assert entry["merges"]["in_kernel"] == 0, entry["merges"]
    for name, flex, ref, nan, same_shape in zip(entry["names"], entry["vs_flexattn"], entry["vs_reference"],
                                               entry["nan"], entry["shapes_match"]):
        assert same_shape and not nan, name
        learnable = name.startswith("d(learnable")
        assert flex < (LEARNABLE_TOL if learnable else FLEXATTN_TOL), f"{name} against flexattn: {flex:.2e}"
        assert ref < (LEARNABLE_TOL if learnable else FWD_TOL), f"{name} against the reference: {ref:.2e}"


@pytest.mark.parametrize("world", WORLDS)
def test_skipped_shards_are_never_sent(ranks, world):
    """Each rank posts exactly the transfers the plan's needs call for: K/V of shard j to rank i
    only if i needs j (forward and backward), dK/dV of shard j back from i only if i needs j. The
    bytes each rank receives are counted from the ops it posted."""
    (case,) = [c for c in CASES if c.kind == "bytes" and c.world == world]
    reports = _result(ranks, case)["ranks"]
    skipped_somewhere = False
    for label in reports[0]:
        needs = reports[0][label]["needs"]
        shard = reports[0][label]["shard_bytes"]  # K (or V: same shape here) of one shard
        for rank, report in enumerate(reports):
            entry = report[label]
            wanted = [j for j in range(world) if j != rank and needs[rank][j]]
            skipped_somewhere |= len(wanted) < world - 1
            serving = [i for i in range(world) if i != rank and needs[i][rank]]
            for phase, kv_rounds in (("forward", 1), ("backward", 1)):
                ops = entry[phase]
                received = sorted(peer for kind, peer, _ in ops if kind == "recv")
                sent = sorted(peer for kind, peer, _ in ops if kind == "send")
                # K and V per needed shard; the backward adds dK and dV of the own shard from each
                # rank that needed it, and sends dK, dV to each shard it needed.
                expected_in = sorted(wanted * 2 * kv_rounds + (serving * 2 if phase == "backward" else []))
                expected_out = sorted(serving * 2 * kv_rounds + (wanted * 2 if phase == "backward" else []))
                assert received == expected_in, f"{label} rank {rank} {phase}: received from {received}"
                assert sent == expected_out, f"{label} rank {rank} {phase}: sent to {sent}"
                assert sum(n for kind, _, n in ops if kind == "recv") == len(expected_in) * shard
    assert skipped_somewhere, "the masks of this test should let some rank skip a shard"


@pytest.mark.parametrize("world", WORLDS)
def test_disagreeing_ranks_get_clear_errors(ranks, world):
    (case,) = [c for c in CASES if c.kind == "errors" and c.world == world]
    messages = _result(ranks, case)["messages"]
    # The last rank's mask differs: the ranks that agree, then it (tests/test_cp_disagreement.py
    # runs every kind of difference).
    named = {2: "rank 0 has one, rank 1 another", 4: "ranks 0, 1, 2 have one, rank 3 another"}[world]
    assert "partial tiles" in messages["masks differ"] and named in messages["masks differ"]
    assert "the mask_mod" in messages["mask_mods differ"]  # a window read by the mask_mod
    assert "balance" in messages["balances differ"]
    assert "batch" in messages["batches differ"] and "the call" in messages["batches differ"]
    assert "cp.shard" in messages["unsharded input"]
    assert "Q_LEN or KV_LEN" in messages["bad length for shard"]


@pytest.mark.parametrize("world", WORLDS)
def test_a_device_mesh_is_a_group(ranks, world):
    (case,) = [c for c in CASES if c.kind == "mesh" and c.world == world]
    assert _result(ranks, case)["same"]


# ---------------------------------------------------------------------------------------------
# The plan, in one process
# ---------------------------------------------------------------------------------------------


def _document_mask(length, docs, seed=0):
    doc = document_ids(split_lengths(length, docs, seed=seed), "cpu")
    return create_block_mask(generate_document_mask(doc), None, None, length, length, device="cpu", BLOCK_SIZE=32)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mask", ["causal", "document"])
def test_mask_balance_is_within_one_tile_of_even(mask, world):
    # Equal shards cannot always be this even: a row that crosses a document boundary carries a
    # lump of partial tiles, which few units per rank cannot offset (docs/context_parallel.md).
    # These documents allow it.
    length = 4096  # 128 units of 32 tokens
    if mask == "causal":
        bm = create_block_mask(causal_mask, None, None, length, length, device="cpu", BLOCK_SIZE=32)
    else:
        bm = _document_mask(length, 8, seed=1)
    plan = Plan(bm, world, balance="mask")
    full, partial = plan.rank_tiles()
    for counts in (full, partial):
        even = counts.sum().item() / world
        assert (counts.double() - even).abs().max().item() <= 1.0, counts.tolist()
    # The permutation is a permutation, and every rank holds as many units.
    units = plan.q_layout.units
    assert sorted(units.reshape(-1).tolist()) == list(range(units.numel()))
    if mask == "causal":  # contiguous is far from even
        contiguous = Plan(bm, world, balance="contiguous").rank_tiles()[0]
        assert contiguous.max() - contiguous.min() > 100


def test_mask_balance_keeps_a_window_local():
    # Equal work everywhere but the first rows: the balance stays near contiguous, so each rank
    # needs its neighbour's keys only, not everyone's.
    # (The first rows' deficit makes one tile of even impossible here: the rank holding row 0
    # lacks 2 full tiles, the total is 253.)
    bm = create_block_mask(generate_sliding_window(96), None, None, 4096, 4096, device="cpu", BLOCK_SIZE=32)
    plan = Plan(bm, 4, balance="mask")
    full, partial = plan.rank_tiles()
    assert full.tolist() == [62, 63, 64, 64] or sorted(full.tolist()) == [62, 63, 64, 64]
    assert partial.max() - partial.min() <= 1
    assert int(plan.needs.sum()) <= 10, plan.needs.int().tolist()  # the sorted deal needs all 16


def test_contiguous_causal_skips_later_shards():
    bm = create_block_mask(causal_mask, None, None, 512, 512, device="cpu", BLOCK_SIZE=32)
    plan = Plan(bm, 4, balance="contiguous")
    assert torch.equal(plan.needs, torch.ones(4, 4, dtype=torch.bool).tril())
    ring = plan.rank_plan(0, "ring")
    assert ring.received_shards() == 0 and ring.sent_shards() == 3 and len(ring.steps) == 1
    last = plan.rank_plan(3, "ring")
    assert [step.sources for step in last.steps] == [(3,), (2,), (1,), (0,)]
    gather = plan.rank_plan(3, "allgather")
    assert [step.sources for step in gather.steps] == [(3, 2, 1, 0)]


def test_padding_rule():
    # Units of lcm(Q_BLOCK, KV_BLOCK) tokens; a whole number of units per rank, two for zigzag.
    bm = create_block_mask(causal_mask, None, None, 1000, 1000, device="cpu", BLOCK_SIZE=64)
    assert Plan(bm, 4, "mask").q_layout.padded_length == 1024
    assert Plan(bm, 3, "contiguous").q_layout.padded_length == 1152
    assert Plan(bm, 4, "zigzag").q_layout.padded_length == 1024
    assert Plan(bm, 3, "zigzag").q_layout.padded_length == 1152
    bm = create_block_mask(causal_mask, None, None, 1000, 1000, device="cpu", BLOCK_SIZE=(64, 32))
    plan = Plan(bm, 2, "mask")
    assert plan.q_layout is plan.kv_layout and plan.q_layout.unit == 64


def test_cross_attention_layouts():
    bm = create_block_mask(lambda b, h, q, kv: q >= 0, None, None, 300, 100, device="cpu", BLOCK_SIZE=32)
    plan = Plan(bm, 2, "zigzag")
    assert plan.q_layout is not plan.kv_layout
    assert plan.q_layout.padded_length == 384 and plan.kv_layout.padded_length == 128
    assert plan.kv_layout.units.tolist() == [[0, 1], [2, 3]]


def test_step_masks_cover_the_global_mask_once():
    # Every visited tile of rank r's rows appears in exactly one of its steps, in both schedules.
    bm = _document_mask(ODD, 5)
    for world in (2, 4):
        plan = Plan(bm, world, "mask")
        for schedule in ("ring", "allgather"):
            for rank in range(world):
                steps = plan.rank_plan(rank, schedule).steps
                full = sum(s.full_tiles for s in steps)
                partial = sum(s.partial_tiles for s in steps)
                assert (full, partial) == (int(plan.full_tiles[rank].sum()), int(plan.partial_tiles[rank].sum()))
                counted = sum(int(s.block_mask.kv_num_blocks.sum()) + int(s.block_mask.full_kv_num_blocks.sum())
                              for s in steps)
                assert counted == full + partial


def test_auto_schedule_follows_the_cost_model():
    bm = create_block_mask(causal_mask, None, None, 512, 512, device="cpu", BLOCK_SIZE=32)
    small = Problem(1, 2, 1, 2, 16, 16, 4)
    slow_link = CostModel(flops_per_s=1e15, link_bytes_per_s=1e6, step_latency_s=1e-3, memory_bytes_per_s=1e12)
    assert Plan(bm, 4, "zigzag", "auto", slow_link).choose_schedule(small) == "allgather"  # latency-bound
    tiny_budget = CostModel(flops_per_s=1e15, link_bytes_per_s=1e6, step_latency_s=1e-3, memory_bytes_per_s=1e12,
                            gather_limit_bytes=1)
    assert Plan(bm, 4, "zigzag", "auto", tiny_budget).choose_schedule(small) == "ring"  # too big to gather
    slow_kernel = CostModel(flops_per_s=1e6, link_bytes_per_s=1e12, step_latency_s=0.0, memory_bytes_per_s=1e6)
    assert Plan(bm, 4, "zigzag", "auto", slow_kernel).choose_schedule(small) == "ring"  # transfers hide


def test_bad_arguments():
    bm = create_block_mask(causal_mask, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(InvalidInputError, match="balance must be one of"):
        Plan(bm, 2, balance="round_robin")
    with pytest.raises(InvalidInputError, match="schedule must be one of"):
        Plan(bm, 2, schedule="tree")
    with pytest.raises(InvalidInputError, match="rows were"):
        Plan(bm[:, :, 1:], 2)


def test_merge_is_exact_and_keeps_empty_rows_at_zero():
    torch.manual_seed(0)
    scores = torch.randn(1, 1, 3, 10, dtype=torch.float64)
    scores[0, 0, 0] = -torch.inf  # a row no step keeps
    scores[0, 0, 1, :5] = -torch.inf  # a row only the second step keeps
    values = torch.randn(1, 1, 10, 4, dtype=torch.float64)

    def partial(lo, hi):
        s = scores[..., lo:hi]
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isneginf(lse), 0, lse).unsqueeze(-1))
        return p @ values[:, :, lo:hi], lse

    out, lse = partial(0, 5)
    merge_into(out, lse, *partial(5, 10))
    want, want_lse = partial(0, 10)
    assert not torch.isnan(out).any() and torch.equal(out[0, 0, 0], torch.zeros(4))
    assert torch.isneginf(lse[0, 0, 0]) and torch.allclose(lse[0, 0, 1:], want_lse[0, 0, 1:])
    assert torch.allclose(out, want)


def test_one_gpu_script_runs_small_on_the_cpu(tmp_path):
    # The GPU run's own code (ranks as streams, the check, the timings) and the model, at tiny sizes.
    import json

    from benchmarks import context_parallel

    out = tmp_path / "cp.json"
    assert context_parallel.main(["--smoke", "--masks", "causal,alibi", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {row["mask"] for row in report["runs"]} == {"causal", "alibi"}
    for row in report["runs"]:
        assert row["out_ok"] and row["dq_ok"] and row["dk_ok"] and row["dv_ok"], row
        assert all(step["kernel_ms"] > 0 for steps in row["steps"] for step in steps)
        # The ring merged in the portable kernels (the interpreter here), checked and timed too.
        assert row["fused_out_ok"], row
        assert all(step["fused_ms"] > 0 for steps in row["steps"] for step in steps)
        assert row["slowest_rank_fused_ms"] > 0 and row["slowest_rank_separate_ms"] > 0
    assert {row["mask"] for row in report["model"]["rows"]} == {"causal", "document", "sliding_window"}


@pytest.mark.parametrize("backend", ["TRITON", "PYTORCH"])
def test_dk_dv_parts_come_back_unrounded(backend):
    # A key's dK/dV is a sum of parts from several ranks: each part stays float32 until the sum,
    # so bf16 inputs lose no more than one GPU's rounding (parts rounded to bf16 doubled dV's error).
    from benchmarks.context_parallel import SimulatedRanks, shard
    from flexattn.distributed.step import step_call

    torch.manual_seed(0)
    L, H, E = 256, 2, 16
    block_mask = create_block_mask(causal_mask, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    q, k, v = (torch.randn(1, H, L, E).to(torch.bfloat16) for _ in range(3))
    plan = Plan(block_mask, 2, balance="mask", schedule="ring")
    ranks = SimulatedRanks(plan, q, k, v, None, E ** -0.5)
    out, lse = ranks.forward()[0]
    grad_out = shard(torch.randn_like(q), plan.q_layout, 0)
    for step in plan.rank_plan(0, "ring").steps:
        sc = step_call(step, None, torch.int32, ranks.q[0], {"BACKEND": backend}, E ** -0.5, True, False)
        assert sc.call.backend == backend
        (source,) = step.sources
        _, gk, gv, _ = sc.backward(ranks.q[0], ranks.k[source], ranks.v[source], out, lse, grad_out, None)
        assert gk.dtype == gv.dtype == torch.float32
        assert not torch.equal(gv, gv.to(torch.bfloat16).float())  # really unrounded


def test_float32_and_rounded_kv_grads_of_one_shape_keep_their_own_plans():
    # The backward's plans are cached by shapes; dK/dV in float32 or in the inputs' dtype must not
    # share one (a plan made for bf16 dK/dV would write bf16 into a float32 buffer, or back).
    from benchmarks.context_parallel import SimulatedRanks, shard
    from flexattn.dispatch import run_backward, use_tanh_approx
    from flexattn.kernels import backward_kernel
    from flexattn.distributed.step import step_call

    torch.manual_seed(1)
    L, H, E = 128, 2, 16
    block_mask = create_block_mask(causal_mask, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    q, k, v = (torch.randn(1, H, L, E).to(torch.bfloat16) for _ in range(3))
    plan = Plan(block_mask, 2, balance="contiguous", schedule="ring")
    ranks = SimulatedRanks(plan, q, k, v, None, E ** -0.5)
    out, lse = ranks.forward()[1]
    grad_out = shard(torch.randn_like(q), plan.q_layout, 1)
    step = plan.rank_plan(1, "ring").steps[0]
    sc = step_call(step, None, torch.int32, ranks.q[1], {"BACKEND": "TRITON"}, E ** -0.5, True, False)
    (source,) = step.sources
    args = (sc.call, ranks.q[1], ranks.k[source], ranks.v[source], out, lse, grad_out, None, [])
    kernel = backward_kernel(sc.call.score, sc.call.mask, tanh_approx=use_tanh_approx(ranks.q[1], sc.call.options))
    rounded = run_backward(*args)
    plans = len(kernel._plans)
    unrounded = run_backward(*args, float32_kv_grads=True)
    assert len(kernel._plans) == plans + 1  # a plan of its own (the compiled kernel is typed by dK's dtype)
    again = run_backward(*args)
    assert len(kernel._plans) == plans + 1
    assert rounded[1].dtype == again[1].dtype == torch.bfloat16 and unrounded[1].dtype == torch.float32
    assert torch.equal(rounded[2], again[2])
    # the same values, to one bf16 rounding (the kernel's conversion may round otherwise than torch's)
    assert torch.allclose(unrounded[2], rounded[2].float(), rtol=2 ** -7, atol=1e-6)
