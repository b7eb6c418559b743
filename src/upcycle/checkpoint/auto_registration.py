"""Register upcycle's Auto classes (`auto_classes.register`) when transformers' Auto model module is imported.

`import upcycle` must stay cheap (no torch, no transformers: the command line starts in a tenth of a second), yet
`import upcycle` followed by `AutoModelForCausalLM.from_pretrained(folder)` must find model type "upcycle". So
`install()` registers at once when transformers' `modeling_auto` is already imported, and otherwise puts a finder
on `sys.meta_path` that lets that module import as usual and registers right after it has run. A failure to
register is a warning, never a broken transformers import.
"""

from __future__ import annotations

import sys
import warnings

AUTO_MODULE = "transformers.models.auto.modeling_auto"


def _register() -> None:
    try:
        from .auto_classes import register

        register()
    except Exception as e:      # an unforeseen transformers version: upcycle.load still works
        warnings.warn(f"upcycle could not register its folders with transformers' Auto classes "
                      f"({type(e).__name__}: {e}); load them with upcycle.load", stacklevel=2)


class _RegisterAfterImport:
    """Finds nothing itself: for AUTO_MODULE it returns the real spec with a loader that registers afterwards.
    (A meta path finder is any object with `find_spec`; importlib.abc's base class is not imported: it would cost
    `import upcycle` tens of milliseconds, during which the command line has no Ctrl-C handler yet.)"""

    def find_spec(self, name, path=None, target=None):
        if name != AUTO_MODULE:
            return None
        import importlib.util

        sys.meta_path.remove(self)          # one use: the real finders resolve the module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Register now if transformers' Auto model module is imported, else once it is (idempotent)."""
    if AUTO_MODULE in sys.modules:
        _register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
