"""Kernels: compile, plan and launch the generated Triton kernels (stage 4: trace -> lowering ->
codegen -> kernels).

``launch`` (the direct launch, output buffers) and ``tma`` (tensor descriptors) are the floor, with
``ahead`` (launches recorded, not run, and compiled in ``compile_worker`` processes beforehand);
``configs`` (tiles, warps and stages per GPU, autotuning's store) and ``tables`` (what the kernels
read from a BlockMask) stand on it; ``family`` is what every kernel family shares (compiled
sources, plans, the launch loop with its resource fallback and replan rule); ``forward``,
``backward`` and ``decode`` hold only what is their own; ``hopper/`` holds the Hopper forward and
backward in Gluon, taken where they apply.
"""

from .backward import BackwardKernel, backward_kernel
from .decode import MAX_AUTO_QUERY_LEN, DecodeKernel, decode_kernel, unsupported_reason
from .forward import ForwardKernel, MergingForwardKernel, forward_kernel, merging_forward_kernel
from .launch import in_output_layout, interpreter_enabled, output_layout
from .hopper import (
    HopperBackwardKernel, HopperForwardKernel, HopperUnavailable, descriptor_ready, hopper_backward_kernel,
    hopper_forward_kernel,
)
from .hopper import auto_reason as hopper_auto_reason

__all__ = [
    "BackwardKernel", "backward_kernel", "DecodeKernel", "decode_kernel", "MAX_AUTO_QUERY_LEN", "unsupported_reason",
    "ForwardKernel", "forward_kernel", "MergingForwardKernel", "merging_forward_kernel", "interpreter_enabled",
    "HopperForwardKernel", "HopperUnavailable",
    "hopper_forward_kernel", "hopper_auto_reason", "HopperBackwardKernel", "hopper_backward_kernel",
    "output_layout", "in_output_layout", "descriptor_ready",
]
