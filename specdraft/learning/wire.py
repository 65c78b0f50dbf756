"""What the serving process and the training process send each other (over multiprocessing queues).

Tensors travel as numpy arrays (bfloat16 as its int16 bits): plain bytes when pickled, not torch's
shared-memory handles, whose storage the sender would have to keep alive until the other side reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class WireTensor:
    dtype: str  # torch dtype name, e.g. "bfloat16"
    array: np.ndarray

    @classmethod
    def of(cls, t: torch.Tensor) -> "WireTensor":
        t = t.detach().to("cpu").contiguous()
        name = str(t.dtype).replace("torch.", "")
        return cls(name, (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().copy())

    def tensor(self) -> torch.Tensor:
        t = torch.from_numpy(self.array)
        return t.view(torch.bfloat16) if self.dtype == "bfloat16" else t


@dataclass
class ServedSequence:
    """One finished request, cut to its last ``max_len`` tokens: tokens [T], the target's features of
    positions 0..T-2 [T - 1, 3H] (what its EAGLE-3 drafter kept), the target's embeddings of the tokens
    [T, H]; ``n_prompt``: how many of the T tokens are the prompt's (only the answer is trained on)."""

    tokens: np.ndarray  # int64
    n_prompt: int
    feats: WireTensor
    embeds: WireTensor

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class Verdict:
    """The server's verdict on update ``version``: kept (persisted) or rolled back."""

    version: int
    keep: bool


@dataclass
class Stop:
    pass


@dataclass
class Weights:
    """Update ``version``: the head's trainable tensors, in the served head's dtype."""

    version: int
    state: dict[str, WireTensor]


@dataclass
class Progress:
    """The training process's state, sent after every optimizer step (and when it changes)."""

    steps: int = 0
    loss: float | None = None
    accuracy: list[float] = field(default_factory=list)  # per draft step, the last batch's
    buffer_tokens: int = 0
    buffer_sequences: int = 0
    received: int = 0  # served sequences taken
    busy_share: float = 0.0  # its CPU seconds / (wall seconds x CPUs), since it started
    saved_version: int | None = None  # the latest update written to the adapted store
    saved_path: str | None = None
    warning: str | None = None  # e.g. a kept update that could not be written


@dataclass
class Failed:
    message: str
