"""Errors flexattn raises on purpose. Each message names the argument or mod and the fix."""


class FlexAttentionError(Exception):
    """Base class for every error flexattn raises on purpose."""


class InvalidInputError(FlexAttentionError, ValueError):
    """A tensor, option or BlockMask passed to the public API does not fit the others."""


class ModTraceError(FlexAttentionError, RuntimeError):
    """A score_mod or mask_mod could not be turned into a graph (control flow on a tensor, .item(), ...)."""


class UnsupportedOpError(FlexAttentionError, NotImplementedError):
    """A traced mod uses an op that the Triton lowering table has no entry for."""


class BackendUnavailableError(FlexAttentionError, RuntimeError):
    """The backend asked for in kernel_options cannot run on these inputs here."""


class ResourceError(FlexAttentionError, RuntimeError):
    """A generated kernel does not fit the GPU's resources (shared memory) with any tile flexattn tries."""
