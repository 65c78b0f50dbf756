"""Command line: ``specdraft doctor``, ``models list|pull|quantize``, ``generate``, ``datastore build``, ``demo``,
``costs``, ``tune-skip``, ``train medusa|eagle|eagle3``, ``serve``, ``overlap``, ``leak``, ``loadtest``, ``batchbench``,
``autotune``, ``bench``. Errors in user input print one line ``error: ...`` and exit 2.

The parsed flags (an argparse namespace) stay in this module: each command gets typed settings built here
(api.ModelSettings, SpecConfig, SamplingParams, server.app.ServerSettings, a tool's ``...Options``). The
tools add their own subcommand parsers (``add_parser(subparsers)`` in their modules, with the shared flags
of flags.py); ``generate``, ``serve``, ``models`` and ``datastore`` are parsed and run here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from .api import ModelSettings
from .commands.flags import add_model_args, add_sampling_args, add_spec_args
from .core import methods
from .core.config import DEFAULT_METHOD, SPEC_OFF_AT, SPEC_SHRINK_AT, SamplingParams, SpecConfig
from .core.errors import ConfigError, SpecDraftError
from .core.extras import require_extra
from .drafters import runs_on
from .learning import LearnConfig
from .models.paths import RequestShape


# --- flags -> typed settings ----------------------------------------------------------------------
def settings_from_args(cls, a, **given):
    """``cls`` (a command's typed settings: a dataclass) from the parsed flags of its fields' names;
    ``given`` fills the fields that are no flag (e.g. ``models``)."""
    return cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if f.name not in given}, **given)


def models_from_args(a, backends: tuple[str, ...] | None = None) -> ModelSettings:
    """--target (with --quantize folded in: _apply_quantize), --draft, --draft-layers, --dtype, --threads,
    --backend, --draft-backend; ``backends``: those the method to run needs, where auto chooses."""
    return settings_from_args(ModelSettings, a, backends=backends)


def spec_from_args(a) -> "SpecConfig":
    """The spec of --config and the spec flags; naming no method (--method or the config's), ``auto``
    (config.spec_with_default; ``a.method_defaulted`` is set: SpecDecoder.prepare falls back where auto cannot run)."""
    from .core.config import spec_with_default

    d = {}
    if a.config:
        try:
            with open(a.config) as f:
                d = json.load(f)
        except OSError as e:
            raise SpecDraftError(f"cannot read --config {a.config}: {e.strerror}") from e
        except json.JSONDecodeError as e:
            raise SpecDraftError(f"--config {a.config} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise SpecDraftError(f"--config {a.config} must hold a JSON object")
    if a.method is not None:
        d["method"] = a.method
    if getattr(a, "datastore", None):
        d["datastore"] = a.datastore
        d.setdefault("method", "suffix")
    a.method_defaulted = "method" not in d
    if a.k is not None:
        d["k"] = a.k
        d.setdefault("max_k", max(16, a.k))
    if a.schedule:
        d["schedule"] = a.schedule
    if getattr(a, "tree", None):
        d["tree"] = a.tree
    if getattr(a, "skip_config", None):
        d["skip_config"] = a.skip_config
    if getattr(a, "exit_layer", None) is not None:
        d["exit_layer"] = a.exit_layer
    if getattr(a, "head", None):
        d["head"] = a.head
    if getattr(a, "lossy", None):
        d["lossy"] = a.lossy
    return spec_with_default(d, has_draft=bool(getattr(a, "draft", None)))


def sampling_from_args(a) -> "SamplingParams":
    return SamplingParams(
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        min_p=a.min_p,
        seed=a.seed,
        max_new_tokens=a.max_new_tokens,
        stop=list(a.stop),
        repetition_penalty=a.repetition_penalty,
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        logit_bias=_logit_bias(a.logit_bias),
        min_tokens=a.min_tokens,
        logprobs=a.logprobs,
        json_schema=None if a.json_schema is None else _read_text(a.json_schema, "--json-schema"),
        regex=a.regex,
        grammar=None if a.grammar is None else _read_text(a.grammar, "--grammar"),
    ).validate()


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise SpecDraftError(f"cannot read {flag} {path}: {e.strerror}") from e


def _logit_bias(items: list[str]) -> dict:
    out = {}
    for it in items:
        tid, sep, bias = it.partition("=")
        try:
            out[int(tid)] = float(bias)
        except ValueError:
            raise SpecDraftError(f"--logit-bias takes ID=BIAS (e.g. 13=-100), got {it!r}") from None
        if not sep:
            raise SpecDraftError(f"--logit-bias takes ID=BIAS (e.g. 13=-100), got {it!r}")
    return out


def _check_before_loading(spec, a) -> str | None:
    """What the spec's method needs (the registry's ``needs``), checked before any model loads: a draft
    model, or a head of the method's type (auto's head: its head arms'), on a backend that runs it; and the
    model options against the backends named. Returns the need."""
    m = methods.method(spec.method)
    problem = runs_on.unavailable(
        m, _backend_for(a, m), bool(a.draft), no_draft=f"--method {m.name} needs --draft NAME"
    )
    if problem:
        raise SpecDraftError(problem)
    head_method = _head_method(spec)
    if head_method is not None:
        from .models.heads import read_head_config

        head = spec.params.head
        read_head_config(head, expect_type=head_method)
        hm = methods.method(head_method)  # (auto's: eagle3, which not every backend runs)
        problem = runs_on.unavailable(hm, _backend_for(a, hm), True, where=f" (--head {head} is a {head_method} head)")
        if problem and hm is not m:
            raise SpecDraftError(problem)
    models_from_args(a, _runs_on(spec)).check()
    return m.needs


def _head_method(spec) -> str | None:
    """The method that drafts with the spec's head: its own (medusa, eagle, eagle3), or auto's head arms'."""
    from .drafters.arms import HEAD_TYPE

    if spec.get("head") is None:
        return None
    return HEAD_TYPE if spec.method == DEFAULT_METHOD else spec.method


def _runs_on(spec) -> tuple[str, ...]:
    """The backends the spec runs on: its method's, and with a head, those of the method that drafts with it."""
    runs = runs_on.backends(methods.method(spec.method))
    head_method = _head_method(spec)
    if head_method is None:
        return runs
    return tuple(b for b in runs if b in runs_on.backends(methods.method(head_method)))


def cmd_models(a) -> int:
    from .models import catalog

    if a.action == "list":
        for r in catalog.status():
            state = ("ready, dense" if r["dense"] else "ready") if r["gguf"] else "not pulled"
            print(f"{r['name']:22s} {state:11s} {r['description']}")
        from .models.quantize import variants

        for name, rec in variants().items():
            print(f"{name:22s} {'ready':11s} {rec['type']} re-quantized from {rec['source']} (llama backend)")
        print(f"(models live in {catalog.home()}; set SPECDRAFT_HOME to move them)")
        return 0
    if a.action == "quantize":
        from .models.quantize import quantize

        if not a.names or not a.type:
            raise SpecDraftError("usage: specdraft models quantize NAME [NAME ...] --type TYPE (e.g. Q4_0, Q8_0)")
        for n in a.names:
            print(quantize(n, a.type, a.threads))
        return 0
    names = a.names or list(catalog.MODELS)
    for n in names:  # the GGUF file and its tokenizer; transformers' dense copy with --dense (else when first loaded)
        catalog.tokenizer_dir(n)
        print(catalog.pull(n, convert=a.dense))
    return 0


def _backend_for(a, m) -> str:
    """The backend ``m`` is checked against before loading: the named one; with none named, the default
    (auto takes a path among the method's backends, so any of them)."""
    from .api import default_backend

    named = getattr(a, "backend", None) or default_backend(a.target)
    return runs_on.backends(m)[0] if named == "auto" else named


def _drafting_methods() -> str:
    return ", ".join(
        n for n in methods.REGISTRY if methods.method(n).uses_draft or methods.method(n).needs == "draft_model"
    )


def cmd_generate(a) -> int:
    sp = sampling_from_args(a)
    spec = spec_from_args(a)
    needs = _check_before_loading(spec, a)
    store = spec.get("datastore")
    if store:  # fail on a missing or corrupt store before loading any model
        from .drafters.datastore import Datastore

        Datastore(store)
    if a.draft and not (needs == "draft_model" or methods.method(spec.method).uses_draft):
        raise ConfigError(f"--draft {a.draft}: method {spec.method} uses no draft model ({_drafting_methods()} do)")
    shape = RequestShape.of_text(a.prompt, sp.max_new_tokens, a.chat)  # --backend auto weighs prefill against decoding
    dec = models_from_args(a, _runs_on(spec)).load(shape=shape)
    job = dec.prepare(dec.encode(a.prompt, chat=a.chat), sp, spec, defaulted=a.method_defaulted)
    out = dec.run(job)
    method = job.spec.method if job.spec is not None else spec.method
    if a.json:
        d = out.to_dict()
        d["method"] = method
        print(json.dumps(d))
    else:
        print(out.text)
        s = out.stats
        rate = "n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
        print(
            f"[{method}] {s.new_tokens} tokens in {s.wall_s:.2f}s = {s.tokens_per_s:.2f} tok/s; "
            f"steps {len(s.steps)}, MAT {s.mat:.2f}, acceptance {rate}, finish {s.finish_reason}",
            file=sys.stderr,
        )
    return 0


def cmd_datastore(a) -> int:
    from .drafters.datastore import build_from_jsonl

    store = build_from_jsonl(a.corpus, a.target, a.output, sort_depth=a.sort_depth, max_docs=a.max_docs)
    m = store.meta
    print(
        f"datastore {store.path}: {m['n_docs']} documents, {m['n_tokens']} tokens (target {m.get('target')}, "
        f"sort depth {m['sort_depth']})"
    )
    return 0


def _serve_settings(a):
    """serve's options checked before anything loads: (models, server settings, replica options, whether the
    spec names no method)."""
    spec = spec_from_args(a)
    _check_before_loading(spec, a)
    if a.max_queue < 1:
        raise SpecDraftError(f"--max-queue must be >= 1, got {a.max_queue}")
    if a.max_batch < 1:
        raise SpecDraftError(f"--max-batch must be >= 1, got {a.max_batch}")
    if a.timeout is not None and a.timeout <= 0:
        raise SpecDraftError(f"--timeout must be > 0 seconds, got {a.timeout}")
    api_key = tuple(a.api_key) if a.api_key else os.environ.get("SPECDRAFT_API_KEY") or None
    if not api_key and not _loopback(a.host) and not a.insecure:
        raise SpecDraftError(
            f"--host {a.host} is reachable from other machines: set --api-key KEY (or "
            "SPECDRAFT_API_KEY), or pass --insecure to serve it without one"
        )
    if a.max_body_mb <= 0:
        raise SpecDraftError(f"--max-body-mb must be > 0, got {a.max_body_mb}")
    if a.drain_timeout < 0:
        raise SpecDraftError(f"--drain-timeout must be >= 0 seconds, got {a.drain_timeout}")
    if a.replicas < 1:
        raise SpecDraftError(f"--replicas must be >= 1, got {a.replicas}")
    if a.prefix_cache_mb is not None and not a.prefix_cache_mb >= 0:
        raise SpecDraftError(f"--prefix-cache-mb must be >= 0, got {a.prefix_cache_mb}")
    require_extra("server", "specdraft serve")
    from .server.pacing import StreamPacing

    try:
        pacing = StreamPacing(
            a.stream_chunk, a.stream_interval_ms / 1000, a.stream_pad_bytes, locked=a.stream_mode == "fixed-only"
        )
    except ValueError as e:
        raise SpecDraftError(f"--stream-*: {e}") from None
    return (
        models_from_args(a, _runs_on(spec)),
        _server_settings(a, spec, api_key, pacing),
        _replica_options(a),
        a.method_defaulted,
    )


def _learn_settings(a, api_key) -> tuple[LearnConfig | None, tuple[str, ...] | None]:
    """--learn, --learn-budget, --learn-keys checked: (LearnConfig or None, the learning keys or None)."""
    from .server.learning import api_keys, tenancy_problem

    keys = None if a.learn_keys is None else tuple(k for k in a.learn_keys.split(",") if k)
    if not a.learn:
        given = [f for f, v in (("--learn-budget", a.learn_budget), ("--learn-keys", a.learn_keys)) if v is not None]
        if given:
            raise SpecDraftError(f"{' and '.join(given)} set how the server learns; add --learn")
        return None, None
    if a.replicas > 1:
        raise SpecDraftError("--learn with --replicas: each replica would learn a head of its own; serve one replica")
    if keys == ():
        raise SpecDraftError("--learn-keys names no key; give KEY[,KEY] of the server's --api-key keys")
    problem = tenancy_problem(api_keys(api_key), a.stream_mode != "normal", keys)
    if problem:
        raise SpecDraftError(problem)
    return LearnConfig(budget=0.25 if a.learn_budget is None else a.learn_budget), keys


def _server_settings(a, spec, api_key, pacing):
    from .server.app import ServerSettings

    learn, learn_keys = _learn_settings(a, api_key)
    return ServerSettings(
        model_name=a.name or a.target,
        default_spec=spec,
        prefix_cache_mb=a.prefix_cache_mb,
        max_queue=a.max_queue,
        timeout_s=a.timeout,
        default_max_tokens=a.max_tokens,
        max_batch=a.max_batch,
        spec_shrink_at=a.spec_shrink_at,
        spec_off_at=a.spec_off_at,
        api_key=api_key,
        open_metrics=a.metrics_open,
        max_body_bytes=int(a.max_body_mb * (1 << 20)),
        stream_pacing=pacing,
        stream_mode="normal" if a.stream_mode == "normal" else "fixed",
        resources=parse_resources(a.resource),
        allowed_hosts=tuple(a.allowed_host) + (a.host,),
        learn=learn,
        learn_keys=learn_keys,
    )


def _replica_options(a):
    from .server.replicas import ReplicaOptions

    return settings_from_args(ReplicaOptions, a)


def parse_resources(items: list[str]) -> dict[str, dict[str, str]]:
    """--resource FIELD:NAME=PATH, repeated -> {field: {name: path}} (server/protocol.py reads it)."""
    from .core.config import PATH_FIELDS

    out: dict[str, dict[str, str]] = {}
    for item in items:
        field, _, rest = item.partition(":")
        name, _, path = rest.partition("=")
        if field not in PATH_FIELDS or not name or not path:
            raise SpecDraftError(
                f"--resource must be FIELD:NAME=PATH with FIELD one of {', '.join(PATH_FIELDS)}, got {item!r}"
            )
        out.setdefault(field, {})[name] = path
    from .server.resources import check_all

    check_all(out)  # each one as its field reads it (a directory, a regular file), before any model loads
    return out


def cmd_serve(a) -> int:
    models, server, replicas, defaulted = _serve_settings(a)
    from .server.app import build_server_app
    from .server.graceful import serve

    if replicas.replicas > 1 or replicas.ray_address:
        from .server.replicas import start_replicas

        app = start_replicas(models, server, replicas, defaulted)
        what = f"{a.replicas} replicas on Ray"
    else:
        app = build_server_app(models, server, defaulted)
        what = f"max batch {a.max_batch}"
    method = getattr(app.state, "default_spec", server.default_spec).method  # what runs when a request names none
    print(f"serving {a.name or a.target} ({method}, {what}) on http://{a.host}:{a.port}", file=sys.stderr)
    serve(app, a.host, a.port, a.log_level, a.drain_timeout)
    return 0


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --- the tools' commands: their typed settings from the flags -----------------------------------------
def cmd_doctor(a) -> int:
    from .commands.doctor import main_doctor

    return main_doctor(a.model, costs=not a.no_costs, threads=a.threads)


def cmd_demo(a) -> int:
    from .demo import DemoOptions, run_demo

    return run_demo(settings_from_args(DemoOptions, a, models=models_from_args(a)))


def cmd_costs(a) -> int:
    from .bench.costs import CostsOptions, main_costs

    _apply_backend_auto(a)
    return main_costs(settings_from_args(CostsOptions, a))


def cmd_tune_skip(a) -> int:
    from .commands.tune_skip import TuneSkipOptions, main_tune_skip

    return main_tune_skip(settings_from_args(TuneSkipOptions, a))


def cmd_train(a) -> int:
    from .bench.shard import RAY_BUILDERS
    from .commands.train import TrainOptions, train_main

    return train_main(settings_from_args(TrainOptions, a), ray_builder=RAY_BUILDERS)


def cmd_heads(a) -> int:
    from .commands.heads import main_heads

    return main_heads(a)


def cmd_overlap(a) -> int:
    from .bench.overlap import OverlapOptions, main_overlap

    return main_overlap(settings_from_args(OverlapOptions, a))


def cmd_leak(a) -> int:
    from .tools.leak import LeakOptions, main_leak

    return main_leak(settings_from_args(LeakOptions, a, models=models_from_args(a)))


def cmd_loadtest(a) -> int:
    from .tools.loadtest import LoadtestOptions, main_loadtest

    return main_loadtest(settings_from_args(LoadtestOptions, a))


def cmd_batchbench(a) -> int:
    from .bench.batchbench import BatchBenchOptions, main_batchbench

    return main_batchbench(settings_from_args(BatchBenchOptions, a))


def cmd_autotune(a) -> int:
    from .commands.autotune import AutotuneOptions, main_autotune

    return main_autotune(settings_from_args(AutotuneOptions, a, models=models_from_args(a)))


def cmd_bench(a) -> int:
    from .bench.harness import BenchOptions, main_bench
    from .bench.shard import run_sharded

    return main_bench(settings_from_args(BenchOptions, a), run_sharded)


# --- the parsers of the commands run here ------------------------------------------------------------
def _add_models_parser(sub):
    m = sub.add_parser("models", help="list or pull the known models")
    m.add_argument("action", choices=["list", "pull", "quantize"])
    m.add_argument("names", nargs="*")
    m.add_argument("--type", default=None, help="quantize: the llama.cpp type (Q4_0, Q8_0, Q4_K_M, ...)")
    m.add_argument("--threads", type=int, default=None, help="quantize: threads (default: all cores)")
    m.add_argument(
        "--dense",
        action="store_true",
        help="pull: also the dense float32 copy transformers (--backend hf) reads (minutes for the 1.5B; made "
        "when first loaded otherwise)",
    )
    return m


def _add_generate_parser(sub):
    g = sub.add_parser("generate", help="generate text from one prompt")
    add_model_args(g)
    add_spec_args(g)
    add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    g.add_argument("prompt")
    return g


def _add_datastore_parser(sub):
    ds = sub.add_parser("datastore", help="build the suffix method's global datastore from a corpus")
    ds.add_argument("action", choices=["build"])
    ds.add_argument("corpus", help="jsonl with a text, prompt or turns field per line")
    ds.add_argument("--target", required=True, help="the target model whose tokenizer to use")
    ds.add_argument("-o", "--output", required=True, help="output directory (the store)")
    ds.add_argument("--sort-depth", type=int, default=64, help="longest match/continuation the store resolves")
    ds.add_argument("--max-docs", type=int, default=None, help="use only the first N documents")
    return ds


def _add_serve_parser(sub):
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (see docs/server.md)")
    add_model_args(s, default_target="smollm2-135m")
    add_spec_args(s)
    s.add_argument("--name", default=None, help="model name served in /v1/models (default: --target)")
    s.add_argument("--host", default="127.0.0.1", help="a non-loopback address needs --api-key (or --insecure)")
    s.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (repeat it for several "
        "clients' keys; default: $SPECDRAFT_API_KEY)",
    )
    s.add_argument("--metrics-open", action="store_true", help="serve /metrics without the API key")
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-queue", type=int, default=64, help="requests allowed to wait; more get HTTP 429")
    s.add_argument("--timeout", type=float, default=None, help="seconds a request may take (queue + decode)")
    s.add_argument("--max-tokens", type=int, default=256, help="default max_tokens when a request sets none")
    s.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=None,
        metavar="MB",
        help="memory for prompts and answers kept across requests, so a conversation's next turn prefills only "
        "what is new (per API key and cache_salt; least recently used leave first; 0: off). Default: 5%% of "
        "the machine's memory, at most 4096",
    )
    s.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="sequences decoded together (1: one request at a time; >1: continuous batching)",
    )
    s.add_argument(
        "--spec-shrink-at",
        type=int,
        default=SPEC_SHRINK_AT,
        help=f"batch size from which draft length is halved (batch scheduler; default {SPEC_SHRINK_AT}, "
        "measured with specdraft batchbench)",
    )
    s.add_argument(
        "--spec-off-at",
        type=int,
        default=SPEC_OFF_AT,
        help=f"batch size from which speculation is turned off (batch scheduler; default {SPEC_OFF_AT})",
    )
    s.add_argument("--max-body-mb", type=float, default=4.0, help="larger request bodies get HTTP 413")
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds running requests may take to finish before they are cancelled",
    )
    s.add_argument(
        "--stream-mode",
        choices=("normal", "fixed", "fixed-only"),
        default="normal",
        help="streams of requests that name no stream_mode: normal (an event per engine step) or fixed "
        "(fixed-size chunks at a steady cadence, hiding what speculation accepted); fixed-only also "
        "refuses stream_mode \"normal\" (docs/server.md, 'Speculation side channel')",
    )
    s.add_argument("--stream-chunk", type=int, default=4, help="fixed streams: tokens per event")
    s.add_argument(
        "--stream-interval-ms",
        type=float,
        default=200.0,
        help="fixed streams: ms between events; set it at or above chunk / (plain tokens/s) of this "
        "server, or decoding time shows through",
    )
    s.add_argument(
        "--stream-pad-bytes",
        type=int,
        default=512,
        help="fixed streams: every event is padded to a multiple of this many bytes (0: no padding)",
    )
    s.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas (Ray actors, each with its own model) behind this one endpoint, routed by "
        "fewest running requests (docs/scale.md; needs `make setup-ray`)",
    )
    s.add_argument(
        "--ray-address",
        default=None,
        help="run the replicas on this Ray cluster (auto, or HOST:PORT of `ray start --head`; default: a "
        "local Ray instance)",
    )
    s.add_argument(
        "--replica-cpus",
        type=int,
        default=None,
        help="CPUs (torch threads) per replica (default: the cluster's CPUs / --replicas)",
    )
    s.add_argument(
        "--resource",
        action="append",
        default=[],
        metavar="FIELD:NAME=PATH",
        help="a file a request's spec may name by NAME (FIELD: head, datastore, skip_config or autotune; "
        "repeatable); requests never name paths",
    )
    s.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="HOST",
        help="without an API key, a Host header the server answers besides loopback names (repeatable)",
    )
    s.add_argument(
        "--learn",
        action="store_true",
        help="the EAGLE-3 head learns from the requests it serves (online speculative decoding; "
        "docs/guide.md): a training process beside the server, updates kept per target and head "
        "under $SPECDRAFT_HOME/adapted (`specdraft heads reset` drops them)",
    )
    s.add_argument(
        "--learn-budget",
        type=float,
        default=None,
        metavar="SHARE",
        help="--learn: the share of the machine's CPU time the training process may use (default 0.25)",
    )
    s.add_argument(
        "--learn-keys",
        default=None,
        metavar="KEY[,KEY]",
        help="--learn: learn only from the requests made with these API keys (needed with several "
        "--api-key keys or a fixed --stream-mode: docs/server.md)",
    )
    s.add_argument("--log-level", default="warning")
    return s


