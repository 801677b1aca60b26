"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al. 2017), as a toolkit.

Stable top-level API: ``get_preset(name, **overrides) -> ModelConfig`` and
``Transformer(config)`` with ``encode``, ``decode`` (with or without a cache) and ``forward``.
They are imported, with PyTorch, at their first use (``__getattr__``), so that the ``aiayn``
command starts, and its Ctrl-C is handled, before PyTorch has loaded.
"""
import importlib
import importlib.util

__version__ = "0.1.0"
__all__ = ["DecoderCache", "ModelConfig", "Transformer", "get_preset", "__version__"]

_FROM = {"ModelConfig": "aiayn.model", "Transformer": "aiayn.model", "get_preset": "aiayn.model",
         "DecoderCache": "aiayn.decode.cache"}


def __getattr__(name: str):
    """``aiayn.Transformer`` and the rest of ``__all__`` from their modules; ``aiayn.model`` and the
    other subpackages imported as an attribute is read (as an eager import of them made them)."""
    if name in _FROM:
        value = getattr(importlib.import_module(_FROM[name]), name)
        globals()[name] = value
        return value
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
