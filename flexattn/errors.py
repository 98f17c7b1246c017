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


def definition_site(fn) -> str:
    """``file:line`` where the Python function ``fn`` is defined; "" for other callables."""
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def describe_mod(fn, kind: str) -> str:
    """How errors name a mod: its kind, its name and where it is defined (``mask_mod 'causal'
    defined at model.py:12``), so the message leads to the code to fix."""
    name = getattr(fn, "__name__", type(fn).__name__)
    site = definition_site(fn)
    return f"{kind} '{name}'" + (f" defined at {site}" if site else "")


_RAISED_AS_IS: dict = {}


def raised_as_is_under_dynamo(error: FlexAttentionError) -> FlexAttentionError:
    """``error`` as an instance of a subclass of its class and of Dynamo's ``UserError`` (valid in eager,
    not under torch.compile), which torch.compile raises as it is, message first, with or without
    fullgraph. Raise it from a function Dynamo runs as plain Python (``assume_constant_result``): a
    ``raise`` in code Dynamo traces reaches the user inside its "Observed exception" graph break text,
    whatever the class. Dynamo is imported here, when the error is made, never at flexattn's import."""
    from torch._dynamo.exc import UserError, UserErrorType

    kind = type(error)
    wrapped = _RAISED_AS_IS.get(kind)
    if wrapped is None:

        def __init__(self, message: str) -> None:
            UserError.__init__(self, UserErrorType.INVALID_INPUT, message)

        wrapped = _RAISED_AS_IS[kind] = type(kind.__name__, (kind, UserError), {
            "__init__": __init__, "__module__": kind.__module__, "__qualname__": kind.__qualname__,
        })
    return wrapped(str(error))
