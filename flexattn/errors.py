"""Errors flexattn raises on purpose. Each message names the argument or mod and the fix."""


class FlexAttentionError(Exception):
    """Base class for every error flexattn raises on purpose."""


class InvalidInputError(FlexAttentionError, ValueError):
    """A tensor, option or BlockMask passed to the public API does not fit the others."""


class RankDisagreementError(InvalidInputError):
    """The ranks of a context-parallel group were given different calls (or some could not make
    theirs). Raised on every rank with the same message, which names what differs and which ranks
    have which (flexattn/distributed/agreement.py)."""


class ModTraceError(FlexAttentionError, RuntimeError):
    """A score_mod or mask_mod could not be turned into a graph (control flow on a tensor, .item(), ...)."""


class UnsupportedOpError(FlexAttentionError, NotImplementedError):
    """A traced mod uses an op that the Triton lowering table has no entry for."""


class BackendUnavailableError(FlexAttentionError, RuntimeError):
    """The backend asked for in kernel_options cannot run on these inputs here."""


class ResourceError(FlexAttentionError, RuntimeError):
    """A generated kernel does not fit the GPU's resources (shared memory) with any tile flexattn tries."""
