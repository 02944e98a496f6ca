"""kvwise's version, and the torch it runs on, read without importing torch (``kvwise
--version``, ``GET /version``)."""

from __future__ import annotations

from importlib import metadata

from kvwise import __version__

__all__ = ["__version__", "torch_version", "version_line"]


def torch_version() -> str | None:
    """The installed torch's version (its package metadata), or None without one."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def version_line() -> str:
    """``kvwise 0.1.0 (torch 2.13.0)``."""
    torch = torch_version()
    return f"kvwise {__version__}" + (f" (torch {torch})" if torch else "")
