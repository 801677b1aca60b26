"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al. 2017), as a toolkit.

Stable top-level API: ``get_preset(name, **overrides) -> ModelConfig`` and
``Transformer(config)`` with ``encode``, ``decode`` (with or without a cache) and ``forward``.
"""
from aiayn.model import ModelConfig, Transformer, get_preset
from aiayn.decode.cache import DecoderCache

__version__ = "0.1.0"
__all__ = ["DecoderCache", "ModelConfig", "Transformer", "get_preset", "__version__"]
