"""The OpenVINO backend: a GGUF model compiled by OpenVINO behind the model interface (models/base.py).

OpenVINO's CPU kernels keep the 4-bit weights and read them once per forward for all the tokens fed
(int8 activations on VNNI/AMX, bf16 where the CPU has it), so scoring 8-16 tokens costs much less than
8-16 single-token steps (docs/benchmark-log.md, "OpenVINO"). OpenVINO GenAI reads the GGUF file and
writes an IR once (cached under ``$SPECDRAFT_HOME/openvino/``); we load that IR with the core runtime
and change one thing in its graph: a ``logits_keep`` input slices the hidden states before the LM
head, so a prefill computes one row of logits and a verification only the positions it reads.

- ``OVModel``: the compiled model and the model's facts; ``new_rows()`` hands out ``OVRows``.
- ``OVRows``: one OpenVINO infer request per row; its state variables hold the row's KV cache.
  The stateful model appends every fed token to that cache, so rollback marks slots as holes, which
  the row's attention bias masks out (token positions come from ``position_ids``, so a hole shifts nothing);
  ``trim`` compacts a row whose holes pass ``compact_slack`` by rewriting its state tensors.

Features for trained heads (EAGLE-3): once a drafter asks (``add_feature_layers``), the model is
compiled again with extra outputs: the final norm's output at every fed position (the LM head's input,
before the ``logits_keep`` slice) and the residual stream after each requested decoder layer (the add
that ends it, which GenAI's GGUF reader names ``model.layers.self_attn.add1.layer{i}``), so the
verifying forward hands them over.

Token trees: every attention of the graph reads its mask from an input we add (``attention_bias``,
additive, [1, 1, fed, slots + fed]) instead of the mask the graph builds from the 2D attention mask
(which knows causal order and holes, not a tree). So a row's fed tokens may be a tree: node i sees
the live cache slots and its ancestors, at position lens + depth; ``commit`` keeps the accepted
path's slots and makes the others holes. Numerics differ between a 1-token and an n-token feed (bf16
activations, an int8 KV cache), so greedy output is compared with plain decoding on this backend
under the near-tie rule, like llama.cpp (tests/test_openvino_backend.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..core.device import HOST
from ..core.errors import ConfigError, ContextLengthError, ModelFileError
from ..core.extras import needs_extra
from .base import Capabilities, SavedPrefix, padded_features
from .gguf_tensors import GGUFHeadIO

DEFAULT_CTX = 8192  # slots per row (holes included); SPECDRAFT_OV_CTX overrides
KEEP = "logits_keep"  # the input added to the graph: how many last fed positions get logits
BIAS = "attention_bias"  # the input added to the graph: every attention's additive mask
MASKED = -65504.0  # what the graph's own mask adds where attention is not allowed (float16's lowest)
# the conversion check (check_conversion): logits of this text against llama.cpp's on the same file
CHECK_TEXT = "def fibonacci(n):\n    # return the n-th Fibonacci number\n    a, b = 0, 1\n    for _ in range(n):"
CHECK_TOLERANCE = 4.0  # logits, the median position's largest error (see check_conversion)


def runtime():
    try:
        import openvino
    except ImportError as e:
        raise ConfigError(needs_extra("the openvino backend", "openvino", e)) from e
    return openvino


# The tensor types OpenVINO GenAI's GGUF reader converts (2026.4.1); others fail deep inside it ("Check
# 'data != nullptr' failed ... gguf_tensor_to_f16"), e.g. the Q5_0 tensors of Qwen2.5-Coder-0.5B's Q4_K_M file.
READABLE_TYPES = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"})


def check_readable(gguf: Path, name: str) -> None:
    """A clear error, before any conversion, for a GGUF file holding tensor types OpenVINO GenAI cannot read."""
    from .gguf_tensors import tensor_types

    other = sorted(tensor_types(gguf) - READABLE_TYPES)
    if other:
        base = name.split(":")[0]
        raise ModelFileError(
            f"OpenVINO GenAI cannot read {gguf.name}: it holds {', '.join(other)} tensors (it reads "
            f"{', '.join(sorted(READABLE_TYPES))}); `specdraft models quantize {base} --type Q4_0` makes a copy "
            f"it reads ({base}:Q4_0), or use another backend"
        )


def _ir_dir(name: str) -> Path:
    from .catalog import home

    return home() / "openvino" / name.replace("/", "_").replace(":", "_")


def ir_ready(gguf: Path, name: str) -> bool:
    """Whether ``gguf``'s IR was written already (loading it then converts nothing)."""
    d = _ir_dir(name)
    return gguf.exists() and (d / "openvino_model.xml").exists() and _stamp(d).get("source") == _source(gguf)


