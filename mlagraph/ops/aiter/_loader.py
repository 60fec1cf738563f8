"""AMD aiter's Triton kernels, loaded without aiter's ROCm-only package ``__init__``.

aiter (PyPI: ``amd-aiter``) ships MLA kernels written in Triton under ``aiter.ops.triton``:
the fused RoPE + concat + latent cache write (``fused_kv_cache``), split-KV MLA decode
(``mla_decode_rope``), DSA sparse MLA (``unified_attention_sparse_mla``) and the DSA indexer's
logits (``fp8_mqa_logits``). They are plain Triton, so they also run on NVIDIA GPUs and some of
them under Triton's CPU interpreter. But ``import aiter`` runs the package ``__init__``, which
loads aiter's compiled ROCm extensions and fails without ROCm.

:func:`load` therefore imports ``aiter.ops.triton.<module>`` in one of two ways:

- on ROCm (``torch.version.hip`` is set) through the normal package import;
- elsewhere by first registering ``aiter`` and ``aiter.ops`` in ``sys.modules`` as bare
  package modules whose ``__path__`` is the installed package directory, without executing their
  ``__init__``. Python then finds ``aiter.ops.triton`` and its submodules on that path as usual.
  The Triton modules only import ``triton``, ``torch`` and each other, so they load. The bare
  modules stay registered: a later ``import aiter`` in the same process gets them, not aiter's
  ROCm runtime (there is no ROCm runtime to get here anyway).

aiter's per-architecture config JSONs are AMD-only: callers pass configs for the device.

Which platform path is taken depends only on the installed torch build, never on environment
variables or module flags (docs/design.md rule 1). The ``aiter`` backend (:mod:`mlagraph.ops.aiter`)
and the benchmark peers (benchmarks/aiter_peers.py) load aiter through this module; both
``load`` and ``available`` are re-exported as ``mlagraph.ops.aiter.load`` / ``.available``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import re
import sys
import types

import torch

PACKAGE = "amd-aiter"
INSTALL_HINT = f"install it with `pip install {PACKAGE}` (or `pip install mlagraph[aiter]`)"

# Package levels whose __init__ must not run off ROCm. aiter.ops.triton's own __init__ only
# imports its Triton quant module, so it runs normally.
_BARE_PACKAGES = ("aiter", "aiter.ops")
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _find_spec(name: str):
    """importlib.util.find_spec that answers None instead of raising for odd half-installs."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def available() -> tuple[bool, str]:
    """(whether amd-aiter is installed, why not / where it is). Imports nothing.

    Only looks the package up (``importlib.util.find_spec``), so it is safe to call anywhere,
    including off ROCm where importing ``aiter`` itself would fail.
    """
    spec = _find_spec("aiter")
    if spec is None or not spec.submodule_search_locations:
        return False, f"{PACKAGE} is not installed: {INSTALL_HINT}"
    if _find_spec("triton") is None:
        return False, f"{PACKAGE} is installed but its kernels need Triton: install it with `pip install triton`"
    return True, f"{PACKAGE} found at {spec.submodule_search_locations[0]}"


def _is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def _register_bare_packages() -> None:
    """Puts ``aiter`` and ``aiter.ops`` in sys.modules as packages that skip their __init__."""
    roots = list(_find_spec("aiter").submodule_search_locations)
    paths = {"aiter": roots, "aiter.ops": [f"{root}/ops" for root in roots]}
    for name in _BARE_PACKAGES:
        if name in sys.modules:
            continue  # registered before (by us, or aiter itself was imported): keep it
        module = types.ModuleType(name, f"{name} without its __init__ (loaded by mlagraph.ops.aiter)")
        module.__path__ = paths[name]
        module.__package__ = name
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__spec__.submodule_search_locations = paths[name]
        sys.modules[name] = module
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(sys.modules[parent], child, module)


def load(module: str) -> types.ModuleType:
    """The module ``aiter.ops.triton.<module>`` (e.g. ``"fused_kv_cache"``, ``"mla_decode_rope"``).

    Raises:
        ValueError: ``module`` is not a dotted Python name.
        ImportError: amd-aiter is not installed (the message says how to install it), or the
            module does not exist or fails to import, whatever the error (the message names the
            module and the cause, which is also chained).
    """
    if not isinstance(module, str) or not _MODULE_NAME.fullmatch(module):
        raise ValueError(f"aiter module: expected a dotted module name under aiter.ops.triton "
                         f"such as 'fused_kv_cache', got {module!r}")
    ok, why = available()
    if not ok:
        raise ImportError(f"cannot load aiter.ops.triton.{module}: {why}", name=f"aiter.ops.triton.{module}")
    full = f"aiter.ops.triton.{module}"
    if not _is_rocm():
        _register_bare_packages()
    try:
        return importlib.import_module(full)
    except Exception as e:  # an import can fail with any error (aiter's ROCm init, a Triton mismatch)
        raise ImportError(
            f"cannot load {full} from {PACKAGE}: {type(e).__name__}: {e}. Check the module name "
            f"(the modules are the files under aiter/ops/triton/) and that {PACKAGE} matches this "
            f"Triton; reinstall with `pip install -U {PACKAGE}`", name=full) from e
