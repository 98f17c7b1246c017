"""The ``flexattn`` command (``main``), and the jobs behind its subcommands: ``check`` (every catalogue
variant checked against float64 and timed here), ``report`` (its table and files), ``picture`` (a
variant's mask as text and PNG) and ``kernel_source`` (the Triton source a call would run)."""

from .main import main

__all__ = ["main"]
