"""The library entry point.

from specdraft import SpecDecoder, SamplingParams, SpecConfig
dec = SpecDecoder.load("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
out = dec.generate("Write a haiku about caches.", chat=True,
                   sampling=SamplingParams(max_new_tokens=64),
                   spec=SpecConfig(method="draft_model", k=4))
print(out.text, out.stats.mat, out.stats.tokens_per_s)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from .core.config import (
    DEFAULT_METHOD,
    SamplingParams,
    SpecConfig,
    fallback_method,
    spec_with_default,
    with_method,
)
from .core.errors import ConfigError, TokenizerMismatchError
from .core.methods import method
from .core.policy import CostAwarePolicy, DraftLength, draft_length, interpolate
from .core.prefix_cache import PrefixCache, default_budget_bytes
from .core.processors import RequestProcessor
from .drafters.runs_on import unavailable
from .engine import Engine, GenerationResult, Job, run_one
from .learning.config import learn_config
from .models.backends import (
    check_devices,
    check_draft_flags,
    check_named,
    device_kw,
    load_model,
    option_needs,
    placement,
)
from .models.hf import HFModel
from .models.loading import check_same_tokenizer, set_threads
from .models.views import layer_view

CACHE_ENTRIES = 64  # per cache keyed by a request's spec (cost-aware policies, auto's memories, layer views)
RECYCLE_TABLES = 4  # Token Recycling tables ([V, top_k] int32 each) kept at once


class SpecDecoder:
    def __init__(self, target, draft=None, learn=None, prefix_cache_mb: float | None = None):
        """``target``, ``draft``: models behind the model interface (models/base.py), any backend. ``learn``:
        online learning of the EAGLE-3 head from the requests decoded (specdraft/learning): True, a
        ``LearnConfig`` or a dict of its fields; None or False: off. ``prefix_cache_mb``: the memory the
        prefix cache may hold (core/prefix_cache.py; None: ``default_budget_bytes``, 0: no cache)."""
        self.target = target
        self.draft = draft
        self._bridge = None  # a VocabBridge when the draft's tokenizer differs (drafters/cross_vocab.py)
        self.cross_vocab = False
        if draft is not None:
            try:
                check_same_tokenizer(target, draft)
            except TokenizerMismatchError:
                if target.tokenizer is None or draft.tokenizer is None:
                    raise
                self.cross_vocab = True
                self.vocab_bridge()  # built now: a draft that cannot write the target's text is refused here
        self.tokenizer = target.tokenizer
        self.eos_ids = target.eos_token_ids()
        # caches keyed by request-chosen specs hold at most CACHE_ENTRIES each (least recently used leave)
        self._policies: OrderedDict[str, CostAwarePolicy] = OrderedDict()
        self._costs: dict[int, float] = {}  # n tokens scored -> seconds (cost_curve)
        self._draft_costs: dict[int, float] = {}  # the same for the draft model
        self.curves_given = False  # set_cost_curves: not measured, not corrected
        self._arm_memory: OrderedDict = OrderedDict()  # auto's per-arm measurements, per spec
        self._shared: dict[str, OrderedDict] = {}  # kind -> {key: resource} (``shared``)
        self.learner = _learner(target, learn)
        self._engine: Engine | None = None  # ``run``'s, kept across calls
        budget = default_budget_bytes() if prefix_cache_mb is None else int(float(prefix_cache_mb) * 2**20)
        self.prefix_cache = PrefixCache(budget) if budget > 0 and target.capabilities.prefixes else None
        self._engine_lock = threading.Lock()

    def shared(self, key: tuple, make, limit: int | None = CACHE_ENTRIES):
        """The resource under ``key`` (a tuple whose first item names its kind, e.g. ("layer_view", layers)),
        made by ``make()`` on first use and shared by this decoder's drafters and requests. Past ``limit``
        entries of one kind (None: no bound) the least recently used leave: keys may come from clients' specs."""
        return _cached(self._shared.setdefault(key[0], OrderedDict()), key, make, limit)

    def head(self, spec: SpecConfig):
        """The trained head in the spec's ``head``, loaded once per decoder and checked against the target and
        against the head type ``spec.method`` drafts with (auto: its eagle3 arms', ``arms.head_type``)."""
        from .drafters.arms import head_type

        # keyed by type too: the type check is load_head's, and a medusa head is no eagle head
        kind, path = head_type(spec.method), spec.get("head")
        if path is None:  # SpecConfig refuses a head method without one: only a spec built around it lands here
            raise ConfigError(f"method {spec.method!r} drafts with a trained head: give head=DIR (--head DIR)")
        return self.shared(("head", path, kind), lambda: self._load_head(path, kind), limit=None)

    def _load_head(self, path: str, kind: str):
        from .models.heads import load_head

        head = load_head(path, self.target, expect_type=kind)[0]
        if self.learner is not None and kind == "eagle3":
            self.learner.adopt(head, path)  # the head it learns continues from its adapted version
        return head

    def served_outputs(self):
        """The outputs this decoder served lately (``datastore.ServedOutputs``), which its suffix drafters
        search, when it learns online; else None."""
        return None if self.learner is None else self.learner.served

    def skip_config(self, path: str) -> tuple[int, ...]:
        """The layers the `specdraft tune-skip` file at ``path`` skips, read once per decoder and checked against
        the target (a server reads it within a request's bounded check; admission finds it here)."""
        from .models.views import load_skip_config

        return self.shared(("skip_config", path), lambda: tuple(load_skip_config(path, self.target)), limit=None)

    def autotune_file(self, path) -> dict:
        """The `specdraft autotune` file at ``path`` (``arms.load_file``), read once per decoder, as
        ``skip_config``."""
        from .drafters.arms import load_file

        return self.shared(("autotune", str(path)), lambda: load_file(path), limit=None)

    def datastore(self, path: str):
        """The suffix datastore at ``path``, loaded once per decoder and checked against the target's
        vocabulary and tokenizer."""
        return self.shared(("datastore", path), lambda: self._load_datastore(path), limit=None)

    def _load_datastore(self, path: str):
        from .drafters.datastore import Datastore, tokenizer_sha256

        store = Datastore(path, vocab_size=self.target.vocab_size)
        if store.meta.get("tokenizer_sha256") and self.tokenizer is not None:
            tok_hash = self.shared(("tokenizer_sha256",), lambda: tokenizer_sha256(self.tokenizer))
            store = Datastore(path, vocab_size=self.target.vocab_size, tokenizer_hash=tok_hash)
        return store

    def policy_for(self, spec: SpecConfig) -> CostAwarePolicy | None:
        """The cost-aware schedule's measurements persist across requests of one decoder."""
        if spec.schedule != "cost_aware" or spec.method == "plain":
            return None
        key = json.dumps(spec.to_dict(), sort_keys=True)
        return _cached(self._policies, key, lambda: CostAwarePolicy(spec.k, costs=self.cost_curve(spec.k + 1)))

    def cost_curve(self, n_max: int) -> dict[int, float]:
        """Seconds of one target forward scoring n = 1..n_max tokens on this machine: measured once per
        decoder at ``COST_POINTS`` (about 3 forwards each; ``costs.measure_costs``), linear in
        between, extended when a spec needs a longer one. The cost-aware schedule and ``auto`` start
        from the real curve of this CPU and backend."""
        return _curve(self.target, self._costs, n_max)

    def draft_cost_curve(self, n_max: int) -> dict[int, float]:
        """The draft model's curve, likewise (``auto`` and the tree search price drafting with it)."""
        return _curve(self.draft_model(), self._draft_costs, n_max)

    def set_cost_curves(self, target: dict[int, float], draft: dict[int, float] | None = None) -> None:
        """Curves given instead of measured ({n: seconds}, e.g. a synthetic one in a test): used as they
        are, and ``auto`` does not correct them from the steps it sees."""
        self._costs.clear()
        self._costs.update(target)
        self._draft_costs.clear()
        self._draft_costs.update(draft or {})
        self._shared.pop("observed_costs", None)
        self.curves_given = True

    def observed_costs(self):
        """What the steps of this decoder's ``auto`` requests cost (None when the curves were given)."""
        from .drafters.auto import ObservedCosts

        return None if self.curves_given else self.shared(("observed_costs",), ObservedCosts, limit=None)

    def arm_memory(self, spec: SpecConfig):
        """What ``auto``'s requests with this spec measured per arm, shared by the decoder's requests."""
        from .drafters.auto import ArmMemory

        key = json.dumps(spec.to_dict(), sort_keys=True)
        return _cached(self._arm_memory, key, ArmMemory)

    @classmethod
    def load(
        cls,
        target: str,
        draft: str | None = None,
        dtype: str | None = None,
        draft_layers: int | None = None,
        threads: int | None = None,
        backend: str | None = None,
        draft_backend: str | None = None,
        backends: tuple[str, ...] | None = None,
        shape=None,
        device: str = "auto",
        draft_device: str | None = None,
        learn=None,
        prefix_cache_mb: float | None = None,
    ) -> "SpecDecoder":
        """``draft_layers`` truncates the draft to its first N layers (e.g. draft=target, N=4).
        ``dtype``: the dense weights' (None: not given, bfloat16). ``backend``: "hf" (transformers), "llama"
        (llama.cpp on GGUF files; ``dtype`` does not apply), "openvino", or "auto" (the backend and weights
        measured fastest here: paths.py, among ``backends`` when the method to run needs some, and among those
        that honour the options given: a ``dtype``, ``draft_layers`` or ``self:int4`` mean transformers);
        None: auto for a catalog model, else hf. ``shape`` (``models.paths.RequestShape``: the prompt's tokens
        and the new tokens expected): auto then takes the path fastest end to end for such requests (a long
        prompt where prefill is cheap, a long answer where decoding is), where the paths file holds every
        path's prefill and decoding costs. The draft loads on the target's backend unless ``draft_backend``
        says otherwise. ``draft="self:int4"`` (hf: int8, int4, int4-gN) or ``"self:Q4_0"`` (llama: a registered
        variant) drafts with the target's own weights at lower precision. ``device``: where the target runs
        (core/device.py: auto, cpu, cuda, cuda:N, or gpu for OpenVINO's Intel GPUs; auto is CUDA when torch
        sees a GPU, and ``backend`` auto then takes transformers on it); ``draft_device``: the draft's (None: the
        target's). A device this machine or the backend cannot give is a ConfigError before anything loads.
        ``learn``, ``prefix_cache_mb``: as in ``SpecDecoder()``."""
        learn_config(learn)  # checked before anything loads
        check_draft_flags(draft, draft_layers=draft_layers, draft_backend=draft_backend, draft_device=draft_device)
        set_threads(threads)
        backend = backend or default_backend(target)
        draft_device = draft_device or device
        needs = option_needs(dtype, draft, draft_layers)
        check_named(backend, draft_backend, draft is not None, [n for n in needs if n.whose == "draft"])
        check_devices(backend, draft_backend if draft else None, device, draft_device if draft else None)
        if backend == "auto":  # the path measured fastest for this model here (paths.py)
            from .models.paths import allowed_for, load_fastest

            allowed = allowed_for(backends, needs, draft_backend if draft else None, device)

            def draft_on(t, path):  # a path whose backend cannot run the draft is not taken
                if not draft:
                    return None
                return load_draft(
                    t, path.target(target), draft, dtype, draft_layers, draft_backend or path.backend, draft_device
                )

            t, path, d = load_fastest(
                target, dtype, allowed=allowed, shape=shape, companion=draft_on, **device_kw(device)
            )
            return cls(t, d, learn=learn, prefix_cache_mb=prefix_cache_mb)
        t = load_model(target, dtype, backend=backend, **device_kw(device))
        d = load_draft(t, target, draft, dtype, draft_layers, draft_backend or backend, draft_device) if draft else None
        return cls(t, d, learn=learn, prefix_cache_mb=prefix_cache_mb)

    def with_draft(
        self,
        target_name: str,
        draft: str,
        dtype: str | None = None,
        draft_backend: str | None = None,
        draft_device: str = "auto",
    ):
        """A decoder over this one's target (not reloaded) and ``draft`` (a name as in ``load``)."""
        return SpecDecoder(
            self.target,
            load_draft(self.target, target_name, draft, dtype, None, draft_backend or self.backend, draft_device),
        )

    @property
    def backend(self) -> str:
        return self.target.backend

    def make_drafter(self, spec: SpecConfig):
        """The drafter for ``spec`` (its method's factory, from the method table). The spec's opt-in lossy rule
        is the engine's to apply (``spec.lossy_rule()``, passed with the request)."""
        spec = spec.validate()
        m = method(spec.method)
        problem = unavailable(m, self.backend, self.draft is not None)
        if problem:
            raise ConfigError(problem)
        d = m.build(self, spec)
        if self.learner is not None and self.learner.drafts_with_head(d):
            d.reproducible = False  # its head changes with what the decoder serves (a composite reads its parts')
        return d

    def usable(self, spec: SpecConfig) -> SpecConfig:
        """``spec`` when its drafter can be made here; for a defaulted ``auto`` that cannot (e.g. an unreadable
        autotune file), ``spec`` with ``fallback_method`` instead (logged), so a command naming no method
        never fails on auto; but an ``auto`` with a head (the user's) that cannot run is an error. Call it only
        for a method the user did not name."""
        return spec if spec.method != DEFAULT_METHOD else self._usable_drafter(spec)[0]

    def _usable_drafter(self, spec: SpecConfig):
        """(usable(spec), its drafter): the drafter that decided it, so that it is not made twice."""
        try:
            return spec, self.make_drafter(spec)
        except ConfigError as e:
            if spec.method != DEFAULT_METHOD or spec.get("head") is not None:  # a head given is never dropped unsaid
                raise
            fb = with_method(spec, fallback_method(self.draft is not None))
            logging.getLogger("specdraft").warning("method auto cannot run here (%s); using %s", e, fb.method)
            return fb, self.make_drafter(fb)

    def draft_length(self, spec: SpecConfig) -> DraftLength:
        """A request's draft-length policy for ``spec.schedule`` (cost-aware measurements are shared by
        the requests of this decoder with the same spec)."""
        return draft_length(spec, self.policy_for(spec))

    def vocab_bridge(self):
        """The draft's and the target's tokenizers side by side (built once), or None when they match."""
        if not self.cross_vocab:
            return None
        if self._bridge is None:
            from .drafters.cross_vocab import VocabBridge

            self._bridge = VocabBridge(
                self.target.tokenizer,
                self.draft.tokenizer,
                self.target.vocab_size,
                self.draft.vocab_size,
                self.draft.device,
            )
        return self._bridge

    def draft_model(self) -> HFModel:
        if self.draft is None:
            raise ConfigError("method 'draft_model' needs a draft model (pass draft=NAME / --draft NAME)")
        return self.draft

    def recycle_table(self, top_k: int):
        """Token Recycling's adjacency table: one per decoder and top_k, recycled across requests."""
        from .drafters.token_recycling import AdjacencyTable

        return self.shared(
            ("recycle_table", top_k), lambda: AdjacencyTable(self.target.vocab_size, top_k), RECYCLE_TABLES
        )

    def layer_view(self, keep) -> HFModel:
        """The target's layers ``keep`` as a draft (shared weights, cached): early exit or layer skipping."""
        keep = list(keep)
        return self.shared(("layer_view", tuple(keep)), lambda: layer_view(self.target, keep))

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ConfigError("a text prompt needs a tokenizer; pass token ids instead")
        if chat:
            msgs = [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return [int(t) for t in self.tokenizer(prompt, add_special_tokens=False)["input_ids"]]

    def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | dict | None = None,
        spec: SpecConfig | dict | None = None,
        chat: bool = False,
        on_emit=None,
    ) -> GenerationResult:
        """``spec`` None, or a dict naming no method: ``auto`` (config.spec_with_default, then ``usable``)."""
        return self.run(self.prepare(self.encode(prompt, chat=chat), sampling, spec, on_emit=on_emit))

    def forget_prefixes(self) -> None:
        """Empty the prefix cache: the next request prefills its whole prompt (a timed comparison of methods
        on the same prompts starts each run cold, as a peer reset before each run does)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def new_engine(self, **kw) -> Engine:
        """An engine over this decoder's target that shares its prefix cache (``kw``: Engine's)."""
        return Engine(self.target, self.eos_ids, self.tokenizer, prefix_cache=self.prefix_cache, **kw)

    def run(self, job: Job) -> GenerationResult:
        """Decode one prepared request alone (``prepare``) on this decoder's engine (one call at a time)."""
        with self._engine_lock:
            if self._engine is None:
                self._engine = self.new_engine()
            return run_one(self._engine, job, hook=self.learner)

    def prepare(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | dict | None,
        spec: SpecConfig | dict | None,
        *,
        on_emit=None,
        tag=None,
        defaulted: bool | None = None,
        processor: RequestProcessor | None = None,
        partition=None,
    ) -> Job:
        """A request as the engine takes it: the sampling checked, the spec checked (``spec`` None, or a dict
        naming no method: ``auto``), its drafter built once, its draft-length policy, its opt-in lossy rule and
        its logits processor (``processor``: one compiled already for this request). ``defaulted``: the user named
        no method, so an ``auto`` that cannot run here falls back as ``usable`` says (None: when ``spec`` names
        none). Values checked before (``validate``) are not checked again. ``partition``: whose cached prefixes
        it may start from (the server's tenant; core/prefix_cache.py). The library, the CLI, the server's
        batch worker and batchbench reach the engine through it."""
        sp = SamplingParams.from_dict(sampling)
        if defaulted is None:
            defaulted = spec is None or (isinstance(spec, dict) and "method" not in spec)
        config = (
            spec_with_default(spec, self.draft is not None)
            if spec is None or isinstance(spec, dict)
            else SpecConfig.from_dict(spec)
        )
        config, drafter = self._usable_drafter(config) if defaulted else (config, self.make_drafter(config))
        if processor is None:
            processor = RequestProcessor.for_request(
                sp, prompt_ids, self.target.vocab_size, self.eos_ids, self.tokenizer
            )
        return Job(
            prompt_ids,
            sp,
            drafter,
            on_emit=on_emit,
            tag=tag,
            length=self.draft_length(config),
            lossy=config.lossy_rule(),
            spec=config,
            processor=processor,
            partition=partition,
            start=self._cached_start(prompt_ids, sp, drafter, partition),
        )

    def _cached_start(self, prompt_ids: list[int], sp: SamplingParams, drafter, partition):
        """The prefix cache's longest match for the tokens a prefill computes (all but the pending last one);
        none for a drafter that reads the prompt's features (they are not cached) or a seeded sampling request
        (its tokens must be those of decoding it alone, where prefill chunks change a quantized backend's
        numerics)."""
        if self.prefix_cache is None or drafter.wants_hidden or (sp.seed is not None and not sp.greedy):
            return None
        return self.prefix_cache.lookup(prompt_ids[:-1], partition)

    def close(self) -> None:
        """Stops what the decoder runs beside decoding (the online learner's training process)."""
        if self.learner is not None:
            self.learner.close()


