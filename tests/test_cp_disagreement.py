"""The disagreement fuzzer: ranks of a ContextParallel given masks or calls that differ all raise
the same RankDisagreementError, promptly, naming what differs and which ranks (issue 50, items 7
and 8).

Every kind of difference (tests/disagreement_cases.py: lengths, tables, code, captured tensors and
numbers, score_mods, options, dtypes, shapes, gradients, a rank whose own checks fail) in its first
and later phase, at 2 and 3 gloo ranks, and the same calls with every rank agreeing: one spawn per
world size runs them all (about 25 s for both on 2 cores). ``FLEXATTN_FUZZ_LONG=1`` adds random cases (random kinds, phases and variants per
rank, 2 to 4 ranks; ``FLEXATTN_FUZZ_SEED``, ``FLEXATTN_FUZZ_COUNT``). The digests' own
properties need no ranks. On a machine with two GPUs the GPU tests run the CI slice under NCCL and
check that a digest is the same on the GPU as on the CPU.
"""

import os

import pytest
import torch
from disagreement_cases import GLOO_TIMEOUT_S, KINDS, Case, ci_cases, long_cases, run

from flexattn.distributed.agreement import entries_digest, tensor_digest

pytestmark = pytest.mark.usefixtures("one_thread")

WORLDS = (2, 3)
SPAWN_TIMEOUT_S = 240  # a whole spawn; a hang costs each case GLOO_TIMEOUT_S before it
PROMPT_S = GLOO_TIMEOUT_S / 2  # an error raised without waiting for the timeout (a hang costs all of it)
LONG = os.environ.get("FLEXATTN_FUZZ_LONG") == "1"
LONG_SEED = int(os.environ.get("FLEXATTN_FUZZ_SEED", "0"))
LONG_COUNT = int(os.environ.get("FLEXATTN_FUZZ_COUNT", "60"))


def _cases(world: int, long: bool) -> list:
    return long_cases(world, LONG_SEED, LONG_COUNT) if long else ci_cases(world)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """(world, long) -> (outcomes by case id, failure or None), each spawn run once."""
    started = {}

    def outcomes(world, long=False):
        if (world, long) not in started:
            out_dir = str(tmp_path_factory.mktemp(f"fuzz{world}{'long' if long else ''}"))
            timeout = SPAWN_TIMEOUT_S * (4 if long else 1)
            started[world, long] = run(world, _cases(world, long), out_dir, timeout)
        return started[world, long]

    return outcomes


