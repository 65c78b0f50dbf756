"""What the online learner does and how much it may cost (``SpecDecoder(learn=...)``, ``specdraft serve
--learn``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..core.errors import ConfigError


@dataclass(frozen=True)
class LearnConfig:
    budget: float = 0.25  # share of the machine's CPU time the training process may use (0, 1]
    lr: float = 1e-4  # AdamW, as `specdraft train eagle3` but smaller: it fine-tunes a trained head
    clip: float = 0.5  # gradient norm clipping (train eagle3's)
    ttt_steps: int = 5  # draft steps of the training-time test (train eagle3's default)
    batch_size: int = 4  # served sequences per optimizer step
    max_len: int = 512  # tokens kept of a served sequence (its last ones: the answer, then its context)
    buffer_tokens: int = 32768  # the replay buffer's bound, in tokens (oldest sequences leave first)
    publish_every: int = 20  # optimizer steps between two weight updates sent to the server
    reuse: int = 4  # each served token is trained on about this many times, then the process waits for more
    window: int = 1024  # drafted tokens of EAGLE-3 steps per acceptance window (rollback guard, curve)
    max_drop: float = 0.05  # an update whose window's acceptance falls more than this below the window
    # before it is rolled back (acceptance is accepted / drafted, 0..1)
    persist: bool = True  # keep kept updates under $SPECDRAFT_HOME/adapted and continue from them next start
    queue: int = 16  # served sequences waiting for the training process; more are dropped (counted)
    served_tokens: int = 65536  # recent outputs the suffix drafters search (datastore.ServedOutputs); 0: none
    seed: int = 0

    def __post_init__(self):
        positive = {"lr": self.lr, "clip": self.clip}
        for name, v in positive.items():
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"learn: {name} must be a positive number, got {v!r}")
        if not (isinstance(self.budget, (int, float)) and 0 < self.budget <= 1):
            raise ConfigError(
                f"learn: budget (--learn-budget) must be a share of the CPU in (0, 1], got {self.budget!r}"
            )
        if not (isinstance(self.max_drop, (int, float)) and 0 <= self.max_drop <= 1):
            raise ConfigError(f"learn: max_drop must be in [0, 1] (1: never roll back), got {self.max_drop!r}")
        for name in ("ttt_steps", "batch_size", "publish_every", "reuse", "window", "queue"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"learn: {name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.max_len, int) or self.max_len < self.ttt_steps + 2:
            raise ConfigError(f"learn: max_len must be an integer >= ttt_steps + 2, got {self.max_len!r}")
        if not isinstance(self.served_tokens, int) or isinstance(self.served_tokens, bool) or self.served_tokens < 0:
            raise ConfigError(f"learn: served_tokens must be an integer >= 0, got {self.served_tokens!r}")
        if not isinstance(self.buffer_tokens, int) or self.buffer_tokens < self.max_len:
            raise ConfigError(
                f"learn: buffer_tokens must be an integer >= max_len ({self.max_len}), got {self.buffer_tokens!r}"
            )


def learn_config(learn) -> LearnConfig | None:
    """``SpecDecoder(learn=...)``: None / False (off), True (the defaults), a LearnConfig, or a dict of its fields."""
    if learn is None or learn is False:
        return None
    if learn is True:
        return LearnConfig()
    if isinstance(learn, LearnConfig):
        return learn
    if isinstance(learn, dict):
        known = {f.name for f in dataclasses.fields(LearnConfig)}
        unknown = sorted(set(learn) - known)
        if unknown:
            raise ConfigError(f"learn: unknown fields {unknown}; known: {sorted(known)}")
        return LearnConfig(**learn)
    raise ConfigError(f"learn must be True, False, a LearnConfig or a dict of its fields, got {type(learn).__name__}")
