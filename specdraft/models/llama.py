"""The llama.cpp backend: a GGUF model on llama.cpp's kernels behind the model interface
(models/base.py), through llama-cpp-python's low-level API.

- ``LlamaModel``: the loaded weights (memory-mapped, shared by every context) and the model's facts;
  ``new_rows()`` hands out a llama.cpp context (its own KV cache), recycled through a small pool
  because a context is per engine and an engine is per request.
- ``LlamaRows``: the decode loop's rows, one llama.cpp sequence id per row in ONE unified KV cache.
  A forward is one ``llama_decode`` of a batch in which every token carries its position, its
  sequence ids and an output flag: logits are computed only at the positions the caller reads.
  Rollback is ``llama_memory_seq_rm``; no slot is ever a hole.

A token tree is a set of sequences: each leaf gets a sequence id (the row's own for the first leaf,
spare ids for the others; the committed prefix is copied into them with ``seq_cp``, which shares
cells and copies nothing), and a node belongs to the sequences of every leaf below it. llama.cpp
masks a query token by its FIRST sequence id and position (a cell is visible when it is in that
sequence at a position <= the token's): a node's first sequence is a leaf below it, so it sees the
prefix, its ancestors and itself, and nothing else. ``commit`` keeps the accepted path in the row's
sequence (``seq_cp`` from the accepted leaf's sequence) and drops the spare sequences; cells no
sequence holds any more are free.

Trained heads (EAGLE-3): ``add_feature_layers`` makes the contexts created from then on carry a graph eval
callback that copies the requested decoder layers' outputs out of llama.cpp's graph (llama_features.py);
``forward(hidden=True)`` and ``add_rows(hidden=True)`` hand them over (no final-norm block:
``capabilities.hidden`` is False). llama.cpp asks the callback about every node of the graph (about 960 on
Qwen2.5-Coder-1.5B); measured 2026-12-05 on an AMD EPYC (Zen 4, 2 threads, other jobs sharing the CPU)
from the time spent in the callback and a C-to-Python call's cost: about 0.5 ms per decode where it
copies nothing and 1.3 ms where it copies 3 layers, with 1 or 16 rows alike (a decode there takes 95 ms
or more). Contexts without the tap pay nothing.

Numerics: llama.cpp's kernels differ between a 1-token and an n-token batch (like bf16 in
transformers), so speculative greedy output is compared with plain decoding on this backend, each
divergence reported with the target's top-2 logit gap (tests/test_llama_backend.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..core.device import HOST
from ..core.errors import ConfigError, ContextLengthError, ModelFileError
from ..core.extras import needs_extra
from .base import Capabilities, SavedPrefix, padded_features
from .gguf_tensors import GGUFHeadIO
from .llama_features import FeatureTap

DEFAULT_CTX = 8192  # KV cells per context (all rows together); SPECDRAFT_LLAMA_CTX overrides
MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: rows + spare sequences of token trees
N_BATCH = 512  # tokens per llama_decode call (a longer prefill is split)
N_UBATCH = N_BATCH  # tokens per graph evaluation inside one decode (llama.cpp's micro-batch)
# llama.cpp's own default (auto: on for these CPUs). With it, an n-token batch of up to 48 tokens gave
# bit-identical logits to n single-token steps on SmolLM2 Q4_1, and without it 2 tokens already
# differed by up to 3 logits; Q4_K_M's repacked kernels differ from 4 tokens on either way.
FLASH_ATTN = int(os.environ.get("SPECDRAFT_LLAMA_FA", "-1"))


@functools.cache
def _ggml_thread() -> ThreadPoolExecutor | None:
    """The one thread that runs ggml's work, where the build has AMX kernels (None elsewhere).

    ggml's AMX kernels load their tile configuration once per thread and assume it stays; oneDNN (torch's
    bf16 and int8 matmuls on AMX) reconfigures and releases the tiles of the thread it runs on, so a later
    ggml tile instruction there faults (SIGILL at ``tilezero``: a bf16 target with a llama.cpp draft on
    the amx-clang build). On a thread of its own ggml's configuration is never disturbed.
    SPECDRAFT_LLAMA_THREAD=1 / 0 forces it on / off."""
    forced = os.environ.get("SPECDRAFT_LLAMA_THREAD")
    amx = b"AMX_INT8 = 1" in lib().llama_print_system_info() if forced is None else forced == "1"
    return ThreadPoolExecutor(1, thread_name_prefix="ggml") if amx else None


def on_ggml_thread(fn, *args):
    """``fn(*args)``, on ggml's own thread where the build needs one (``_ggml_thread``)."""
    pool = _ggml_thread()
    return fn(*args) if pool is None else pool.submit(fn, *args).result()


