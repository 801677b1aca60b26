"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al. 2017), as a toolkit.

Stable top-level API: ``get_preset(name, **overrides) -> ModelConfig`` and
``Transformer(config)`` with ``encode``, ``decode`` (with or without a cache) and ``forward``.
They are imported, with PyTorch, at the first use of a name the package does not hold yet
(``__getattr__``), so that the ``aiayn`` command starts, and its Ctrl-C is handled, before
PyTorch has loaded.
"""
__version__ = "0.1.0"
__all__ = ["DecoderCache", "ModelConfig", "Transformer", "get_preset", "__version__"]


def __getattr__(name: str):
    """The names of ``__all__``, and the subpackages their import loads (``aiayn.model``, ...), as an
    eager import of them at the package's import gave them."""
    if not name.startswith("__"):
        from aiayn.decode.cache import DecoderCache
        from aiayn.model import ModelConfig, Transformer, get_preset
        globals().update(DecoderCache=DecoderCache, ModelConfig=ModelConfig, Transformer=Transformer,
                         get_preset=get_preset)
        if name in globals():  # (an imported subpackage is an attribute of its package)
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
