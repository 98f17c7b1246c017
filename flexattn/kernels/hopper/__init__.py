"""The Hopper kernels: a forward and a backward written in Triton's Gluon for compute capability 9.0,
taken where they apply (``BACKEND='GLUON'`` pins them).

``common`` holds what both share (the Triton releases checked, the rules that say whether a call
can run here, tensor views, the family base); ``forward`` and ``backward`` are the two families,
each with its plans and launches. Their templates are templates/hopper_*.py.jinja.
"""

from .backward import HopperBackwardKernel, hopper_backward_kernel
from .common import HopperUnavailable, descriptor_ready
from .forward import HopperForwardKernel, auto_reason, hopper_forward_kernel

__all__ = ["HopperForwardKernel", "hopper_forward_kernel", "HopperBackwardKernel", "hopper_backward_kernel",
           "HopperUnavailable", "descriptor_ready", "auto_reason"]