def lib():
    """The llama_cpp module, initialised once, its log quiet below errors."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ConfigError(needs_extra("the llama backend", "llama", e)) from e
    if not getattr(lib, "ready", False):
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        lib.ready = True
    return llama_cpp


CUDA_BUILD = (
    'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python '
    "(`make setup` builds it for the CPU)"
)


def gpu_offload(device: str, flag: str = "--device") -> bool:
    """Whether llama.cpp puts every layer on the GPU for the device setting ``device`` (its kind is cpu, cuda
    or auto: backends.placement checked it): ``auto`` offloads where this llama-cpp-python build can
    (``llama_supports_gpu_offload``: a CUDA build that finds a GPU), ``cuda`` must. llama.cpp picks its
    GPUs itself (CUDA_VISIBLE_DEVICES chooses), so ``cuda:N`` is refused."""
    if device == "cpu":
        return False
    if device not in ("auto", "cuda"):
        raise ConfigError(
            f"{flag} {device}: the llama backend takes --device cuda (llama.cpp spreads the layers "
            "over the GPUs it sees; CUDA_VISIBLE_DEVICES picks them)"
        )
    can = bool(lib().llama_supports_gpu_offload())
    if device == "cuda" and not can:
        raise ConfigError(
            f"{flag} cuda: this llama-cpp-python cannot offload to a GPU (a CPU-only build, or no "
            f"GPU found); for NVIDIA GPUs install a CUDA build: {CUDA_BUILD}"
        )
    return can


def _log_cb(level, text, user_data):
    """Print llama.cpp's errors only (ggml levels: 4 = ERROR, 5 = a continuation of the last line)."""
    if level != 5:
        _log_cb.last = level
    if _log_cb.last == 4:
        import sys

        sys.stderr.write(text.decode("utf-8", "replace"))


_log_cb.last = 0


def _make_quiet_log():
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.llama_log_callback(_log_cb)


_quiet_log = _make_quiet_log()  # a module global: llama.cpp keeps the pointer


def safe_extra_bufts(path: Path, name: str) -> bool:
    """Whether this model may load with llama.cpp's extra buffer types (AMX, repacked weights) on this
    build and CPU, from the probe (llama_probe.py): never load a configuration that crashed there."""
    from .llama_probe import probe_record

    if os.environ.get("SPECDRAFT_LLAMA_PROBE", "1") == "0":  # the operator vouches for this build
        return True
    rec = probe_record(path)
    if rec["extra_bufts"] is None and not rec["crashed"]:  # the file, not the build: llama.cpp cannot read it
        raise ModelFileError(f"llama.cpp cannot load {name} from {path} (a probe {rec['default']})")
    if rec["extra_bufts"] is None:
        raise ConfigError(
            f"llama.cpp cannot decode multi-token batches of {name} on this CPU (a probe "
            f"{rec['default']} with its default buffers, {rec['fallback']} without them); "
            "`make setup` rebuilds it for this CPU, or use --backend hf"
        )
    if not rec["extra_bufts"] and name not in _warned:
        _warned.add(name)
        import sys

        print(
            f"[specdraft] llama.cpp's default weight buffers crash on this CPU (a probe {rec['default']}); "
            f"loading {name} without its extra buffer types (slower batches; `make setup` rebuilds llama.cpp "
            "without the feature that crashes)",
            file=sys.stderr,
        )
    return bool(rec["extra_bufts"])


