"""The training side (it runs in the training process, ``process.py``; tests drive it in their own):
the replay buffer of served sequences and the optimizer steps of the training-time test, the same loss
as ``specdraft train eagle3`` (models/eagle3.py ``ttt_batch`` and ``ttt_loss``), on a float32 copy of
the head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models.eagle3 import Eagle3Head, Eagle3Shape, ttt_batch, ttt_loss
from ..models.llama_probe import native_bf16
from .config import LearnConfig
from .wire import ServedSequence, WireTensor


class ReplayBuffer:
    """Served sequences, the oldest leaving once they hold more than ``max_tokens`` tokens; read by
    ``ttt_batch`` as it reads offline training's data (``tokens``, ``n_prompt``, ``features``, ``width``)."""

    def __init__(self, max_tokens: int, width: int):
        self.max_tokens, self.width = max_tokens, width
        self.tokens: list[torch.Tensor] = []
        self.n_prompt: list[int] = []
        self.feats: list[torch.Tensor] = []
        self.embeds: list[torch.Tensor] = []
        self.n_tokens = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, seq: ServedSequence) -> None:
        feats, n = seq.feats.tensor(), seq.n_tokens
        if feats.shape[-1] != self.width or feats.shape[0] != n - 1 or seq.embeds.array.shape[0] != n:
            raise ValueError(
                f"a served sequence of {seq.n_tokens} tokens came with features {tuple(feats.shape)} and "
                f"embeddings {seq.embeds.array.shape}; this head reads {self.width} features a position"
            )
        self.tokens.append(torch.from_numpy(seq.tokens).long())
        self.n_prompt.append(seq.n_prompt)
        self.feats.append(feats)
        self.embeds.append(seq.embeds.tensor())
        self.n_tokens += seq.n_tokens
        while self.n_tokens > self.max_tokens and len(self.tokens) > 1:
            self.n_tokens -= len(self.tokens[0])
            for rows in (self.tokens, self.n_prompt, self.feats, self.embeds):
                rows.pop(0)

    def features(self, i: int, n: int) -> torch.Tensor:
        return self.feats[i][:n].float()

    def embedding(self, idx: list[int]):
        """ids -> the target's embeddings [.., H], for the tokens of sequences ``idx`` (a token's embedding does
        not depend on where it stands; ids outside them, the batch's padding, read some row)."""
        ids = torch.cat([self.tokens[i] for i in idx])
        uniq, inv = torch.unique(ids, return_inverse=True)
        rows = torch.cat([self.embeds[i] for i in idx]).float()
        table = rows.new_zeros(len(uniq), rows.shape[-1])
        table[inv] = rows
        return lambda t: table[torch.searchsorted(uniq, t.contiguous()).clamp(max=len(uniq) - 1)]


@dataclass
class StepResult:
    loss: float
    accuracy: list[float]  # per draft step
    tokens: int  # answer positions trained on (anchors with a label)


class HeadTrainer:
    """AdamW on a float32 copy of the head (``shape`` and ``state``, the served head's tensors)."""

    def __init__(self, shape: Eagle3Shape, state: dict[str, torch.Tensor], cfg: LearnConfig):
        self.cfg = cfg
        self.head = Eagle3Head(shape)
        self.head.load_state_dict(state)
        self.head.float().train()
        self.trainable = {n: p for n, p in self.head.named_parameters()}
        self.opt = self._optimizer()
        self.t2d_index = torch.full((shape.vocab_size,), -100, dtype=torch.long)
        self.t2d_index[self.head.draft_ids] = torch.arange(shape.draft_vocab_size)
        self.buffer = ReplayBuffer(cfg.buffer_tokens, len(shape.layers) * shape.target_hidden_size)
        self.bf16 = native_bf16()  # autocast where the CPU multiplies bf16 natively, as train eagle3
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.steps = 0

    def _optimizer(self):
        return torch.optim.AdamW(list(self.trainable.values()), lr=self.cfg.lr, weight_decay=0.0)

    def ready(self) -> bool:
        """Whether the buffer holds an answer token to learn."""
        return any(len(t) > n + 1 for t, n in zip(self.buffer.tokens, self.buffer.n_prompt))

    def step(self) -> StepResult:
        n = len(self.buffer)
        idx = torch.randint(0, n, (min(self.cfg.batch_size, n),), generator=self.gen).tolist()
        F, toks, labels = ttt_batch(self.buffer, idx, self.t2d_index, self.cfg.ttt_steps, self.cfg.max_len)
        loss, accs = ttt_loss(self.head, self.buffer.embedding(idx), F, toks, labels, torch.device("cpu"), self.bf16)
        self.opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.trainable.values(), self.cfg.clip)
        self.opt.step()
        self.steps += 1
        return StepResult(float(loss.detach()), accs, int((labels[:, :, 0] >= 0).sum()))

    def weights(self, dtype: torch.dtype) -> dict[str, WireTensor]:
        return {k: WireTensor.of(p.detach().to(dtype)) for k, p in self.trainable.items()}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone() for k, p in self.trainable.items()}

    def restore(self, snap: dict[str, torch.Tensor]) -> None:
        """Back to ``snap`` (a rolled back update): the weights, and a fresh optimizer (its moments led there)."""
        with torch.no_grad():
            for k, p in self.trainable.items():
                p.copy_(snap[k])
        self.opt = self._optimizer()

    def state(self, snap: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The head's whole state dict with ``snap``'s trainable tensors (what the store writes)."""
        return {**self.head.state_dict(), **snap}