def ir_path(gguf: Path, name: str) -> Path:
    """The IR OpenVINO GenAI writes for ``gguf`` (converted once, then read from the cache)."""
    d = _ir_dir(name)
    xml = d / "openvino_model.xml"
    if ir_ready(gguf, name):
        return xml
    check_readable(gguf, name)
    d.mkdir(parents=True, exist_ok=True)
    link = d / "model.gguf"  # GenAI writes the IR beside the file it reads
    link.unlink(missing_ok=True)
    link.symlink_to(gguf.resolve())
    try:
        import openvino_genai
    except ImportError as e:
        raise ConfigError(needs_extra("converting a GGUF file for the openvino backend", "openvino", e)) from e
    try:
        openvino_genai.LLMPipeline(str(link), "CPU", enable_save_ov_model=True)
    except RuntimeError as e:
        raise ModelFileError(f"OpenVINO could not read {gguf.name}: {str(e).splitlines()[0]}") from e
    if not xml.exists():
        raise ModelFileError(f"OpenVINO did not write an IR for {gguf.name} under {d}")
    (d / "stamp.json").write_text(json.dumps({"source": _source(gguf)}))
    return xml


def _source(gguf: Path) -> str:
    return f"{gguf.resolve()} {gguf.stat().st_size}"


def _stamp(d: Path) -> dict:
    """The IR's stamp: its source GGUF, and check_conversion's figures once measured. A cache: a bad one is
    said and left out (the IR is made and checked again)."""
    import sys

    from ..core import homefiles as h

    schema = h.obj({"source": h.TEXT, "median_diff": h.NUMBER, "max_diff": h.NUMBER, "argmax_agree": h.BOOL})
    try:
        stamp = h.read_json(d / "stamp.json", schema, "the OpenVINO conversion stamp") or {}
    except h.HomeFileError as e:
        print(f"warning: {e}; converting again", file=sys.stderr)
        return {}
    if "argmax_agree" not in stamp:  # the figures go together: checked again
        stamp.pop("median_diff", None)
    return stamp


def check_conversion(model: "OVModel") -> dict:
    """OpenVINO's logits for a fixed text against llama.cpp's on the same GGUF file, once per conversion
    (kept in the IR's stamp). OpenVINO GenAI's GGUF reader gets some files wrong (SmolLM2's Q4_1: median
    logit error 10, a wrong argmax at 16% of positions) while others match (Qwen2.5 Q4_K_M and Q4_0: median
    under 2, every argmax; the first position, with no context, can differ by 10 in both, so the median
    decides); a model that fails is refused rather than decoded wrongly."""
    d = model.ir.parent
    stamp = _stamp(d)
    if "median_diff" not in stamp:
        from .llama import LlamaModel

        ids = model.tokenizer(CHECK_TEXT, add_special_tokens=False)["input_ids"]
        ref = LlamaModel(model.gguf, model.tokenizer).new_rows()
        ref.add_rows([[]])
        want = ref.forward([ids])[0]
        rows = model.new_rows()
        rows.add_rows([[]])
        got = rows.forward([ids])[0]
        top = want.topk(2, -1).values
        clear = (top[:, 0] - top[:, 1]) > CHECK_TOLERANCE
        diff = (got - want).abs().max(-1).values  # per position
        stamp.update(
            median_diff=round(float(diff.median()), 3),
            max_diff=round(float(diff.max()), 3),
            argmax_agree=bool((got.argmax(-1) == want.argmax(-1))[clear].all()),
        )
        (d / "stamp.json").write_text(json.dumps(stamp))
    if stamp["median_diff"] > CHECK_TOLERANCE or not stamp["argmax_agree"]:
        raise ModelFileError(
            f"OpenVINO converts {model.name} wrongly: its logits differ from llama.cpp's on the same "
            f"GGUF file by {stamp['median_diff']} at the median position (tolerance {CHECK_TOLERANCE}"
            f"{'' if stamp['argmax_agree'] else ', and the top token differs'}); the llama backend "
            "decodes it right"
        )
    return stamp


FEATURE_ADD = "model.layers.self_attn.add1.layer{}"  # the residual add that ends decoder layer i (0-based)


def _with_feature_outputs(model, layers: tuple[int, ...]):
    """Outputs 1.. after the logits: the final norm's output at every fed position (the input of the
    ``logits_keep`` slice before the LM head), then each of ``layers`` (hidden-states indices: i is the
    output of decoder layer i - 1)."""
    head = model.get_results()[0].input_value(0).get_node()
    norm = head.input_value(0).get_node().input_value(0)  # head <- the keep slice <- the final norm
    by_name = {n.get_friendly_name(): n for n in model.get_ordered_ops()}
    missing = [i for i in layers if FEATURE_ADD.format(i - 1) not in by_name]
    if missing:
        raise ModelFileError(
            f"unexpected OpenVINO graph: no node {FEATURE_ADD.format(missing[0] - 1)!r} to hand "
            f"over layer output {missing[0]} from"
        )
    for out in [norm] + [by_name[FEATURE_ADD.format(i - 1)].output(0) for i in layers]:
        model.add_outputs(out)
    return model


def _with_keep_input(model):
    """Slice the LM head's input to the last ``logits_keep`` positions (a new i64 [1] input)."""
    ov = runtime()
    from openvino import opset13 as ops

    result = model.get_results()[0]
    head = result.input_value(0).get_node()
    if head.get_type_name() != "MatMul":
        raise ModelFileError(f"unexpected OpenVINO graph: the logits come from {head.get_type_name()}, not MatMul")
    keep = ops.parameter([1], ov.Type.i64, name=KEEP)
    keep.output(0).set_names({KEEP})
    start = ops.negative(keep)
    stop = ops.constant(np.array([np.iinfo(np.int64).max], np.int64))
    hidden = ops.slice(
        head.input_value(0), start, stop, ops.constant(np.array([1], np.int64)), ops.constant(np.array([1], np.int64))
    )
    head.input(0).replace_source_output(hidden.output(0))
    model.add_parameters([keep])
    model.validate_nodes_and_infer_types()
    return model


def _with_bias_input(model):
    """Every attention (ScaledDotProductAttention) reads its mask from a new f32 [1, 1, fed, slots + fed]
    input, which the rows fill: holes, causal order, a token tree's ancestors."""
    ov = runtime()
    from openvino import opset13 as ops

    attn = [n for n in model.get_ordered_ops() if n.get_type_name() == "ScaledDotProductAttention"]
    if not attn or any(n.get_input_size() < 4 for n in attn):
        raise ModelFileError("unexpected OpenVINO graph: no attention with a mask input to score token trees with")
    bias = ops.parameter([-1, 1, -1, -1], ov.Type.f32, name=BIAS)
    bias.output(0).set_names({BIAS})
    for n in attn:
        n.input(3).replace_source_output(bias.output(0))
    model.add_parameters([bias])
    model.validate_nodes_and_infer_types()
    return model