def build_parser() -> argparse.ArgumentParser:
    from . import demo
    from .bench import batchbench, costs, harness, overlap
    from .commands import autotune, doctor, heads, train, tune_skip
    from .tools import leak, loadtest

    p = argparse.ArgumentParser(prog="specdraft", description="lossless speculative decoding")
    sub = p.add_subparsers(dest="cmd", required=True)
    doctor.add_parser(sub).set_defaults(fn=cmd_doctor)
    _add_models_parser(sub).set_defaults(fn=cmd_models)
    _add_generate_parser(sub).set_defaults(fn=cmd_generate)
    _add_datastore_parser(sub).set_defaults(fn=cmd_datastore)
    demo.add_parser(sub).set_defaults(fn=cmd_demo)
    costs.add_parser(sub).set_defaults(fn=cmd_costs)
    tune_skip.add_parser(sub).set_defaults(fn=cmd_tune_skip)
    train.add_parser(sub).set_defaults(fn=cmd_train)
    heads.add_parser(sub).set_defaults(fn=cmd_heads)
    _add_serve_parser(sub).set_defaults(fn=cmd_serve)
    overlap.add_parser(sub).set_defaults(fn=cmd_overlap)
    leak.add_parser(sub).set_defaults(fn=cmd_leak)
    loadtest.add_parser(sub).set_defaults(fn=cmd_loadtest)
    batchbench.add_parser(sub).set_defaults(fn=cmd_batchbench)
    autotune.add_parser(sub).set_defaults(fn=cmd_autotune)
    harness.add_parser(sub).set_defaults(fn=cmd_bench)
    return p


