"""What a trained head reads from a GGUF model (``Capabilities.head_io``), straight from the file: the
architecture facts in its metadata and rows of its input embedding and LM head, dequantized on demand.
The llama.cpp and OpenVINO backends load GGUF files and share this (``GGUFHeadIO``).

Each row of a quantized matrix is a whole number of quantization blocks, so a row dequantizes on its own:
``embed(ids)`` reads only the requested rows' bytes (the memory-mapped file), never the whole matrix.
transformers' GGUF loader (which made the catalog's dense copies) dequantizes with the same function and
permutes neither matrix, so the rows equal the dense copy's ``embed`` / ``output_rows`` exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.device import HOST
from ..core.errors import ModelFileError
from .base import ModelFacts

CHUNK_ROWS = 8192  # output_rows(None) dequantizes this many rows at a time (bounds the temporaries)


@dataclass(frozen=True)
class QuantRows:
    """One matrix of the file: its rows' raw bytes (memory-mapped, [rows, bytes per row]) and their type."""

    data: np.ndarray
    qtype: object  # gguf.GGMLQuantizationType
    cols: int

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    def take(self, ids: np.ndarray) -> np.ndarray:
        """float32 [len(ids), cols] of rows ``ids``."""
        from gguf.quants import dequantize

        return dequantize(self.data[ids], self.qtype).reshape(len(ids), self.cols).astype(np.float32, copy=False)

    def all(self) -> np.ndarray:
        out = np.empty((self.rows, self.cols), np.float32)
        for at in range(0, self.rows, CHUNK_ROWS):
            out[at : at + CHUNK_ROWS] = self.take(np.arange(at, min(at + CHUNK_ROWS, self.rows)))
        return out


@dataclass(frozen=True)
class GGUFHead:
    facts: ModelFacts
    embedding: QuantRows  # token_embd.weight
    head: QuantRows  # output.weight, or token_embd.weight where the file ties the LM head to the embedding


def tensor_types(path: Path) -> set[str]:
    """The quantization types (``Q4_0``, ``Q6_K``, ``F32``, ...) of the tensors in the GGUF file at ``path``."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ModelFileError(f"cannot read {path} as a GGUF file: {e}") from e
    return {t.tensor_type.name for t in reader.tensors}


def read_head(path: Path) -> GGUFHead:
    """The facts and the two matrices' rows of the GGUF file at ``path`` (the reader itself, with its
    parsed vocabulary, is not kept)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ModelFileError(f"cannot read {path} as a GGUF file: {e}") from e
    tensors = {t.name: t for t in reader.tensors if t.name in ("token_embd.weight", "output.weight")}
    if "token_embd.weight" not in tensors:
        raise ModelFileError(f"{path.name} has no token_embd.weight tensor")
    mats = {name: QuantRows(t.data, t.tensor_type, int(t.shape[0])) for name, t in tensors.items()}
    head = mats.get("output.weight", mats["token_embd.weight"])
    return GGUFHead(_facts(reader, path, head.rows), mats["token_embd.weight"], head)


def _facts(reader, path: Path, vocab: int) -> ModelFacts:
    """ModelFacts from the file's ``{arch}.*`` metadata (the keys llama.cpp reads)."""

    def field(key: str, default=None):
        f = reader.fields.get(key)
        if f is None:
            if default is None:
                raise ModelFileError(f"{path.name} lacks the GGUF metadata {key!r}")
            return default
        v = f.contents()
        return max(v) if isinstance(v, list) else v  # per-layer arrays (some architectures): the widest

    arch = str(field("general.architecture"))
    hidden, heads = int(field(f"{arch}.embedding_length")), int(field(f"{arch}.attention.head_count"))
    return ModelFacts(
        model_type=arch,
        hidden_size=hidden,
        num_layers=int(field(f"{arch}.block_count")),
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field(f"{arch}.context_length")),
    )


def _rows(mat: QuantRows, ids: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1).cpu().numpy().astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= mat.rows):
        raise IndexError(f"token ids must lie in [0, {mat.rows}); got {int(flat.min())}..{int(flat.max())}")
    return torch.from_numpy(mat.take(flat)).reshape(*ids.shape, mat.cols)


class GGUFHeadIO:
    """``facts``, ``embed()`` and ``output_rows()`` of a backend that loads the GGUF file ``self.gguf``
    (float32, dequantized from the file on demand; the file is read on first use)."""

    gguf: Path

    @functools.cached_property
    def _gguf_head(self) -> GGUFHead:
        return read_head(Path(self.gguf))

    @property
    def facts(self) -> ModelFacts:
        return self._gguf_head.facts

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``ids`` [..., H], float32."""
        return _rows(self._gguf_head.embedding, torch.as_tensor(ids, device=HOST))

    def output_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's rows ``ids`` [n, H] (every row for None: a dequantized copy), float32."""
        head = self._gguf_head.head
        if ids is None:
            return torch.from_numpy(head.all())
        return _rows(head, torch.as_tensor(ids, device=HOST).reshape(-1))
