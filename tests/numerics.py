"""The error measure every numerical test uses, and the check that the Triton backward ran."""

import contextlib
import importlib

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error. Non-finite entries (-inf LSE of fully masked rows) must sit in the
    same places in both tensors, and are then left out of the norm."""
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(actual)), "non-finite entries differ from the expected tensor"
    diff = (actual.double() - expected.double())[finite]
    return (diff.norm() / expected.double()[finite].norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def expect_triton_backward():
    """Fails unless the block ran the Triton backward: ``flexattn.kernels.backward.launches`` (bumped once
    per Triton backward call) must grow. A backward that silently fell back to the blockwise
    PyTorch path would pass every numerical check, so this is what says the kernels were tested."""
    launcher = importlib.import_module("flexattn.kernels.backward")
    before = launcher.launches
    yield
    assert launcher.launches > before, (
        "the backward did not run the Triton kernels (flexattn.kernels.backward.launches did not grow)"
    )
