"""specdraft: lossless speculative decoding behind one protocol."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .api import SpecDecoder as SpecDecoder
    from .core.config import SamplingParams as SamplingParams
    from .core.config import SpecConfig as SpecConfig
    from .core.errors import SpecDraftError as SpecDraftError

# Imported on first use, so that a module that needs none of them (setup's llama.cpp build, which runs
# before torch is installed) imports without them.
_PUBLIC = {
    "SpecDecoder": ".api",
    "SamplingParams": ".core.config",
    "SpecConfig": ".core.config",
    "SpecDraftError": ".core.errors",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    raise AttributeError(f"module 'specdraft' has no attribute {name!r}")