class OVModel(GGUFHeadIO):
    """A GGUF model compiled by OpenVINO for this CPU, with the target's tokenizer; ``facts``, ``embed``
    and ``output_rows`` read the GGUF file itself (gguf_tensors.py)."""

    backend = "openvino"
    source: dict | None = None  # set by load_model (models/backends.py); None: made in memory
    prefill_twin = None  # set by api._self_draft (models/base.py TargetModel)
    device = HOST  # its logits and features come back as host arrays, wherever its weights run
    capabilities = Capabilities(hidden=True, trees=True, layers=True, head_io=True, prefixes=True)

    def __init__(
        self, gguf: str | Path, tokenizer, name: str | None = None, threads: int | None = None, ov_device: str = "CPU"
    ):
        """``ov_device``: OpenVINO's device name (CPU, or GPU: an Intel GPU)."""
        ov = runtime()
        gguf = Path(gguf)
        if not gguf.is_file():
            raise ModelFileError(f"GGUF file {gguf} not found")
        self.name = name or gguf.stem
        self.tokenizer = tokenizer
        self.ov_device = ov_device
        self.core = ov.Core()
        self.gguf = gguf
        self.ir = ir_path(gguf, self.name)
        model = self._graph()
        self._vocab = int(model.get_results()[0].get_output_partial_shape(0)[2].get_length())
        self.num_layers = sum(n.get_friendly_name().startswith(FEATURE_ADD.format("")) for n in model.get_ordered_ops())
        self.inputs = {p.get_any_name() for p in model.inputs}
        self._threads = threads or max(1, torch.get_num_threads())
        self.feature_layers: tuple[int, ...] = ()
        self.blocks = 0  # feature blocks (final norm + layers) the compiled model outputs; 0: logits only
        self.compiled = self._compile(model)
        self.n_ctx = int(os.environ.get("SPECDRAFT_OV_CTX", 0) or DEFAULT_CTX)
        self._pool: list = []  # idle infer requests (state reset) of the compiled model, reused by new_rows
        self.conversion = check_conversion(self)

    def _graph(self):
        return _with_bias_input(_with_keep_input(self.core.read_model(str(self.ir))))

    def _compile(self, model):
        threads = {"INFERENCE_NUM_THREADS": self._threads} if self.ov_device == "CPU" else {}  # (CPU threads)
        return self.core.compile_model(model, self.ov_device, {**threads, "PERFORMANCE_HINT": "LATENCY"})

    def add_feature_layers(self, layers) -> list[int]:
        """As ``HFModel.add_feature_layers``: from now on the model is compiled with the final norm's and
        these layers' outputs (rows made later hand them over; a row made before hands over zeros)."""
        bad = [i for i in layers if not 1 <= int(i) <= self.num_layers]
        if bad:
            raise ConfigError(f"{self.name} has no decoder layer output {bad} to hand over (1..{self.num_layers})")
        new = tuple(int(i) for i in dict.fromkeys(layers) if int(i) not in self.feature_layers)
        if new or not self.blocks:
            self.feature_layers += new
            self.compiled = self._compile(_with_feature_outputs(self._graph(), self.feature_layers))
            self.blocks, self._pool = 1 + len(self.feature_layers), []
        return [1 + self.feature_layers.index(int(i)) for i in layers]

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_context(self) -> int:
        return self.n_ctx

    @property
    def dtype(self):
        return torch.float32  # logits come back in float32

    def eos_token_ids(self) -> set[int]:
        """The tokenizer's EOS and the generation config's beside it (the dense copy's directory)."""
        ids = set()
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        src = Path(getattr(self.tokenizer, "name_or_path", "") or "")
        if (src / "generation_config.json").is_file():
            import json

            e = json.loads((src / "generation_config.json").read_text()).get("eos_token_id")
            ids.update([e] if isinstance(e, int) else list(e or []))
        return {t for t in ids if 0 <= t < self._vocab}

    def request(self):
        """-> (an infer request of the compiled model, the feature blocks it outputs)."""
        return (self._pool.pop() if self._pool else self.compiled.create_infer_request()), self.blocks

    def release(self, req, blocks: int) -> None:
        if blocks == self.blocks:  # else it belongs to a model compiled before the features changed
            req.reset_state()
            self._pool.append(req)

    def new_rows(self, compact_slack: int = 256) -> "OVRows":
        return OVRows(self, compact_slack)


