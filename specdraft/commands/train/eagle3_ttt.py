"""Training an EAGLE-3 head: the sequences with their features, and the training-time test.

The training-time test (EAGLE-3's, as SpecForge trains): K draft steps per anchor position t. Step 0
reads the target's fused features F_t and the embedding of x_{t+1}; step j >= 1 reads the head's own
pre-norm output of step j - 1 at the same anchor, one position further on (t + j), with the keys of
steps 0..j - 1 in the head's cache, where anchor t sees step 0's positions <= t (the true context) and
its own entries of steps 1..j (its draft so far), as a chain drafted from t attends at test time. Step
j's target is x_{t+j+2} (as a draft-vocabulary index); its cross-entropy is weighted 0.8^j.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from ...core.errors import SpecDraftError
from ...core.jsonl import AppendedJsonl
from .eagle3_data import ANSWER_FIELDS, FEATURE_FIELDS, current_features

TTT_DECAY = 0.8  # step j's loss weight is 0.8^j (EAGLE-3's and SpecForge's)


class Eagle3Data:
    """The answered sequences with current features (DIR/data; eagle3_data.py), features memory-mapped
    (rows at the absolute offsets the index names)."""

    def __init__(self, data: Path, width: int):
        import numpy as np

        answers = {r["i"]: r for r in AppendedJsonl(data / "answers.jsonl", ANSWER_FIELDS).rows}
        index = current_features(AppendedJsonl(data / "features.jsonl", FEATURE_FIELDS).rows, answers)
        self.index = [index[i] for i in sorted(index)]
        if not self.index:
            raise SpecDraftError(f"{data} holds no answered sequences with features yet")
        self.tokens = [torch.tensor(answers[r["i"]]["tokens"], dtype=torch.long) for r in self.index]
        self.n_prompt = [int(answers[r["i"]]["n_prompt"]) for r in self.index]
        binf = data / "features.bin"
        n = binf.stat().st_size // (2 * width) if binf.exists() else 0
        if any(r["row"] + r["n"] > n for r in self.index):
            raise SpecDraftError(f"{binf} is shorter than {data / 'features.jsonl'} says; delete both to make the "
                                 "features again")
        # copy-on-write: torch wants a writable array; nothing writes to it
        mm = np.memmap(binf, dtype=np.int16, mode="c", shape=(n, width))
        self.feats = torch.from_numpy(mm).view(torch.bfloat16)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def answer_tokens(self) -> int:
        return sum(len(t) - n for t, n in zip(self.tokens, self.n_prompt))

    def features(self, k: int, n: int) -> torch.Tensor:
        r = self.index[k]["row"]
        return self.feats[r: r + n].float()


def ttt_batch(data: Eagle3Data, idx: list[int], t2d_index: torch.Tensor, K: int, max_len: int):
    """Right-padded batch of P = L - 1 anchors: features F_t [B, P, 3H]; tokens [B, P + K] (x_{t+1}
    onwards: step j feeds column t + j); labels [B, P, K] (step j at anchor t: x_{t+j+2} as a draft
    vocabulary index, -100 off the answer, past the end or outside the draft vocabulary)."""
    seqs = [(data.tokens[i][:max_len], data.n_prompt[i], i) for i in idx]
    P = max(len(t) for t, _, _ in seqs) - 1
    F = torch.zeros(len(seqs), P, data.feats.shape[1])
    toks = torch.zeros(len(seqs), P + K, dtype=torch.long)
    labels = torch.full((len(seqs), P, K), -100, dtype=torch.long)
    for b, (x, n0, i) in enumerate(seqs):
        T = len(x)
        F[b, : T - 1] = data.features(i, T - 1)
        toks[b, : T - 1] = x[1:]
        t = torch.arange(T - 1)
        for j in range(K):
            at = t + j + 2
            ok = (at < T) & (at >= n0)
            labels[b, t[ok], j] = t2d_index[x[at[ok]]]
    return F, toks, labels


def ttt_mask(P: int, j: int, dtype: torch.dtype) -> torch.Tensor:
    """Step j's additive mask [1, 1, P, (j + 1) P] over the head's cache of steps 0..j (module doc)."""
    blocks = [torch.tril(torch.ones(P, P, dtype=torch.bool))] + [torch.eye(P, dtype=torch.bool)] * j
    allow = torch.cat(blocks, dim=1)
    return torch.zeros(allow.shape, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)[None, None]


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast where the CPU (or GPU) runs bf16 matrix work natively, float32 elsewhere."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def ttt_loss(head, embed, F, toks, labels, device, bf16: bool = False) -> tuple[torch.Tensor, list[float]]:
    """The training-time test over K = labels.shape[-1] draft steps (module doc); ``embed``: the target's
    frozen embedding (ids -> [.., H]). -> (sum_j 0.8^j cross-entropy_j, step accuracies)."""
    B, P, K = labels.shape
    cache = head.new_cache()
    feats = F.to(device)
    labels = labels.to(device)
    total, accs = 0.0, []
    with autocast(device, bf16):
        for j in range(K):
            with torch.no_grad():
                e = embed(toks[:, j: j + P]).to(device)
            pos = (torch.arange(P, device=device) + j)[None].expand(B, P)
            mask = ttt_mask(P, j, torch.bfloat16 if bf16 else feats.dtype).to(device).expand(B, 1, P, (j + 1) * P)
            out = head(feats, e, cache=cache, position_ids=pos, attention_mask=mask)
            logits = head.draft_logits(out).float()
            y = labels[:, :, j]
            ok = y >= 0
            if ok.any():
                total = total + TTT_DECAY ** j * nn.functional.cross_entropy(logits[ok], y[ok])
                accs.append(float((logits[ok].argmax(-1) == y[ok]).float().mean()))
            feats = out
    if not torch.is_tensor(total):
        total = out.sum() * 0
    return total, accs


def cpu_has_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively (AVX512_BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags
