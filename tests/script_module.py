"""Import a repository file that is not in a package (``scripts/*.py``) as a module for tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_module"]


def load_module(path: Path, name: str) -> ModuleType:
    """Execute ``path`` as module ``name`` (registered in ``sys.modules``, so dataclasses and
    pickling that look their module up by name work) and return it."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
