"""Keys and values written into a llama.cpp sequence, so that a low-bit copy of a transformers target
(``--draft self:Q4_0 --draft-backend llama``) starts from the target's prompt cache instead of
prefilling the prompt again: on 2 cores a 700-token prefill on llama.cpp costs about as much as the
target's own (measured 2026-12-03, AMD EPYC: 7-9 s); without them the draft's time on 27 Spec-Bench
prompts fell from 141 s to 52 s (docs/benchmark-log.md).

The only way into llama.cpp's cache is a sequence's saved state (``llama_state_seq_set_data``), whose
layout is llama.cpp's own (src/llama-kv-cache.cpp, ``state_write``; unified cache, so one stream):

    u32 magic, i32 seq_id (llama-context.cpp); u32 n_stream (1); u32 cell_count;
    per cell: i32 pos, u32 n_seq_id (1), i32 seq_id;
    u32 v_trans; u32 n_layer; per layer: i32 k_type, u64 k_row_bytes, cell_count rows of K;
    V per layer, either i32 v_type, u64 v_row_bytes, rows (v_trans 0) or i32 v_type, u32 v_elem_bytes,
    u32 n_embd_v, then n_embd_v rows of cell_count elements (v_trans 1: V transposed).

``layout`` reads that layout back from a one-token state of the model itself and refuses anything
else (another format, a cache type other than f16, per-cell extras): the caller then prefills as
before, so a llama.cpp upgrade that changes the format costs speed, never correctness. Both caches
hold keys after RoPE. Where llama.cpp rotates interleaved pairs (rope type NORM: Llama; its GGUF
converter permuted q/k's rows to match), a head's dimensions i and i + d/2 of transformers' keys (its
rotate-half pairs) are llama.cpp's 2i and 2i + 1; NEOX models (Qwen2) rotate halves like transformers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

F16 = 1  # ggml_type GGML_TYPE_F16


@dataclass(frozen=True)
class StateLayout:
    magic: int
    n_layer: int
    n_embd_k: int
    n_embd_v: int
    v_trans: bool
    head_dim: int = 0  # set with interleaved, by the model (the state does not say)
    interleaved: bool = False  # llama.cpp's RoPE rotates pairs (2i, 2i + 1): keys are permuted to it

    def fits(self, kv: list) -> bool:
        """Whether ``kv`` (per layer: keys, values [n_tokens, n_embd]) is this model's shape."""
        return len(kv) == self.n_layer and kv[0][0].shape[1] == self.n_embd_k and kv[0][1].shape[1] == self.n_embd_v


def parse_one_cell(blob: bytes) -> StateLayout | None:
    """The layout of a one-cell sequence state, or None where it is not the one this module writes."""
    try:
        magic, _, n_stream, cells, _pos, n_seq, _sid, v_trans, n_layer = struct.unpack_from("<IiIIiIiII", blob, 0)
        if (n_stream, cells, n_seq) != (1, 1, 1) or v_trans not in (0, 1):
            return None
        at, k_rows = 36, set()
        for _ in range(n_layer):
            k_type, k_row = struct.unpack_from("<iQ", blob, at)
            at += 12 + k_row
            k_rows.add((k_type, k_row))
        v_rows = set()
        for _ in range(n_layer):
            if v_trans:
                v_type, el, n_v = struct.unpack_from("<iII", blob, at)
                at += 12 + el * n_v
                v_rows.add((v_type, el * n_v))
            else:
                v_type, v_row = struct.unpack_from("<iQ", blob, at)
                at += 12 + v_row
                v_rows.add((v_type, v_row))
    except struct.error:
        return None
    if at != len(blob) or len(k_rows) != 1 or len(v_rows) != 1:
        return None
    (k_type, k_row), (v_type, v_row) = k_rows.pop(), v_rows.pop()
    if k_type != F16 or v_type != F16:
        return None
    return StateLayout(magic, n_layer, k_row // 2, v_row // 2, bool(v_trans))


def state_blob(layout: StateLayout, seq_id: int, kv: list[tuple[np.ndarray, np.ndarray]]) -> bytes:
    """A sequence state holding ``kv`` (per layer: keys and values [n_tokens, n_embd], float16) at
    positions 0..n-1."""
    n = kv[0][0].shape[0] if kv else 0
    parts = [
        struct.pack("<IiII", layout.magic, seq_id, 1, n),
        np.rec.fromarrays([np.arange(n, dtype="<i4"), np.ones(n, "<u4"), np.full(n, seq_id, "<i4")]).tobytes(),
        struct.pack("<II", int(layout.v_trans), layout.n_layer),
    ]
    for k, _ in kv:
        k = _interleave(k, layout.head_dim) if layout.interleaved else k
        parts += [struct.pack("<iQ", F16, 2 * layout.n_embd_k), np.ascontiguousarray(k, "<f2").tobytes()]
    for _, v in kv:
        if layout.v_trans:
            parts += [struct.pack("<iII", F16, 2, layout.n_embd_v), np.ascontiguousarray(v.T, "<f2").tobytes()]
        else:
            parts += [struct.pack("<iQ", F16, 2 * layout.n_embd_v), np.ascontiguousarray(v, "<f2").tobytes()]
    return b"".join(parts)


def _interleave(k: np.ndarray, d: int) -> np.ndarray:
    """Keys [n, heads * d] with each head's halves (i, i + d/2) moved to (2i, 2i + 1)."""
    n = k.shape[0]
    return k.reshape(n, -1, 2, d // 2).swapaxes(2, 3).reshape(n, -1)
