"""The package version: the one source ``pyproject.toml`` (setuptools' ``attr:``), ``fcdp --version`` and
``fcdp_deepspeed.__version__`` read. Standard library only, like the startup modules."""
from __future__ import annotations

__version__ = "0.1.0"
