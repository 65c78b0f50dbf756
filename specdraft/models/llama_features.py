"""Decoder layers' outputs out of llama.cpp's graph (``LlamaModel.add_feature_layers``): what a trained
head (EAGLE-3) reads from the target on the llama backend.

llama.cpp names the output of decoder layer i (0-based, the residual stream after its feed-forward
add) ``l_out-i``: hidden-states index i + 1 in transformers' counting. A context created with a graph eval
callback (``llama_context_params.cb_eval``) asks the callback about every graph node before computing it
(``ask``); for a node it wants, the scheduler computes the graph up to that node, synchronizes, and calls
again with the result, which we copy out through ggml's own accessors (no struct offsets). Only the
contexts made after ``add_feature_layers`` carry the callback; between forwards that want features it
answers "no" at once, so their graphs still run in one piece (its cost: models/llama.py's module doc).

Order: the layer tensors hold [n_embd, n_tokens] in the micro-batch's token order. With the unified KV
cache llama.cpp splits a batch only with ``split_simple`` (llama-batch.cpp), which takes the batch's
tokens in order, ``n_ubatch`` at a time, so the micro-batches of a decode, concatenated, are the batch
in the order we built it. The last decoder layer is the exception: llama.cpp keeps only the tokens whose
logits were asked for before its feed-forward (``inp_out_ids``), so when that layer is wanted every
token of the batch asks for logits (``FeatureTap.all_outputs``). The row counts are checked against
the batch, so a llama.cpp that ordered differently fails loudly rather than misplacing features.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

LAYER_OUT = "l_out-{}"  # llama.cpp's name of decoder layer i's output (0-based)


@functools.cache
def ggml():
    """ggml's library (llama-cpp-python's copy), with the signatures of the accessors used here."""
    from llama_cpp import _ggml

    lib = _ggml.libggml
    t = ctypes.c_void_p
    for name, res, args in [
        ("ggml_get_name", ctypes.c_char_p, [t]),
        ("ggml_nelements", ctypes.c_int64, [t]),
        ("ggml_nrows", ctypes.c_int64, [t]),
        ("ggml_nbytes", ctypes.c_size_t, [t]),
        ("ggml_is_contiguous", ctypes.c_bool, [t]),
        ("ggml_backend_tensor_get", None, [t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
    ]:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


class FeatureTap:
    """One context's graph eval callback: between ``begin`` and ``end`` it copies out the wanted layers'
    outputs of every decode, in the batch's token order."""

    def __init__(self):
        import llama_cpp

        self.want: dict[bytes, int] = {}  # tensor name -> its block
        self.seen: list[list[np.ndarray]] = []  # per block: [tokens, n_embd] per micro-batch, in compute order
        self.error: BaseException | None = None
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._eval)  # llama.cpp keeps the pointer

    def begin(self, layers: tuple[int, ...]) -> None:
        """Capture these hidden-states indices (1 = the first decoder layer's output) from now on."""
        self.want = {LAYER_OUT.format(i - 1).encode(): b for b, i in enumerate(layers)}
        self.seen = [[] for _ in layers]
        self.error = None

    @staticmethod
    def all_outputs(layers: tuple[int, ...], num_layers: int) -> bool:
        """Whether every token must ask for logits for the last layer's output to cover it (module doc)."""
        return num_layers in layers

    def end(self, n_tokens: int, layers: tuple[int, ...]) -> np.ndarray:
        """Stop capturing; -> [n_tokens, len(layers) * n_embd] float32: the decodes' tokens in feed order."""
        seen, error = self.seen, self.error
        self.stop()
        if error is not None:
            raise RuntimeError(f"copying llama.cpp's layer outputs failed: {error}") from error
        blocks = []
        for i, parts in zip(layers, seen):
            got = sum(len(p) for p in parts)
            if got != n_tokens:
                raise RuntimeError(
                    f"llama.cpp handed over {got} rows of {LAYER_OUT.format(i - 1)} for a feed of "
                    f"{n_tokens} tokens ({'no such tensor in its graph' if not parts else 'rows lost'})"
                )
            blocks.append(np.concatenate(parts) if len(parts) > 1 else parts[0])
        return np.concatenate(blocks, axis=1) if len(blocks) > 1 else blocks[0]

    def stop(self) -> None:
        """Capture nothing (what a failed decode leaves behind is dropped)."""
        self.want, self.seen, self.error = {}, [], None

    def _eval(self, t, ask: bool, user_data) -> bool:
        """ask: whether the node ``t`` is wanted (its data read after it is computed); else the node was
        computed: copy it out and return True (False would abort the graph). Never raises: an error is kept
        for ``end``."""
        if not self.want:
            return not ask
        try:
            lib = ggml()
            block = self.want.get(lib.ggml_get_name(t))
            if block is None or ask:
                return block is not None or not ask
            n, rows = lib.ggml_nelements(t), lib.ggml_nrows(t)
            if lib.ggml_nbytes(t) != 4 * n or not lib.ggml_is_contiguous(t):
                raise TypeError(f"{lib.ggml_get_name(t).decode()} is not a contiguous float32 tensor")
            out = np.empty((rows, n // max(rows, 1)), np.float32)  # 0 rows: see end()
            lib.ggml_backend_tensor_get(t, out.ctypes.data, 0, 4 * n)
            self.seen[block].append(out)
        except BaseException as e:  # an exception cannot cross ctypes' callback; end() raises it
            self.error = self.error or e
        return True