def _learner(target, learn):
    """The decoder's online learner (specdraft/learning), or None when ``learn`` says off."""
    cfg = learn_config(learn)
    if cfg is None:
        return None
    from .learning.learner import Learner

    return Learner(target, cfg)


def _cached(cache: OrderedDict, key, make, limit: int | None = CACHE_ENTRIES):
    """``cache[key]``, made by ``make()`` when missing; the least recently used entries leave past ``limit``
    (specs come from clients: an unbounded cache would grow with every distinct one); None: no bound."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = make()
    while limit is not None and len(cache) > limit:
        cache.popitem(last=False)
    return value


COST_POINTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)


def default_backend(target: str) -> str:
    """The backend when none is named: a catalog model runs on the path measured fastest here (auto);
    a directory, a file or a NAME:VARIANT on transformers, as named."""
    from .models import catalog

    return "auto" if target in catalog.MODELS else "hf"


@dataclass(frozen=True)
class ModelSettings:
    """The models a command loads (the CLI's --target, --draft, --draft-layers, --dtype, --threads,
    --backend, --draft-backend, --device, --draft-device): ``load()`` is ``SpecDecoder.load`` with them."""

    target: str
    draft: str | None = None
    draft_layers: int | None = None
    dtype: str | None = None  # None: not given (DEFAULT_DTYPE on the backends that read one)
    threads: int | None = None
    backend: str | None = None  # None: default_backend(target)
    draft_backend: str | None = None
    backends: tuple[str, ...] | None = None  # auto chooses among these (the method's), None: any
    device: str = "auto"  # where the target runs (core/device.py)
    draft_device: str | None = None  # the draft's (None: --device's)

    def check(self) -> None:
        """Before anything loads: an option given that the backend named for it does not honour (--backend
        llama --dtype float32, --backend openvino --device cuda) or a device this machine lacks is one error;
        auto chooses among the backends that honour them all."""
        check_draft_flags(
            self.draft, draft_layers=self.draft_layers, draft_backend=self.draft_backend, draft_device=self.draft_device
        )
        backend = self.backend or default_backend(self.target)
        needs = option_needs(self.dtype, self.draft, self.draft_layers)
        check_named(backend, self.draft_backend, self.draft is not None, needs)
        check_devices(
            backend,
            self.draft_backend if self.draft else None,
            self.device,
            (self.draft_device or self.device) if self.draft else None,
        )

    def weights(self, backend: str) -> str:
        """The target's weights on ``backend`` (the one it loaded on), in words."""
        from .models.backends import BACKENDS, DEFAULT_DTYPE

        return (self.dtype or DEFAULT_DTYPE) if BACKENDS[backend].uses_dtype else "GGUF weights"

    def without_draft(self) -> "ModelSettings":
        """These settings with no draft and none of the draft's own."""
        return dataclasses.replace(self, draft=None, draft_layers=None, draft_backend=None, draft_device=None)

    def load(self, shape=None, learn=None, prefix_cache_mb: float | None = None, **override) -> SpecDecoder:
        """The decoder of these settings; ``override`` replaces some (e.g. ``draft=None``); ``shape``: the
        request's, for --backend auto; ``learn``, ``prefix_cache_mb``: as ``SpecDecoder.load`` takes them."""
        settings = dataclasses.replace(self, **override)
        settings.check()
        return SpecDecoder.load(
            **dataclasses.asdict(settings), shape=shape, learn=learn, prefix_cache_mb=prefix_cache_mb
        )


