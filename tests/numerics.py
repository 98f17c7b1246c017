"""The error measure every numerical test uses, and the check that the generated backward kernels ran."""

import contextlib
import importlib

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error. Non-finite entries (-inf LSE of fully masked rows) must sit in the
    same places in both tensors, and are then left out of the norm."""
    actual, expected = actual.double(), expected.double()  # FP8 has no isfinite
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(actual)), "non-finite entries differ from the expected tensor"
    diff = (actual - expected)[finite]
    return (diff.norm() / expected[finite].norm().clamp_min(1e-30)).item()


_BACKWARD_FAMILIES = ("flexattn.kernels.backward", "flexattn.kernels.hopper.backward")


@contextlib.contextmanager
def expect_triton_backward():
    """Fails unless the block ran generated backward kernels: the portable Triton ones
    (``flexattn.kernels.backward.launches``) or, on Hopper, the Gluon ones
    (``flexattn.kernels.hopper.backward.launches``); each counter is bumped once per backward call.
    A backward that silently fell back to the blockwise PyTorch path would pass every numerical
    check, so this is what says the kernels were tested."""
    launchers = [importlib.import_module(name) for name in _BACKWARD_FAMILIES]
    before = sum(launcher.launches for launcher in launchers)
    yield
    assert sum(launcher.launches for launcher in launchers) > before, (
        "the backward did not run the generated kernels (flexattn.kernels.backward.launches and "
        "flexattn.kernels.hopper.backward.launches did not grow)"
    )
