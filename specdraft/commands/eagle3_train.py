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

from ..core.errors import SpecDraftError
from ..core.jsonl import AppendedJsonl

TTT_DECAY = 0.8  # step j's loss weight is 0.8^j (EAGLE-3's and SpecForge's)


class Eagle3Data:
    """The answered sequences that have features (DIR/data), features memory-mapped. A sequence whose
    features were written twice (a run stopped between its two appends) reads the last copy."""

    def __init__(self, data: Path, width: int, max_rows: int | None = None):
        import numpy as np

        answers = {r["i"]: r for r in AppendedJsonl(data / "answers.jsonl", need=("i", "tokens", "n_prompt")).rows}
        index = {r["i"]: r for r in AppendedJsonl(data / "features.jsonl", need=("i", "row", "n")).rows}
        keep = sorted(i for i in index if i in answers and index[i]["n"] == len(answers[i]["tokens"]) - 1)
        if max_rows is not None:
            keep = keep[:max_rows]
        if not keep:
            raise SpecDraftError(f"{data} holds no answered sequences with features yet")
        self.ids = keep
        self.rows = [int(index[i]["row"]) for i in keep]
        self.tokens = [torch.tensor(answers[i]["tokens"], dtype=torch.long) for i in keep]
        self.n_prompt = [int(answers[i]["n_prompt"]) for i in keep]
        n = max(index[i]["row"] + index[i]["n"] for i in index)
        size = (data / "features.bin").stat().st_size
        if size < n * width * 2:
            raise SpecDraftError(f"{data}/features.bin holds {size} bytes, its index needs {n * width * 2}")
        # copy-on-write: torch wants a writable array; nothing writes to it
        mm = np.memmap(data / "features.bin", dtype=np.int16, mode="c", shape=(n, width))
        self.feats = torch.from_numpy(mm).view(torch.bfloat16)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def answer_tokens(self) -> int:
        return sum(len(t) - n for t, n in zip(self.tokens, self.n_prompt))

    def features(self, k: int, n: int) -> torch.Tensor:
        r = self.rows[k]
        return self.feats[r: r + n].float()


def draft_vocab(data: Eagle3Data, n: int, vocab: int) -> tuple[torch.Tensor, float]:
    """The n most frequent answer tokens (ties: the lower id), sorted: the draft vocabulary; -> (ids,
    the share of answer tokens they cover)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for toks, n0 in zip(data.tokens, data.n_prompt):
        counts += torch.bincount(toks[n0:], minlength=vocab)[:vocab]
    order = torch.sort(counts, descending=True, stable=True).indices[: min(n, vocab)]
    covered = float(counts[order].sum()) / max(float(counts.sum()), 1.0)
    return torch.sort(order).values, covered


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