def _curve(model, measured: dict[int, float], n_max: int) -> dict[int, float]:
    """{n: seconds} for n = 1..n_max, measuring the points of ``COST_POINTS`` up to n_max (and n_max)
    that ``measured`` lacks, interpolating linearly between them."""
    from .models.cost_curve import measure_costs

    points = sorted({n for n in COST_POINTS if n <= n_max} | {n_max})
    missing = [n for n in points if n not in measured]
    if missing:
        ms = measure_costs(model, missing, context=60, repeats=2)
        measured.update({n: v / 1000 for n, v in ms.items()})
    return {n: interpolate(measured, n) for n in range(1, n_max + 1)}


def load_draft(
    target,
    target_name: str,
    draft: str,
    dtype: str | None,
    draft_layers: int | None,
    backend: str,
    device: str = "auto",
):
    """The draft model ``draft`` names for ``target``, on ``device``: a model, or ``self:QUANT`` (_self_draft)."""
    if draft.startswith("self:"):  # the target's own weights at lower precision
        if draft_layers is not None:
            raise ConfigError(
                "--draft-layers truncates a separate draft; a self-draft (self:int4) keeps all the target's layers"
            )
        return _self_draft(target, target_name, draft[5:], dtype, backend, device)
    return load_model(draft, dtype, num_layers=draft_layers, backend=backend, **device_kw(device))


