"""Deprecated: PagedAttention moved to :mod:`flexattn.masks`."""

from ._deprecated import warn_moved
from .masks import OutOfPagesError, PagedAttention

warn_moved("flexattn.paged_attention", "flexattn.masks (or flexattn)")

__all__ = ["PagedAttention", "OutOfPagesError"]
