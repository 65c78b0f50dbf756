"""The commands that build things for a model from the library below them: ``train`` (heads),
``autotune`` and ``tune_skip`` (measured settings) and ``doctor`` (what this machine can run)."""
