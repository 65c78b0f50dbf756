"""Every error specdraft raises on bad input derives from SpecDraftError.

The CLI and the server catch SpecDraftError and print/return its message; anything else is a bug.
"""


class SpecDraftError(Exception):
    """Base class: a precise, user-facing message naming the problem."""


class ConfigError(SpecDraftError, ValueError):
    """Invalid sampling or speculation parameters, unknown method."""


class TokenizerMismatchError(SpecDraftError):
    """Draft and target do not share one tokenizer."""


class ContextLengthError(SpecDraftError, ValueError):
    """Prompt (plus requested new tokens) does not fit in the model's context."""


class ModelFileError(SpecDraftError):
    """A model file is missing, broken, or its SHA-256 does not match."""


class DatastoreError(SpecDraftError):
    """A suffix datastore is missing, corrupt, or built for another tokenizer."""