def _apply_backend_auto(a) -> None:
    """--backend auto for a command that reads --backend itself (costs), among the backends that take its
    --dtype; the others load through SpecDecoder.load, which resolves it after their own checks."""
    from .models.backends import check_named, option_needs
    from .models.paths import allowed_for, resolve

    needs = option_needs(a.dtype, None, None)
    check_named(a.backend, None, False, needs)
    if a.backend == "auto":
        a.target, a.backend = resolve(
            a.target, a.dtype, allowed=allowed_for(None, needs, None, a.device), device=a.device
        )


def _apply_quantize(a) -> None:
    """--quantize Q is --target NAME:Q (hf backend only: a GGUF file carries its own quantization)."""
    if getattr(a, "quantize", None) is None:
        return
    from .models.lowbit import parse_quant

    if a.backend not in (None, "hf"):
        raise SpecDraftError(
            f"--quantize is for the hf backend; on {a.backend}, pick a GGUF variant "
            "(--target NAME:Q8_0, made by `specdraft models quantize`)"
        )
    parse_quant(a.quantize)
    a.target, a.backend = f"{a.target}:{a.quantize}", "hf"


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and getattr(args, "fn", None) is cmd_models and not any(x.startswith("-") for x in extra):
            args.names += extra  # `models pull --dense A B`: argparse ends a list positional at an option
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        _apply_quantize(args)
        return args.fn(args)
    except SpecDraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
