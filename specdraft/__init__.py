"""specdraft: lossless speculative decoding behind one protocol."""

__version__ = "0.1.0"

from .api import SpecDecoder  # noqa: E402
from .core.config import SamplingParams, SpecConfig  # noqa: E402
from .core.errors import SpecDraftError  # noqa: E402

__all__ = ["SpecDecoder", "SamplingParams", "SpecConfig", "SpecDraftError", "__version__"]
