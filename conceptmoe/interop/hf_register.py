"""Register ``"conceptmoe"`` with transformers' Auto classes, without importing transformers early.

``import conceptmoe`` calls ``install()``. Importing transformers' model classes costs seconds,
and transformers is an optional dependency, so nothing is imported here: if transformers is
already imported, registration happens at once; otherwise a ``sys.meta_path`` hook waits for
the first ``import transformers`` and registers right after it (``hf_model.register``). After
that, ``AutoConfig`` / ``AutoModelForCausalLM`` resolve ``model_type="conceptmoe"`` without
``trust_remote_code`` (issue 11 A). Without transformers installed the hook never fires.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

_done = False


def _register() -> None:
    global _done
    mod = sys.modules.get(__package__ + ".hf_model")
    if _done or (mod is not None and not hasattr(mod, "register")):
        return  # done, or hf_model is importing transformers right now and registers at its end
    _done = True
    try:
        from .hf_model import register
        register()
    except Exception as e:  # noqa: BLE001 (never break the user's transformers import)
        warnings.warn(f"conceptmoe: could not register with transformers ({type(e).__name__}: {e})", stacklevel=2)


class _Loader(importlib.abc.Loader):
    """Runs transformers' own loader, then registers."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _register()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``transformers`` through the other finders and wraps its loader (once)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers":
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Register now if transformers is loaded, else when it is first imported."""
    if "transformers" in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