class OVRows:
    """B rows, row r an infer request whose state is its KV cache; ``live[r]`` flags its cache slots
    (False: a hole left by a rejected token, masked out of attention until ``trim`` compacts it)."""

    def __init__(self, model: OVModel, compact_slack: int = 256):
        self.model = model
        self.slack = compact_slack
        self.reqs: list = []
        self.live: list[np.ndarray] = []  # per row: bool per cache slot
        self.lens: list[int] = []
        self.fed: list[int] = []  # tokens of the last forward per row, provisional until commit
        self.last_hidden = None
        self.prefill_hidden: list = []

    @property
    def B(self) -> int:
        return len(self.lens)

    @property
    def L(self) -> int:
        return max((len(x) for x in self.live), default=0)

    def __del__(self):
        try:
            for req in self.reqs:
                self.model.release(*req)
        except Exception:  # interpreter shutdown
            pass

    def _infer(self, r: int, tokens: list[int], keep: int, tree=None) -> np.ndarray:
        """Feed row r ``tokens`` after its cache (``tree``: (allow [n, n], offsets [n]) as in
        ``forward``, else a chain); -> float32 logits of the last ``keep`` of them [keep, V]."""
        n = len(tokens)
        live = self.live[r]
        if len(live) + n > self.model.n_ctx:
            raise ContextLengthError(
                f"row of {self.lens[r]} tokens + {n} fed passes the openvino backend's "
                f"{self.model.n_ctx} cache slots (SPECDRAFT_OV_CTX)"
            )
        allow = np.tril(np.ones((n, n), bool)) if tree is None else np.asarray(tree[0], bool)
        offsets = np.arange(n) if tree is None else np.asarray(tree[1], np.int64)
        bias = np.full((1, 1, n, len(live) + n), MASKED, np.float32)
        bias[0, 0, :, np.flatnonzero(live)] = 0.0
        bias[0, 0, :, len(live) :][allow] = 0.0
        feed = {
            "input_ids": np.asarray([tokens], np.int64),
            "attention_mask": np.concatenate([live, np.ones(n, bool)]).astype(np.int64)[None],
            "position_ids": (self.lens[r] + offsets).astype(np.int64)[None],
            BIAS: bias,
            "beam_idx": np.zeros(1, np.int32),
            KEEP: np.asarray([keep], np.int64),
        }
        req = self.reqs[r][0]
        req.infer(feed)
        self.live[r] = np.concatenate([live, np.ones(n, bool)])
        return req.get_output_tensor(0).data[0]

    def _features(self, r: int, n: int) -> np.ndarray:
        """The feature blocks of row r's last ``n`` fed tokens [n, H * model.blocks] (zeros for blocks its
        request was compiled without)."""
        req, blocks = self.reqs[r]
        parts = [req.get_output_tensor(k).data[0, -n:] for k in range(1, blocks + 1)]
        H = parts[0].shape[-1] if parts else 0
        out = np.zeros((n, H * self.model.blocks) if parts else (n, 0), np.float32)
        for k, x in enumerate(parts):
            out[:, k * H : (k + 1) * H] = x
        return out

    def add_rows(
        self, prefixes: list[list[int]], hidden: bool = False, start: list[tuple[SavedPrefix, int] | None] | None = None
    ) -> list[int]:
        if hidden and not self.model.blocks:
            self.model.add_feature_layers([])  # the final norm's output at least
        first = self.B
        self.prefill_hidden = [None] * len(prefixes)
        for p, st in zip(prefixes, start or [None] * len(prefixes)):
            self.reqs.append(self.model.request())
            self.live.append(np.zeros(0, bool))
            self.lens.append(0)
            self.fed.append(0)
            try:
                k = 0 if st is None else self._restore(self.B - 1, *st)
                rest = list(p[k:])
                if rest:  # no logits are read from a prefill: one row keeps the LM head cheap
                    self._infer(self.B - 1, rest, 1)
                    if hidden:
                        self.prefill_hidden[self.B - 1 - first] = torch.from_numpy(
                            self._features(self.B - 1, len(rest))
                        )
            except BaseException:
                self.remove_rows([self.B - 1])
                raise
            self.lens[-1] = len(p)
        return list(range(first, self.B))

    def save_prefix(self, r: int) -> SavedPrefix:
        """Row r's state tensors at its committed slots, copied: [(name, [1, kv heads, n, head dim])]."""
        idx = np.flatnonzero(self.live[r])[: self.lens[r]]
        arrays = [(st.name, np.ascontiguousarray(st.state.data[:, :, idx])) for st in self.reqs[r][0].query_state()]
        return SavedPrefix("openvino", self.lens[r], sum(a.nbytes for _, a in arrays), arrays)

    def _restore(self, r: int, saved: SavedPrefix, m: int) -> int:
        """Row r (empty) holds saved's first m tokens; -> m."""
        ov = runtime()
        arrays = dict(saved.data)
        for st in self.reqs[r][0].query_state():
            st.state = ov.Tensor(np.ascontiguousarray(arrays[st.name][:, :, :m]))
        self.live[r] = np.ones(m, bool)
        self.lens[r] = m
        return m

    def remove_rows(self, idx: list[int]) -> None:
        drop = set(idx)
        for r in sorted(drop):
            self.model.release(*self.reqs[r])
        keep = [r for r in range(self.B) if r not in drop]
        self.reqs = [self.reqs[r] for r in keep]
        self.live = [self.live[r] for r in keep]
        self.lens = [self.lens[r] for r in keep]
        self.fed = [self.fed[r] for r in keep]

    def forward(
        self, seqs: list[list[int]], keep: int | None = None, trees: list | None = None, hidden: bool = False
    ) -> torch.Tensor:
        N = max(max((len(s) for s in seqs), default=0), 1)
        n_out = keep or N
        # numpy, not torch: a torch fill or copy of this size wakes torch's OpenMP workers, whose spinning
        # then takes cores from OpenVINO's next infer (measured: the engine's plain decoding 4-5% slower)
        out = np.zeros((self.B, n_out, self.model.vocab_size), np.float32)
        feats = [None] * self.B
        first_out = N - n_out  # fed index i of any row lands in column i - first_out
        for r, s in enumerate(seqs):
            self.fed[r] = len(s)
            if s:
                want = max(0, len(s) - first_out)
                logits = self._infer(r, [int(t) for t in s], max(want, 1), trees[r] if trees is not None else None)
                if want:
                    out[r, :want] = logits
                if hidden:
                    feats[r] = self._features(r, len(s))
        self.last_hidden = padded_features(feats, N) if hidden else None
        return torch.from_numpy(out)

    def commit(self, keep: list) -> None:
        for r, k in enumerate(keep):
            n = self.fed[r]
            slots = np.flatnonzero(self.live[r])[self.lens[r] :]  # the fed slots, in feed order
            kept = range(k) if isinstance(k, int) else k
            drop = np.ones(n, bool)
            drop[list(kept)] = False
            self.live[r][slots[drop]] = False
            self.lens[r] += n - int(drop.sum())
            self.fed[r] = 0

    def truncate(self, r: int, n: int) -> None:
        if n < self.lens[r]:
            self.live[r][np.flatnonzero(self.live[r])[n:]] = False
            self.lens[r] = n

    def trim(self) -> None:
        """Compact the rows whose holes passed the slack: their state tensors keep live slots only."""
        ov = runtime()
        for r, live in enumerate(self.live):
            if len(live) - self.lens[r] <= self.slack:
                continue
            idx = np.flatnonzero(live)
            for state in self.reqs[r][0].query_state():
                kv = state.state.data  # [1, kv heads, slots, head dim]
                if kv.ndim != 4 or kv.shape[2] != len(live):
                    raise RuntimeError(f"unexpected OpenVINO state {state.name} of shape {kv.shape}")
                state.state = ov.Tensor(np.ascontiguousarray(kv[:, :, idx]))
            self.live[r] = np.ones(len(idx), bool)

    def draft_room(self) -> None:
        return None
