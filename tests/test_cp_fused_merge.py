"""Context parallelism through the Triton kernels, whose steps after a row's first merge into the
running result in the forward kernel ([Note] The merge in the kernel, flexattn/distributed/ring.py),
at 2 and 3 gloo ranks: the results against single-process flexattn and the float64 reference (the
rank code of tests/distributed_cases.py), and a count of how each step merged, so that a ring that
silently went back to ``merge_into`` fails here. tests/test_fused_merge.py checks the kernel's merge
itself against ``merge_into``.
"""

import pytest
from distributed_cases import fused_merge_cases, ranks_started_once

pytestmark = pytest.mark.usefixtures("one_thread")

FLEXATTN_TOL = 1e-5  # as tests/test_distributed.py
FWD_TOL = 2e-5
WORLDS = (2, 3)
TIMEOUT_S = 400

CASES = [case for world in WORLDS for case in fused_merge_cases(world)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return ranks_started_once(tmp_path_factory, "fused_merge", TIMEOUT_S)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_steps_merge_in_the_kernel_and_match_one_process(ranks, case):
    results, failure = ranks(case.world)
    entry = results.get(case.id)
    if entry is None:
        pytest.fail(f"no result for {case.id}: {failure}")
    if "traceback" in entry:
        pytest.fail(f"{case.id} raised on rank 0:\n{entry['traceback']}")
    assert entry["backends"] == ["TRITON"] and entry["triton_backwards"] > 0
    assert entry["merges"]["merge_into"] == 0, entry["merges"]
    assert entry["merges"]["in_kernel"] > 0, entry["merges"]
    for name, flex, ref, nan, same_shape in zip(entry["names"], entry["vs_flexattn"], entry["vs_reference"],
                                               entry["nan"], entry["shapes_match"]):
        assert same_shape and not nan, name
        assert flex < FLEXATTN_TOL, f"{name} against flexattn: {flex:.2e}"
        assert ref < FWD_TOL, f"{name} against the reference: {ref:.2e}"