def _self_draft(target, target_name: str, quant: str, dtype, backend: str, device: str = "auto"):
    """``self:int4`` (hf: the target reloaded with int4 linear layers whose prefills use the target's
    own dense layers) or ``self:Q4_0`` (llama: the target's registered GGUF variant)."""
    base = target_name.split(":")[0]
    if backend != "hf":
        d = load_model(f"{base}:{quant}", dtype, backend=backend, **device_kw(device))
        if target.backend == "hf" and backend == "llama" and d.state_layout is not None:
            d.prefill_twin = target  # its cache starts from the target's prompt cache (models/llama_kv.py)
        return d
    from .models.backends import check_cpu_kernels
    from .models.lowbit import parse_quant, quantize_linears

    parse_quant(quant)
    check_cpu_kernels(placement("hf", device, "--draft-device"), quant)
    d = load_model(base, dtype, backend="hf", **device_kw(device))
    shares = d.device == target.device  # (the target's dense layers on another device cannot run its prefills)
    d.quantization = quantize_linears(d.model, quant, dense_from=target.model if shares else None)
    d.name = f"{base}:{quant} (self-draft)"
    if shares:  # its prefills are the target's dense layers: it may start from the target's cache
        d.prefill_twin = target
    d.source = None  # quantized in memory: no other process loads it by a name
    return d
