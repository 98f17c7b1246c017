"""The error measure every numerical test uses."""

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error. Non-finite entries (-inf LSE of fully masked rows) must sit in the
    same places in both tensors, and are then left out of the norm."""
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(actual)), "non-finite entries differ from the expected tensor"
    diff = (actual.double() - expected.double())[finite]
    return (diff.norm() / expected.double()[finite].norm().clamp_min(1e-30)).item()
