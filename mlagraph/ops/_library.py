"""Finding and loading an optional kernel library (FlashMLA, FlashInfer) without importing it early.

:class:`Library` names a pip package, the module it installs and how to install it. ``available``
only looks the module up (``importlib.util.find_spec``): registering a backend never imports its
library, so ``import mlagraph`` works without it and ``backends.names()`` still lists the
backend. ``load`` imports it on the first kernel call and says how to install it when missing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import types


@dataclasses.dataclass(frozen=True)
class Library:
    package: str  # the pip distribution name
    module: str  # the top-level module it installs
    install: str  # how to install it (a sentence)

    def available(self) -> tuple[bool, str]:
        """(installed?, why not / where). Imports nothing."""
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return False, f"{self.package} is not installed: {self.install}"
        return True, f"{self.package} found at {spec.origin}"

    def load(self) -> types.ModuleType:
        return _load(self)


@functools.lru_cache(maxsize=None)
def _load(lib: Library) -> types.ModuleType:
    ok, why = lib.available()
    if not ok:
        raise ImportError(why, name=lib.module)
    try:
        return importlib.import_module(lib.module)
    except Exception as e:  # a compiled extension can fail to load with any error (ABI, CUDA)
        raise ImportError(f"cannot import {lib.module} from {lib.package}: {type(e).__name__}: {e}. "
                          f"{lib.install}", name=lib.module) from e
