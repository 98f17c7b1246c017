"""flexattn.kernels.transpose_tables: the backward's tables from the forward's, in two Triton kernels,
against the torch ops they replace (the interpreter on the CPU; CUDA on the device)."""

import pytest
import torch

import flexattn
from flexattn import create_block_mask
from flexattn.kernels.ahead import compiling_ahead
from flexattn.kernels.tables import backward_tables
from flexattn.kernels.transpose_tables import transposed_tables
from flexattn.masks.layout import dense_to_ordered, ordered_to_dense

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _interpreter_cannot_run_them() -> str:
    if DEVICE == "cuda":
        return ""
    if not flexattn.kernels.interpreter_enabled():
        return "needs a GPU or TRITON_INTERPRET=1"
    import triton

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
        # Its interpreter turns an int argument into a one-element array, and a loop over it calls
        # int() on that, which NumPy 2 refuses. The kernels only run on GPUs (compiled, Triton 3.6
        # included: the device's tests run them there).
        return "Triton 3.6's interpreter cannot loop up to an int argument under NumPy 2"
    return ""


_WHY_NOT = _interpreter_cannot_run_them()
pytestmark = pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT or "-")


def by_torch_ops(num, idx, rows, cols):
    dense = ordered_to_dense(num, idx, cols)[:, :, :rows]
    return dense_to_ordered(dense.transpose(-2, -1))


@pytest.mark.parametrize("B,H,R,C,rows,density", [
    (1, 1, 4, 4, 4, 0.5),
    (2, 3, 9, 7, 8, 0.4),  # rows past the lengths are left out
    (1, 2, 300, 130, 290, 0.3),  # more rows than one chunk of the column kernel
    (2, 1, 17, 33, 17, 0.0),  # nothing visited
    (1, 1, 5, 6, 5, 1.0),  # everything visited
])
def test_the_transposed_tables_equal_the_torch_ops(B, H, R, C, rows, density):
    keep = torch.rand(B, H, R, C) < density
    num, idx = dense_to_ordered(keep.int())
    got = transposed_tables(num.to(DEVICE), idx.to(DEVICE), rows, C)
    want = by_torch_ops(num, idx, rows, C)
    for g, w in zip(got, want):
        assert g.dtype == torch.int32 and g.is_contiguous()
        assert torch.equal(g.cpu(), w)


def test_unused_slots_and_narrow_tables_are_ignored():
    # Tables narrower than the columns, with junk past each row's count (a caller's padding).
    B, H, R, C, W = 2, 2, 12, 40, 5
    num = torch.randint(0, W + 1, (B, H, R), dtype=torch.int32)
    idx = torch.stack([torch.randperm(C)[:W].sort().values for _ in range(B * H * R)]).to(torch.int32)
    idx = idx.reshape(B, H, R, W)
    unused = torch.arange(W) >= num.unsqueeze(-1)
    idx = torch.where(unused, torch.randint(-7, 3 * C, idx.shape, dtype=torch.int32), idx)
    got = transposed_tables(num.to(DEVICE), idx.to(DEVICE), R, C)
    want = by_torch_ops(num, torch.where(unused, 0, idx), R, C)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.gpu
def test_a_masks_backward_tables_use_the_kernels_and_stay_right_while_launches_are_recorded():
    # On the GPU backward_tables takes the kernels; inside compiling_ahead() launches are recorded,
    # not run, so the tables must still be computed for real there (they are kept on the mask).
    def document(b, h, q, kv):
        return (q // 300 == kv // 300) & (q >= kv)

    for recorded in (False, True):
        bm = create_block_mask(document, 2, 1, 1000, 1000, device="cuda", BLOCK_SIZE=64)
        rows, cols = -(-1000 // 64), -(-1000 // 64)
        if recorded:
            with compiling_ahead():
                tables = backward_tables(bm)
        else:
            tables = backward_tables(bm)
        want_q = by_torch_ops(bm.kv_num_blocks.cpu(), bm.kv_indices.cpu(), rows, cols)
        want_fq = by_torch_ops(bm.full_kv_num_blocks.cpu(), bm.full_kv_indices.cpu(), rows, cols)
        got = [t.cpu() for t in tables]
        assert all(torch.equal(g, w) for g, w in zip(got, [*want_q, *want_fq]))
