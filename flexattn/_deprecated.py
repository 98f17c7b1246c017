"""Old import paths kept for one release after the redesign of 0.2 (see CHANGELOG.md)."""

import warnings

__all__ = ["warn_moved"]


def warn_moved(old: str, new: str) -> None:
    """Say once per importing module that ``old`` moved to ``new`` and will go."""
    warnings.warn(f"{old} is deprecated and goes in the next release: import from {new} instead",
                  DeprecationWarning, stacklevel=3)