def _ranks_text(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _check(spawn: tuple, case: Case) -> None:
    """``spawn``: what disagreement_cases.run returned for a run holding ``case``."""
    outcomes, failure = spawn
    per_rank = outcomes.get(case.id)
    if per_rank is None or None in per_rank:
        pytest.fail(f"{case.id}: not every rank reported ({failure})")
    if not case.disagree:  # every rank agrees: nothing raises
        for rank, entry in enumerate(per_rank):
            assert entry["raised"] is None, f"{case.id}: rank {rank} raised\n{entry['traceback'] or entry['message']}"
        return
    for rank, entry in enumerate(per_rank):
        assert entry["raised"] == "RankDisagreementError", (
            f"{case.id}: rank {rank} raised {entry['raised']}\n{entry.get('traceback') or entry.get('message')}")
        assert entry["seconds"] < PROMPT_S, f"{case.id}: rank {rank} took {entry['seconds']:.1f} s"
    message = per_rank[0]["message"]
    assert all(entry["message"] == message for entry in per_rank), [e["message"] for e in per_rank]
    kind = KINDS[case.kind]
    assert kind.expected(case.phase) in message, message
    # The ranks that differ are named apart from those that agree (variants of one way together).
    by_variant: dict = {}
    for rank, variant in enumerate(case.variants):
        by_variant.setdefault(variant, []).append(rank)
    if "raised" in kind.expected(case.phase):  # a rank's own check failed: the message names it
        assert f"{_ranks_text(case.differing)} raised" in message, message
    else:
        for ranks in by_variant.values():
            assert _ranks_text(ranks) in message, (by_variant, message)


@pytest.mark.parametrize("case", [c for world in WORLDS for c in ci_cases(world) if c.disagree], ids=lambda c: c.id)
def test_disagreeing_ranks_raise_the_same_error_promptly(spawned, case):
    _check(spawned(case.world), case)


@pytest.mark.parametrize("case", [c for world in WORLDS for c in ci_cases(world) if not c.disagree],
                         ids=lambda c: c.id)
def test_agreeing_ranks_run(spawned, case):
    _check(spawned(case.world), case)


@pytest.mark.skipif(not LONG, reason="the long fuzz run: FLEXATTN_FUZZ_LONG=1")
@pytest.mark.parametrize("world", (2, 3, 4))
def test_disagreement_fuzz_long(spawned, world):
    failures = []
    for case in _cases(world, True):
        try:
            _check(spawned(world, long=True), case)
        except (AssertionError, pytest.fail.Exception) as err:
            failures.append(f"{case.id}: {err}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.gpu
def test_disagreeing_ranks_on_two_gpus_under_nccl(tmp_path, monkeypatch):
    # The NCCL side: the record on the rank's GPU, the digests on the tensors' GPU, the second
    # round's all_gather_object under NCCL. The CI slice at 2 ranks, the tensors on the GPUs.
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (one per rank)")
    monkeypatch.setenv("FLEXATTN_FUZZ_DEVICE", "cuda")  # read by the spawned ranks
    cases = ci_cases(2)
    spawn = run(2, cases, str(tmp_path), SPAWN_TIMEOUT_S)
    failures = []
    for case in cases:
        try:
            _check(spawn, case)
        except (AssertionError, pytest.fail.Exception) as err:
            failures.append(f"{case.id}: {err}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.gpu
def test_contents_digest_is_the_same_on_the_gpu(monkeypatch):
    # A rank's digests are computed where its tensors are: equal contents must give equal digests
    # on any device (chunks of 256 words here, so several chunks are crossed).
    from flexattn.distributed import agreement

    monkeypatch.setattr(agreement, "_WORD_CHUNK", 256)
    torch.manual_seed(0)
    for t in (torch.randn(1000), torch.randint(-2**31, 2**31 - 1, (3, 333), dtype=torch.int32),
              torch.rand(77) > 0.5, torch.randn(601, dtype=torch.bfloat16), torch.arange(5, dtype=torch.int64)):
        assert int(tensor_digest(t.cuda())) == int(tensor_digest(t)), t.dtype
    keys = torch.randint(0, 1 << 40, (5000,))
    assert int(entries_digest(keys.cuda())) == int(entries_digest(keys))


# ---------------------------------------------------------------------------------------------
# The digests, in one process
# ---------------------------------------------------------------------------------------------


def test_contents_digest_sees_every_change_and_nothing_else():
    torch.manual_seed(0)
    for t in (torch.randn(1000), torch.randint(0, 7, (3, 5), dtype=torch.int32), torch.rand(7) > 0.5,
              torch.randn(6, dtype=torch.float16), torch.arange(5, dtype=torch.int64)):
        base = int(tensor_digest(t))
        # The same contents in another layout, or a copy: the same digest.
        assert int(tensor_digest(t.clone())) == base
        if t.dim() == 2:
            assert int(tensor_digest(t.t().contiguous().t())) == base
        # Any one element changed: another digest.
        for i in range(t.numel()):
            changed = t.clone().view(-1)
            changed[i] = ~changed[i] if t.dtype == torch.bool else changed[i] + 1
            assert int(tensor_digest(changed.view(t.shape))) != base, (t.dtype, i)
    # Two elements swapped: another digest (positions count, not only the multiset of values).
    t = torch.arange(10, dtype=torch.int32)
    assert int(tensor_digest(t.flip(0))) != int(tensor_digest(t))
    # -0.0 and 0.0 differ (1 / x differs).
    assert int(tensor_digest(torch.tensor([0.0]))) != int(tensor_digest(torch.tensor([-0.0])))
    # A view at an odd byte offset, and a length that is not a whole word.
    half = torch.arange(7, dtype=torch.float16)
    assert int(tensor_digest(half[1:])) == int(tensor_digest(half[1:].clone()))


def test_contents_digest_tells_chunks_apart(monkeypatch):
    # Chunks of 256 words here (2**20 in use): a change in any chunk, and two chunks swapped, show.
    from flexattn.distributed import agreement

    monkeypatch.setattr(agreement, "_WORD_CHUNK", 256)
    t = torch.randint(-2**31, 2**31 - 1, (600,), dtype=torch.int32)
    base = int(tensor_digest(t))
    for i in (0, 255, 256, 511, 512, 599):
        changed = t.clone()
        changed[i] += 1
        assert int(tensor_digest(changed)) != base, i
    swapped = torch.cat([t[256:512], t[:256], t[512:]])
    assert int(tensor_digest(swapped)) != base


def test_tables_digest_tells_apart_tile_sets_of_one_count_and_index_sum():
    # Row 0 lists blocks {0, 3} or {1, 2}: the same number of tiles and the same sum of indices,
    # which the sums of an affine function of the index (the digest before this one) could not tell.
    from flexattn.distributed.plan import tiles_digest

    num = torch.full((1, 1, 2), 2, dtype=torch.int32)
    a = torch.tensor([[[[0, 3], [0, 1]]]], dtype=torch.int32)
    b = torch.tensor([[[[1, 2], [0, 1]]]], dtype=torch.int32)
    assert tiles_digest(num, a, 4) != tiles_digest(num, b, 4)
    # Padding past the count, and the order within a row, are left out.
    padded = torch.tensor([[[[3, 0, 2], [1, 0, 3]]]], dtype=torch.int32)
    assert tiles_digest(num, padded, 4) == tiles_digest(num, a, 4)
    assert int(entries_digest(torch.tensor([5, 9]))) == int(entries_digest(torch.tensor([9, 5])))
