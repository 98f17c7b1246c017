"""Deprecated: the forward kernel and its launch machinery moved to :mod:`flexattn.kernels`."""

from ._deprecated import warn_moved
from .kernels.configs import LaunchConfig, select_config
from .kernels.family import CompiledKernel as CompiledForward
from .kernels.forward import ForwardKernel, forward_kernel
from .kernels.launch import interpreter_enabled
from .kernels.tables import block_mask_row_stats, launch_tables

warn_moved("flexattn.runtime", "flexattn.kernels")

__all__ = [
    "LaunchConfig", "ForwardKernel", "CompiledForward", "forward_kernel", "interpreter_enabled", "select_config",
    "block_mask_row_stats", "launch_tables",
]