_warned: set[str] = set()


def _per_row(feats: np.ndarray, lengths: list[int]) -> list:
    """Features of tokens fed row after row -> each row's [its tokens, W] (None: it fed none)."""
    ends = np.cumsum(lengths, dtype=np.int64)
    return [feats[e - n : e] if n else None for n, e in zip(lengths, ends.tolist())]


def threads() -> int:
    """The thread count llama.cpp uses: torch's (``set_threads`` / the tests' SPECDRAFT_THREADS)."""
    return max(1, torch.get_num_threads())


class LlamaModel(GGUFHeadIO):
    """A GGUF file loaded by llama.cpp (weights memory-mapped), with the target's tokenizer; ``facts``,
    ``embed`` and ``output_rows`` read the same file (gguf_tensors.py)."""

    backend = "llama"
    source: dict | None = None  # set by load_model (models/backends.py); None: made in memory
    prefill_twin = None  # set by api._self_draft (models/base.py TargetModel)
    device = HOST  # its logits and features come back as host arrays, wherever its weights run

    def __init__(
        self, path: str | Path, tokenizer=None, name: str | None = None, n_ctx: int | None = None, offload: bool = False
    ):
        """``offload``: every layer on the GPU (``gpu_offload``); else none, whatever the build's default."""
        ll = lib()
        path = Path(path)
        if not path.is_file():
            raise ModelFileError(f"GGUF file {path} not found")
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = -1 if offload else 0  # -1: all of them
        self.offload = offload
        self.extra_bufts = mp.use_extra_bufts = safe_extra_bufts(path, name or path.stem)
        self._model = ll.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise ModelFileError(
                f"llama.cpp could not load {path}: not a valid GGUF model file (corrupt or truncated?)"
            )
        self.path = self.gguf = path
        self.name = name or path.stem
        self.tokenizer = tokenizer
        self._vocab = ll.llama_model_get_vocab(self._model)
        self._n_vocab = int(ll.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(ll.llama_model_n_ctx_train(self._model))
        self.n_ctx = int(n_ctx or os.environ.get("SPECDRAFT_LLAMA_CTX", 0) or min(self.n_ctx_train, DEFAULT_CTX))
        self.num_layers = int(ll.llama_model_n_layer(self._model))
        self.n_embd = int(ll.llama_model_n_embd(self._model))
        self.feature_layers: tuple[int, ...] = ()  # decoder layers handed over in forward(hidden=True)
        self._pools: dict[bool, list] = {False: [], True: []}  # idle (context, tap) pairs (cleared), by whether
        # they carry the feature tap; reused by new_rows
        self._eos: set[int] | None = None

    # --- facts ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def max_context(self) -> int:
        return self.n_ctx

    @property
    def dtype(self):
        return torch.float32  # logits come back in float32; the weights are whatever the GGUF holds

    def eos_token_ids(self) -> set[int]:
        """llama.cpp's end-of-generation tokens (EOS, EOT, ...), plus the tokenizer's EOS."""
        if self._eos is None:
            ll = lib()
            ids = {int(ll.llama_vocab_eos(self._vocab)), int(ll.llama_vocab_eot(self._vocab))}
            ids |= {t for t in range(self._n_vocab) if ll.llama_vocab_is_eog(self._vocab, t)}
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                ids.add(int(self.tokenizer.eos_token_id))
            self._eos = {t for t in ids if 0 <= t < self._n_vocab}
        return set(self._eos)

    # token trees: a sequence id per leaf (module doc); decoder layers' outputs: llama_features.py
    capabilities = Capabilities(hidden=False, trees=True, layers=True, head_io=True, prefixes=True)

    def add_feature_layers(self, layers) -> list[int]:
        """Hand over these decoder layers' outputs (hidden-states indices: i = the output of decoder layer
        i - 1, 1 <= i <= num_layers) in every forward(hidden=True) / add_rows(hidden=True) of rows made from
        now on; -> the block of ``last_hidden`` each fills (no final-norm block: the first layer is block 0).
        Layers already handed over keep their blocks."""
        bad = [i for i in layers if not 1 <= int(i) <= self.num_layers]
        if bad:
            raise ConfigError(f"{self.name} has no decoder layer output {bad} to hand over (1..{self.num_layers})")
        self.feature_layers += tuple(int(i) for i in dict.fromkeys(layers) if int(i) not in self.feature_layers)
        if self.feature_layers:  # idle contexts without the tap are never handed out again: free their caches
            self._free_contexts(self._pools[False])
        return [self.feature_layers.index(int(i)) for i in layers]

    # --- contexts ------------------------------------------------------------------------------
    def _context(self) -> tuple:
        """-> (a cleared context, its FeatureTap or None): contexts made once feature layers were added
        carry the tap; the others run their graphs without a callback."""
        ll = lib()
        n = threads()
        tapped = bool(self.feature_layers)
        if self._pools[tapped]:
            ctx, tap = self._pools[tapped].pop()
        else:
            tap = FeatureTap() if tapped else None
            cp = ll.llama_context_default_params()
            cp.n_ctx = self.n_ctx
            cp.n_batch, cp.n_ubatch = N_BATCH, N_UBATCH
            cp.n_seq_max = MAX_SEQ
            cp.kv_unified = True  # a tree node's cell belongs to several sequences of one row
            cp.n_threads = cp.n_threads_batch = n
            cp.no_perf = True
            cp.flash_attn_type = FLASH_ATTN
            if tap is not None:
                cp.cb_eval = tap.callback
            ctx = ll.llama_init_from_model(self._model, cp)
            if not ctx:
                raise ModelFileError(f"llama.cpp could not create a context of {self.n_ctx} tokens for {self.name}")
        ll.llama_set_n_threads(ctx, n, n)
        return ctx, tap

    def _release(self, ctx, tap) -> None:
        ll = lib()
        if tap is None and self.feature_layers:  # a context without the tap is not handed out again
            ll.llama_free(ctx)
            return
        # the cells' metadata only: zeroing the buffers too cost 23 ms per request (Qwen 1.5B) and buys
        # nothing, since a cell is read only after a decode has written it
        ll.llama_memory_clear(ll.llama_get_memory(ctx), False)
        self._pools[tap is not None].append((ctx, tap))

    @staticmethod
    def _free_contexts(pool: list) -> None:
        while pool:
            lib().llama_free(pool.pop()[0])

    def new_rows(self, compact_slack: int = 32) -> "LlamaRows":
        return LlamaRows(self)

    @functools.cached_property
    def state_layout(self):
        """The layout of this model's saved sequence states (llama_kv.py), read from a one-token state;
        None where it is not the one ``adopt_rows`` writes."""
        from .llama_kv import parse_one_cell

        ll, rows = lib(), self.new_rows()
        rows.add_rows([[0]])
        n = int(ll.llama_state_seq_get_size(rows.ctx, rows.seq[0]))
        buf = (ctypes.c_uint8 * n)()
        got = ll.llama_state_seq_get_data(rows.ctx, buf, n, rows.seq[0])
        layout = parse_one_cell(bytes(buf)) if got == n else None
        if layout is None:
            return None
        m = self._model
        interleaved = ll.llama_model_rope_type(m) == ll.LLAMA_ROPE_TYPE_NORM
        return dataclasses.replace(
            layout, head_dim=ll.llama_model_n_embd(m) // ll.llama_model_n_head(m), interleaved=interleaved
        )

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """llama.cpp's own tokenizer (the tests compare it with the transformers tokenizer)."""
        ll = lib()
        raw = text.encode()
        buf = (ll.llama_token * (len(raw) + 8))()
        n = ll.llama_tokenize(self._vocab, raw, len(raw), buf, len(buf), False, special)
        return list(buf[:n])

    def __del__(self):
        try:
            ll = lib()
            self._free_contexts(self._pools[False])
            self._free_contexts(self._pools[True])
            if getattr(self, "_model", None):
                ll.llama_model_free(self._model)
                self._model = None
        except Exception:  # interpreter shutdown
            pass


class LlamaRows:
    """B rows over one llama.cpp context: row r is sequence ``seq[r]`` of the unified KV cache."""

    def __init__(self, model: LlamaModel):
        self.model = model
        self.ll = lib()
        self.ctx, self.tap = model._context()
        self.mem = self.ll.llama_get_memory(self.ctx)
        self.V = model.vocab_size
        self.lens: list[int] = []
        self.seq: list[int] = []  # row -> its sequence id
        self.free = list(range(MAX_SEQ - 1, -1, -1))  # unused sequence ids (pop from the end)
        self.last_hidden = None
        self.prefill_hidden: list = []
        self._tree_seqs: list = []  # per row of the last forward: (leaf seq of each fed token, spare seqs) or None
        self._batch = None
        self._cap = 0

    @property
    def B(self) -> int:
        return len(self.lens)

    @property
    def L(self) -> int:
        return max(self.lens, default=0)

    def __del__(self):
        try:
            if self._batch is not None:
                self.ll.llama_batch_free(self._batch)
            self.model._release(self.ctx, self.tap)
        except Exception:
            pass

    # --- the batch -----------------------------------------------------------------------------
    def _new_batch(self, n: int):
        if n > self._cap:
            if self._batch is not None:
                self.ll.llama_batch_free(self._batch)
            self._cap = max(n, 64)
            self._batch = self.ll.llama_batch_init(self._cap, 0, MAX_SEQ)
        self._batch.n_tokens = 0
        return self._batch

    @staticmethod
    def _put(b, token: int, pos: int, seqs, out: bool) -> None:
        i = b.n_tokens
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = len(seqs)
        sid = b.seq_id[i]
        for j, s in enumerate(seqs):
            sid[j] = s
        b.logits[i] = out
        b.n_tokens = i + 1

    def _decode(self, b) -> None:
        rc = on_ggml_thread(self.ll.llama_decode, self.ctx, b)
        if rc == 1:
            raise ContextLengthError(
                f"the llama.cpp context of {self.model.n_ctx} tokens (all rows together) is full; "
                "raise SPECDRAFT_LLAMA_CTX or admit fewer requests at once"
            )
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    # --- rows join and leave -------------------------------------------------------------------
    def add_rows(
        self, prefixes: list[list[int]], hidden: bool = False, start: list[tuple[SavedPrefix, int] | None] | None = None
    ) -> list[int]:
        """Prefill ``prefixes`` as new last rows (``hidden``: ``prefill_hidden`` gets each one's feature
        layers' outputs [len(prefix), layers * H], None for an empty prefix); ``start``: as
        ``SequenceRows.add_rows`` (a saved state the cache has no room for is computed instead)."""
        layers = self._feature_layers(hidden)
        if len(prefixes) > len(self.free):
            raise ContextLengthError(f"the llama backend holds at most {MAX_SEQ} sequences at once")
        new = [self.free.pop() for _ in prefixes]
        m = [self._restore(s, *st) if st is not None else 0 for s, st in zip(new, start or [None] * len(prefixes))]
        items = [(t, k + i, (s,), None) for s, p, k in zip(new, prefixes, m) for i, t in enumerate(p[k:])]
        try:
            feats = self._decodes(items, layers)  # no logits: the loop never reads a prefill's
        except BaseException:  # (context full): no trace of these rows, or a later row would inherit their cells
            for s in new:
                self.ll.llama_memory_seq_rm(self.mem, s, -1, -1)
                self.free.append(s)
            raise
        first = self.B
        self.seq += new
        self.lens += [len(p) for p in prefixes]
        self.prefill_hidden = (
            [None] * len(prefixes)
            if feats is None
            else [
                None if x is None else torch.from_numpy(x)
                for x in _per_row(feats, [len(p) - k for p, k in zip(prefixes, m)])
            ]
        )
        return list(range(first, self.B))

    def save_prefix(self, r: int) -> SavedPrefix:
        """Row r's sequence state (llama.cpp's own format: its cells' keys and values), copied to the host."""
        s = self.seq[r]
        n = int(self.ll.llama_state_seq_get_size(self.ctx, s))
        buf = (ctypes.c_uint8 * n)()
        got = int(self.ll.llama_state_seq_get_data(self.ctx, buf, n, s))
        return SavedPrefix("llama", self.lens[r] if got == n else 0, n, buf)

    def _restore(self, s: int, saved: SavedPrefix, m: int) -> int:
        """Sequence s holds saved's first m tokens; -> m, or 0 where llama.cpp could not place the state."""
        if saved.nbytes > 0 and saved.n > self.draft_room()[1]:  # (its cells and the rest's must fit)
            return 0
        if self.ll.llama_state_seq_set_data(self.ctx, saved.data, saved.nbytes, s) != saved.nbytes:
            self.ll.llama_memory_seq_rm(self.mem, s, -1, -1)
            return 0
        self.ll.llama_memory_seq_rm(self.mem, s, m, -1)  # (the saved tokens past the shared prefix)
        return m

    def adopt_rows(self, src, idx: list[int]) -> list[int]:
        """Rows holding the keys and values of ``src``'s rows ``idx`` (the transformers target whose
        low-bit copy this model is: llama_kv.py), written into llama.cpp's cache; a row that cannot be
        written starts empty and its drafter catches up by prefilling, as without this."""
        if len(idx) > len(self.free):
            raise ContextLengthError(f"the llama backend holds at most {MAX_SEQ} sequences at once")
        first = self.B
        for i in idx:
            s = self.free.pop()
            self.seq.append(s)
            self.lens.append(self._write_state(s, src.row_kv(i)))
        self.prefill_hidden = [None] * len(idx)
        return list(range(first, self.B))

    def _write_state(self, s: int, kv: list) -> int:
        """Sequence s holds ``kv`` (HFRows.row_kv) from position 0; -> its tokens (0: not written)."""
        from .llama_kv import state_blob

        layout = self.model.state_layout
        blob = state_blob(layout, s, kv) if layout is not None and layout.fits(kv) else None
        if blob is None or kv[0][0].shape[0] > self.draft_room()[1]:
            return 0
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if self.ll.llama_state_seq_set_data(self.ctx, buf, len(blob), s) != len(blob):
            self.ll.llama_memory_seq_rm(self.mem, s, -1, -1)
            return 0
        return kv[0][0].shape[0]

    def remove_rows(self, idx: list[int]) -> None:
        drop = set(idx)
        for r in sorted(drop):
            self.ll.llama_memory_seq_rm(self.mem, self.seq[r], -1, -1)
            self.free.append(self.seq[r])
        self.seq = [s for r, s in enumerate(self.seq) if r not in drop]
        self.lens = [n for r, n in enumerate(self.lens) if r not in drop]

    # --- one forward ---------------------------------------------------------------------------
    def forward(
        self, seqs: list[list[int]], keep: int | None = None, trees: list | None = None, hidden: bool = False
    ) -> torch.Tensor:
        """As ``SequenceRows.forward``; ``hidden``: ``last_hidden`` [B, N, layers * H] gets the feature
        layers' outputs at every fed position (zeros past a row's feed; blocks: ``add_feature_layers``)."""
        layers = self._feature_layers(hidden)
        self.last_hidden = None
        try:
            logits, self.last_hidden = self._forward(seqs, keep, trees, layers)
        except BaseException:  # a failed feed leaves no cells and holds no spare sequences
            self._drop_feed()
            raise
        return logits

    def _feature_layers(self, hidden: bool) -> tuple[int, ...]:
        """The layers a feed hands over: none without ``hidden``; a clear error where it cannot."""
        if not hidden:
            return ()
        if not self.model.feature_layers:
            raise ConfigError(
                f"{self.model.name} on the llama backend hands over decoder layers' outputs only "
                "(no final-norm features): hidden=True needs add_feature_layers first"
            )
        if self.tap is None:
            raise ConfigError(
                f"these rows of {self.model.name} were made before add_feature_layers; only rows made "
                "after it hand over the layers' outputs"
            )
        return self.model.feature_layers

    def _forward(self, seqs, keep, trees, layers) -> tuple[torch.Tensor, torch.Tensor | None]:
        N = max(max((len(s) for s in seqs), default=0), 1)
        first_out = N - keep if keep else 0  # fed index of the first position whose logits are returned
        items = []  # (token, position, sequence ids, (row, column) of its logits or None)
        self._tree_seqs = [None] * self.B
        for r, s in enumerate(seqs):
            t = trees[r] if trees is not None else None
            if t is None:
                node_seqs, offsets = [(self.seq[r],)] * len(s), range(len(s))
            else:
                node_seqs, offsets = self._tree_sequences(r, t[0]), t[1].tolist()
            for i, tok in enumerate(s):
                items.append(
                    (
                        int(tok),
                        self.lens[r] + int(offsets[i]),
                        node_seqs[i],
                        (r, i - first_out) if i >= first_out else None,
                    )
                )
        logits, feats = self._feed(items, N, N - first_out, layers)
        if feats is None:
            return logits, None
        return logits, padded_features(_per_row(feats, [len(s) for s in seqs]), N, len(layers) * self.model.n_embd)

    def _feed(self, items: list, N: int, n_out: int, layers=()) -> tuple[torch.Tensor, np.ndarray | None]:
        """-> (logits [B, n_out, V], the layers' features of the items in order or None)."""
        whole = self.B == 1 and len(items) == N <= N_BATCH  # a single row's feed in one decode
        out = None if whole else torch.zeros(self.B, n_out, self.V, device=HOST)

        def take(where: list) -> None:
            nonlocal out
            src = np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape=(len(where), self.V))
            read = [k for k, w in enumerate(where) if w is not None]
            if whole:  # its logits as llama.cpp laid them out (the last rows), one copy
                out = torch.from_numpy(src[read[0] :].copy()).view(1, n_out, self.V)
                return
            src = src if len(read) == len(where) else src[read]
            rows, cols = [where[k][0] for k in read], [where[k][1] for k in read]
            out[torch.tensor(rows, device=HOST), torch.tensor(cols, device=HOST)] = torch.from_numpy(src)

        feats = self._decodes(items, layers, take)
        return out, feats

    def _decodes(self, items: list, layers=(), take=None) -> np.ndarray | None:
        """Decode ``items`` N_BATCH at a time (a long catch-up feed or prefill takes several decodes);
        ``take(where)`` reads each decode's logits before the next overwrites them; -> the ``layers``'
        outputs of every item, in order [len(items), layers * H] (None without layers)."""
        if not items:  # nothing to decode (empty prefixes, empty feeds)
            return np.zeros((0, len(layers) * self.model.n_embd), np.float32) if layers else None
        every = FeatureTap.all_outputs(layers, self.model.num_layers)
        if layers:
            self.tap.begin(layers)
        try:
            for at in range(0, len(items), N_BATCH):
                where = self._decode_items(items[at : at + N_BATCH], every)
                if take is not None and any(w is not None for w in where):
                    take(where)
            return self.tap.end(len(items), layers) if layers else None
        finally:
            if layers:
                self.tap.stop()

    def _drop_feed(self) -> None:
        """Undo a forward that failed part way: cells past each row's length, the spare tree sequences."""
        for r, s in enumerate(self.seq):
            self.ll.llama_memory_seq_rm(self.mem, s, self.lens[r], -1)
        for tree in self._tree_seqs:
            for x in tree[1] if tree is not None else ():
                self.ll.llama_memory_seq_rm(self.mem, x, -1, -1)
                self.free.append(x)
        self._tree_seqs = []

    def draft_room(self) -> tuple[int, int]:
        """(spare sequence ids, free cells): the rows' committed tokens hold distinct cells of n_ctx."""
        return len(self.free), self.model.n_ctx - sum(self.lens)

    def _decode_items(self, items: list, every: bool = False) -> list:
        """One ``llama_decode`` of at most N_BATCH (token, position, sequence ids, logits slot or None)
        items; -> the slots of its logits rows, in llama.cpp's output order (the batch's). ``every``: every
        item computes logits (the last layer's output needs it: llama_features.py); then the slots are
        one per item, None where nobody reads them."""
        b = self._new_batch(len(items))
        for tok, pos, sq, slot in items:
            self._put(b, tok, pos, sq, every or slot is not None)
        self._decode(b)
        return [slot for *_, slot in items if every or slot is not None]

    def _tree_sequences(self, r: int, allow: torch.Tensor) -> list[tuple[int, ...]]:
        """Each fed token's sequence ids for row r's token tree (see the module doc): the first leaf
        uses the row's sequence, every other leaf a spare one holding a copy of the prefix."""
        n = allow.shape[0]
        anc = allow.clone()
        anc.fill_diagonal_(False)
        depth = allow.sum(1)  # a node sees itself and its ancestors
        parent = torch.where(anc.any(1), (anc * depth[None, :]).argmax(1), -1).tolist()  # the deepest ancestor
        has_child = [False] * n
        for p in parent:
            if p >= 0:
                has_child[p] = True
        leaves = [i for i in range(n) if not has_child[i]]
        if len(leaves) - 1 > len(self.free):
            raise ContextLengthError(
                f"a token tree of {len(leaves)} leaves needs more than the {MAX_SEQ} sequences llama.cpp holds"
            )
        spare = [self.free.pop() for _ in leaves[1:]]
        ids = [self.seq[r]] + spare
        for s in spare:
            self.ll.llama_memory_seq_cp(self.mem, self.seq[r], s, -1, -1)
        member: list[list[int]] = [[] for _ in range(n)]
        for leaf, s in zip(leaves, ids):
            i = leaf
            while i >= 0:
                member[i].append(s)
                i = parent[i]
        self._tree_seqs[r] = ([m[0] for m in member], spare)
        return [tuple(m) for m in member]

    # --- keep what was accepted ----------------------------------------------------------------
    def commit(self, keep: list) -> None:
        rm, cp = self.ll.llama_memory_seq_rm, self.ll.llama_memory_seq_cp
        for r, k in enumerate(keep):
            s, P = self.seq[r], self.lens[r]
            tree = self._tree_seqs[r] if r < len(self._tree_seqs) else None
            n = k if isinstance(k, int) else len(k)
            # a tree's accepted path (fed indices, 0 = the pending token) lies in its last node's first sequence
            path_seq = tree[0][k[-1]] if tree is not None and not isinstance(k, int) and n else s
            if path_seq != s:
                rm(self.mem, s, P, -1)
                cp(self.mem, path_seq, s, P, P + n)
            else:
                rm(self.mem, s, P + n, -1)
            for x in tree[1] if tree is not None else ():
                rm(self.mem, x, -1, -1)
                self.free.append(x)
            self.lens[r] = P + n
        self._tree_seqs = []

    def truncate(self, r: int, n: int) -> None:
        if n < self.lens[r]:
            self.ll.llama_memory_seq_rm(self.mem, self.seq[r], n, -1)
            self.lens[r] = n

    def trim(self) -> None:
        """Nothing to do: removed cells are free at once."""
