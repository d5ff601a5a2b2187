"""Framework adapters, registered by name.

Each module listed in ADAPTER_MODULES defines one Adapter subclass named in the
table; its `name` and `aliases` are what `pai -name` accepts. Modules are imported
on first lookup so that `pai --help` imports no adapter at all.
"""

from __future__ import annotations

import importlib

from paicli.errors import UsageError
from paicli.spec import closest

# module -> class
ADAPTER_MODULES = {
    "paicli.adapters.python": "PythonAdapter",
    "paicli.adapters.tensorflow": "TensorflowAdapter",
    "paicli.adapters.mxnet": "MxnetAdapter",
    "paicli.adapters.caffe": "CaffeAdapter",
    "paicli.adapters.serving": "ServingAdapter",
}

_registry: dict[str, type] | None = None

# The common names, so that a submit imports its own adapter only (and none of the
# others' framework helpers). Checked against the class on every lookup:
# a name the class does not claim falls back to the full registry.
USUAL_NAMES = {
    "python": "paicli.adapters.python", "py": "paicli.adapters.python", "python3": "paicli.adapters.python",
    "tensorflow": "paicli.adapters.tensorflow", "tf": "paicli.adapters.tensorflow",
    "mxnet": "paicli.adapters.mxnet", "mx": "paicli.adapters.mxnet",
    "caffe": "paicli.adapters.caffe",
    "serving": "paicli.adapters.serving",
}


def _load() -> dict[str, type]:
    global _registry
    if _registry is None:
        registry: dict[str, type] = {}
        for module_name, class_name in ADAPTER_MODULES.items():
            cls = getattr(importlib.import_module(module_name), class_name)
            for name in (cls.name, *cls.aliases):
                registry[name.lower()] = cls
        _registry = registry
    return _registry


def adapter_names() -> list[str]:
    """Canonical names, in registration order."""
    return list(dict.fromkeys(cls.name for cls in _load().values()))


def get_adapter(name: str):
    """The adapter instance for `name` (case-insensitive, aliases included)."""
    key = name.strip().lower()
    if _registry is None and key in USUAL_NAMES:
        module = USUAL_NAMES[key]
        cls = getattr(importlib.import_module(module), ADAPTER_MODULES[module])
        if key in (cls.name, *cls.aliases):
            return cls()
    cls = _load().get(key)
    if cls is None:
        guess = closest(name, list(_load()))
        hint = f"did you mean -name {guess}? " if guess else ""
        raise UsageError(f"-name {name}: unknown framework",
                         f"{hint}known: {', '.join(adapter_names())}")
    return cls()
