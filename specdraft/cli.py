"""Command line: ``specdraft models list|pull``, ``specdraft generate``, ``specdraft demo``,
``specdraft bench``, ``specdraft train medusa|eagle``. Errors in user input print one line ``error: ...`` and exit 2."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import methods
from .config import LOSSY_RULES, SPEC_OFF_AT, SPEC_SHRINK_AT
from .errors import SpecDraftError


def _add_model_args(p: argparse.ArgumentParser, default_target="qwen2.5-coder-1.5b", default_draft=None):
    p.add_argument("--target", default=default_target, help="model name, transformers directory or .gguf file")
    p.add_argument("--draft", default=default_draft, help="draft model (needed by --method draft_model)")
    p.add_argument("--draft-layers", type=int, default=None, help="keep only the first N layers of the draft")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="weights dtype on the hf backend (a GGUF file carries its own on the llama backend)")
    p.add_argument("--threads", type=int, default=None, help="torch / llama.cpp threads (default: all cores)")
    p.add_argument("--quantize", default=None, metavar="int8|int4[-gN]",
                   help="hf backend: weight-only int8 / int4 linear layers for the target (a different model: "
                        "compare it with its own plain decoding); same as --target NAME:int4. A draft takes the "
                        "suffix too, and --draft self:int4 is the target's own weights in int4")
    _add_backend_arg(p)
    _add_draft_backend_arg(p)


def _add_draft_backend_arg(p: argparse.ArgumentParser):
    from .models.backends import BACKENDS

    p.add_argument("--draft-backend", default=None, choices=tuple(BACKENDS),
                   help="the draft model's backend (default: --backend's); e.g. llama: a small GGUF draft on "
                        "llama.cpp for a transformers target (any tokenizer; lossless either way)")


def _add_backend_arg(p: argparse.ArgumentParser):
    from .models.backends import BACKENDS

    p.add_argument("--backend", default="hf", choices=tuple(BACKENDS),
                   help="; ".join(f"{b.name}: {b.summary}" for b in BACKENDS.values()))


def _method_name(name: str) -> str:
    """--method is checked by the registry: an unknown name is the one-line ``error: unknown method ...``
    (a SpecDraftError, which is no ValueError, so argparse lets it through to main)."""
    try:
        return methods.method(name).name
    except SpecDraftError as e:
        raise SpecDraftError(str(e)) from None


def _add_spec_args(p: argparse.ArgumentParser):
    p.add_argument("--method", default=None, type=_method_name, choices=tuple(methods.REGISTRY), metavar="METHOD",
                   help=f"default auto (it picks per request and step among those this setup can run); one of: "
                        f"{methods.help_text()}")
    p.add_argument("--k", type=int, default=None, help="draft tokens per step")
    p.add_argument("--schedule", default=None, choices=methods.SCHEDULES,
                   help="draft length per step (default constant k; cost_aware measures when speculation pays)")
    trees = [m.name for m in methods.REGISTRY.values() if len(m.trees) > 1]
    p.add_argument("--tree", default=None, choices=methods.ALL_TREES,
                   help=f"{' / '.join(trees)}: a chain (default) or a token tree (static, dynamic; see each method); "
                        "shape fields via --config (tree_branching, tree_choices, tree_budget, tree_topk)")
    p.add_argument("--skip-config", default=None, help="layer_skip: the JSON written by `specdraft tune-skip`")
    p.add_argument("--exit-layer", type=int, default=None, help="early_exit: draft with the target's first N layers")
    p.add_argument("--datastore", default=None, help="suffix method: a store from `specdraft datastore build`")
    p.add_argument("--head", default=None, help="medusa / eagle: a head directory from `specdraft train`")
    p.add_argument("--lossy", default=None, choices=LOSSY_RULES,
                   help="opt into a LOSSY verification rule when sampling: typical = Medusa's typical acceptance "
                        "(typical_epsilon / typical_delta via --config); the output is no longer the target's "
                        "distribution")
    p.add_argument("--config", default=None, help="SpecConfig as a JSON file (CLI flags override it)")


def _add_sampling_args(p: argparse.ArgumentParser):
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less than MIN_P times as likely as the top one")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages tokens of prompt + output")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS before this many new tokens")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="report each token's log-probability and the N most likely alternatives (--json)")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--json-schema", default=None, metavar="FILE", help="constrain the output to this JSON schema")
    c.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    c.add_argument("--grammar", default=None, metavar="FILE", help="constrain the output to this Lark grammar")


def spec_from_args(a) -> "SpecConfig":
    """The spec of --config and the spec flags; naming no method (--method or the config's), ``auto``
    (config.spec_with_default; ``a.method_defaulted`` is set, for SpecDecoder.usable once models load)."""
    from .config import spec_with_default

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
    from .config import SamplingParams

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
    model, or a head of the method's type. Returns the need."""
    m = methods.method(spec.method)
    problem = m.unavailable(getattr(a, "backend", "hf"), bool(a.draft),
                            no_draft=f"--method {m.name} needs --draft NAME")
    if problem:
        raise SpecDraftError(problem)
    needs = m.needs
    if needs == "head":
        from .heads import read_head_config

        read_head_config(spec.head, expect_type=spec.method)
    return needs


def cmd_models(a) -> int:
    from .models import registry

    if a.action == "list":
        for r in registry.status():
            state = "ready" if r["dense"] else ("gguf only" if r["gguf"] else "not pulled")
            print(f"{r['name']:22s} {state:11s} {r['description']}")
        from .models.quantize import variants

        for name, rec in variants().items():
            print(f"{name:22s} {'ready':11s} {rec['type']} re-quantized from {rec['source']} (llama backend)")
        print(f"(models live in {registry.home()}; set SPECDRAFT_HOME to move them)")
        return 0
    if a.action == "quantize":
        from .models.quantize import quantize

        if not a.names or not a.type:
            raise SpecDraftError("usage: specdraft models quantize NAME [NAME ...] --type TYPE (e.g. Q4_0, Q8_0)")
        for n in a.names:
            print(quantize(n, a.type, a.threads))
        return 0
    names = a.names or list(registry.MODELS)
    for n in names:
        print(registry.pull(n))
    return 0


def cmd_generate(a) -> int:
    from .api import SpecDecoder

    sp = sampling_from_args(a)
    spec = spec_from_args(a)
    needs = _check_before_loading(spec, a)
    if spec.datastore:  # fail on a missing or corrupt store before loading any model
        from .drafters.datastore import Datastore

        Datastore(spec.datastore)
    wants_draft = needs == "draft_model" or methods.method(spec.method).uses_draft
    dec = SpecDecoder.load(a.target, draft=a.draft if wants_draft else None,
                           dtype=a.dtype, draft_layers=a.draft_layers, threads=a.threads, backend=a.backend,
                           draft_backend=a.draft_backend)
    if a.method_defaulted:
        spec = dec.usable(spec)
    out = dec.generate(a.prompt, sampling=sp, spec=spec, chat=a.chat)
    if a.json:
        d = out.to_dict()
        d["method"] = spec.method
        print(json.dumps(d))
    else:
        print(out.text)
        s = out.stats
        rate = "n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
        print(
            f"[{spec.method}] {s.new_tokens} tokens in {s.wall_s:.2f}s = {s.tokens_per_s:.2f} tok/s; "
            f"steps {len(s.steps)}, MAT {s.mat:.2f}, acceptance {rate}, finish {s.finish_reason}",
            file=sys.stderr,
        )
    return 0


def cmd_datastore(a) -> int:
    from .drafters.datastore import build_from_jsonl

    store = build_from_jsonl(a.corpus, a.target, a.output, sort_depth=a.sort_depth, max_docs=a.max_docs)
    m = store.meta
    print(f"datastore {store.path}: {m['n_docs']} documents, {m['n_tokens']} tokens (target {m.get('target')}, "
          f"sort depth {m['sort_depth']})")
    return 0


def cmd_demo(a) -> int:
    from .demo import run_demo

    return run_demo(a)


def cmd_tune_skip(a) -> int:
    from .tune_skip import main_tune_skip

    return main_tune_skip(a)


def cmd_doctor(a) -> int:
    from .doctor import main_doctor

    return main_doctor(a)


def cmd_costs(a) -> int:
    from .bench.costs import main_costs

    return main_costs(a)


def cmd_autotune(a) -> int:
    from .autotune import main_autotune

    return main_autotune(a)


def cmd_bench(a) -> int:
    from .bench.harness import main_bench

    return main_bench(a)


def cmd_batchbench(a) -> int:
    from .bench.batchbench import main_batchbench

    return main_batchbench(a)


def _serve_settings(a):
    """serve's options checked before anything loads: (spec, api key, stream pacing)."""
    spec = spec_from_args(a)
    _check_before_loading(spec, a)
    if a.max_queue < 1:
        raise SpecDraftError(f"--max-queue must be >= 1, got {a.max_queue}")
    if a.max_batch < 1:
        raise SpecDraftError(f"--max-batch must be >= 1, got {a.max_batch}")
    if a.timeout is not None and a.timeout <= 0:
        raise SpecDraftError(f"--timeout must be > 0 seconds, got {a.timeout}")
    api_key = a.api_key or os.environ.get("SPECDRAFT_API_KEY") or None
    if not api_key and not _loopback(a.host) and not a.insecure:
        raise SpecDraftError(f"--host {a.host} is reachable from other machines: set --api-key KEY (or "
                             "SPECDRAFT_API_KEY), or pass --insecure to serve it without one")
    if a.max_body_mb <= 0:
        raise SpecDraftError(f"--max-body-mb must be > 0, got {a.max_body_mb}")
    if a.drain_timeout < 0:
        raise SpecDraftError(f"--drain-timeout must be >= 0 seconds, got {a.drain_timeout}")
    if a.replicas < 1:
        raise SpecDraftError(f"--replicas must be >= 1, got {a.replicas}")
    try:
        from .server.pacing import StreamPacing
    except ImportError as e:
        raise SpecDraftError(f"specdraft serve needs the server packages (pip install -r requirements.txt): {e}") from e
    try:
        pacing = StreamPacing(a.stream_chunk, a.stream_interval_ms / 1000, a.stream_pad_bytes,
                              locked=a.stream_mode == "fixed-only")
    except ValueError as e:
        raise SpecDraftError(f"--stream-*: {e}") from None
    a.resources = parse_resources(a.resource)
    return spec, api_key, pacing


def parse_resources(items: list[str]) -> dict[str, dict[str, str]]:
    """--resource FIELD:NAME=PATH, repeated -> {field: {name: path}} (server/protocol.py reads it)."""
    from .config import PATH_FIELDS

    out: dict[str, dict[str, str]] = {}
    for item in items:
        field, _, rest = item.partition(":")
        name, _, path = rest.partition("=")
        if field not in PATH_FIELDS or not name or not path:
            raise SpecDraftError(f"--resource must be FIELD:NAME=PATH with FIELD one of {', '.join(PATH_FIELDS)}, "
                                 f"got {item!r}")
        out.setdefault(field, {})[name] = path
    return out


def cmd_serve(a) -> int:
    spec, api_key, pacing = _serve_settings(a)
    from .server.app import build_server_app
    from .server.graceful import serve

    if a.replicas > 1 or a.ray_address:
        from .server.replicas import start_replicas

        app = start_replicas(a, spec, api_key, pacing)
        what = f"{a.replicas} replicas on Ray"
    else:
        app = build_server_app(a, spec, api_key, pacing)
        what = f"max batch {a.max_batch}"
    method = getattr(app.state, "default_spec", spec).method  # what runs when a request names none
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


def cmd_overlap(a) -> int:
    """Model the overlapped draft/verify pair from a bench run of pair_serial / pair_overlap (docs/scale.md)."""
    import json
    from pathlib import Path

    from .overlap import OverlapPair, explain, render_explain

    path = Path(a.results)
    if not path.exists():
        raise SpecDraftError(f"no results file {path} (run specdraft bench --methods plain,pair_serial,pair_overlap)")
    doc = json.loads(path.read_text())
    settings = doc.get("settings", {})
    target, draft = a.target or settings.get("target"), a.draft or settings.get("draft")
    if not draft:
        raise SpecDraftError("the results name no draft model: pass --draft NAME")
    ran = next((m for n, m in settings.get("methods", {}).items() if n in ("pair_overlap", "pair_serial")), None)
    if ran is None:
        raise SpecDraftError(f"{path} has no pair_serial / pair_overlap results")
    threads = ran["threads"]
    k = ran["k"] or next((r["steps"][0][0] for r in doc["records"] if r["method"].startswith("pair_") and r["steps"]),
                         None)  # the k the run measured for itself
    if k is None:
        raise SpecDraftError(f"{path} has no pair steps yet")
    pair = OverlapPair(target, draft, settings.get("dtype", "bfloat16"), k, threads=threads, address=a.ray_address,
                       draft_layers=settings.get("draft_layers"))
    apart = a.threads_apart or os.cpu_count()
    e = explain(doc, pair.costs([1, k + 1], threads), pair.costs([1, k + 1], apart), k)
    pair.close()
    e.update(results=str(path), threads_apart=apart, pair_threads=threads)
    if a.out:
        Path(a.out).write_text(json.dumps(e, indent=1))
    print(render_explain(e))
    return 0


def cmd_leak(a) -> int:
    from .server.leak import main_leak

    return main_leak(a)


def cmd_loadtest(a) -> int:
    from .server.loadtest import main_loadtest

    return main_loadtest(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdraft", description="lossless speculative decoding")
    sub = p.add_subparsers(dest="cmd", required=True)

    dr = sub.add_parser("doctor", help="start here: this CPU, what works on it, which backend and method to pick")
    dr.add_argument("--model", default=None, help="the model whose cost curves are measured (default: the Qwen "
                    "1.5B target if pulled, else SmolLM2)")
    dr.add_argument("--no-costs", action="store_true", help="skip the cost curves (a few seconds to a minute)")
    dr.add_argument("--threads", type=int, default=None)
    dr.set_defaults(fn=cmd_doctor)

    m = sub.add_parser("models", help="list or pull the known models")
    m.add_argument("action", choices=["list", "pull", "quantize"])
    m.add_argument("names", nargs="*")
    m.add_argument("--type", default=None, help="quantize: the llama.cpp type (Q4_0, Q8_0, Q4_K_M, ...)")
    m.add_argument("--threads", type=int, default=None, help="quantize: threads (default: all cores)")
    m.set_defaults(fn=cmd_models)

    g = sub.add_parser("generate", help="generate text from one prompt")
    _add_model_args(g)
    _add_spec_args(g)
    _add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    g.add_argument("prompt")
    g.set_defaults(fn=cmd_generate)

    ds = sub.add_parser("datastore", help="build the suffix method's global datastore from a corpus")
    ds.add_argument("action", choices=["build"])
    ds.add_argument("corpus", help="jsonl with a text, prompt or turns field per line")
    ds.add_argument("--target", required=True, help="the target model whose tokenizer to use")
    ds.add_argument("-o", "--output", required=True, help="output directory (the store)")
    ds.add_argument("--sort-depth", type=int, default=64, help="longest match/continuation the store resolves")
    ds.add_argument("--max-docs", type=int, default=None, help="use only the first N documents")
    ds.set_defaults(fn=cmd_datastore)

    d = sub.add_parser("demo", help="the Qwen pair on a few Spec-Bench prompts, every method")
    _add_model_args(d, default_draft="qwen2.5-coder-0.5b")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--n-prompts", type=int, default=3)
    d.add_argument("--k", type=int, default=3)
    d.set_defaults(fn=cmd_demo)

    c = sub.add_parser("costs", help="ms per target forward for n new tokens (does speculation pay here?)")
    c.add_argument("--target", default="qwen2.5-coder-1.5b")
    _add_backend_arg(c)
    c.add_argument("--dtype", default="bfloat16", help="comma list, e.g. bfloat16,float32")
    c.add_argument("--quantizations", default=None, metavar="none,int8,int4",
                   help="hf backend: also (or only, without 'none') low-bit copies, per dtype: int8 / int4[-gN] "
                        "(weight-only) or w8a8 (int8 activations too, oneDNN)")
    c.add_argument("--draft", default=None, metavar="NAME[:TYPE]",
                   help="also measure this draft model and print, per k, what a step costs in plain target tokens "
                        "and the acceptance it needs to pay (e.g. self:Q4_K_M --draft-backend llama)")
    _add_draft_backend_arg(c)
    c.add_argument("--tokens", default="1,2,3,5,9,17,33,65")
    c.add_argument("--context", type=int, default=60)
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--threads", type=int, default=None)
    c.add_argument("--tree", action="store_true", help="also score random token trees (4D tree mask) of each size")
    c.add_argument("--json", default=None, help="save the measurements as JSON")
    c.add_argument("--plot", default=None, help="save a PNG of the cost curve")
    c.set_defaults(fn=cmd_costs)

    t = sub.add_parser("tune-skip", help="search the decoder layers to skip for layer_skip self-speculation")
    t.add_argument("--target", default="smollm2-135m")
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--dataset", default=None, help="prompts jsonl (default: Spec-Bench)")
    t.add_argument("--prompts-per-task", type=int, default=2, help="tuning prompts from the end of each task")
    t.add_argument("--tokens", type=int, default=48, help="target greedy tokens per tuning prompt")
    t.add_argument("--max-k", type=int, default=6)
    t.add_argument("--max-evals", type=int, default=200, help="candidate sets to score at most")
    t.add_argument("-o", "--out", default="skip.json")
    t.set_defaults(fn=cmd_tune_skip)

    from .train import add_train_args, cmd_train

    tr = sub.add_parser("train", help="train a Medusa or EAGLE head on the target's own answers (self-distillation)")
    add_train_args(tr)
    tr.set_defaults(fn=cmd_train)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (see docs/server.md)")
    _add_model_args(s, default_target="smollm2-135m")
    _add_spec_args(s)
    s.add_argument("--name", default=None, help="model name served in /v1/models (default: --target)")
    s.add_argument("--host", default="127.0.0.1", help="a non-loopback address needs --api-key (or --insecure)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                   "(default: $SPECDRAFT_API_KEY)")
    s.add_argument("--metrics-open", action="store_true", help="serve /metrics without the API key")
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-queue", type=int, default=64, help="requests allowed to wait; more get HTTP 429")
    s.add_argument("--timeout", type=float, default=None, help="seconds a request may take (queue + decode)")
    s.add_argument("--max-tokens", type=int, default=256, help="default max_tokens when a request sets none")
    s.add_argument("--max-batch", type=int, default=1,
                   help="sequences decoded together (1: one request at a time; >1: continuous batching)")
    s.add_argument("--spec-shrink-at", type=int, default=SPEC_SHRINK_AT,
                   help=f"batch size from which draft length is halved (batch scheduler; default {SPEC_SHRINK_AT}, "
                        "measured with specdraft batchbench)")
    s.add_argument("--spec-off-at", type=int, default=SPEC_OFF_AT,
                   help=f"batch size from which speculation is turned off (batch scheduler; default {SPEC_OFF_AT})")
    s.add_argument("--max-body-mb", type=float, default=4.0, help="larger request bodies get HTTP 413")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds running requests may take to finish before they are cancelled")
    s.add_argument("--stream-mode", choices=("normal", "fixed", "fixed-only"), default="normal",
                   help="streams of requests that name no stream_mode: normal (an event per engine step) or fixed "
                        "(fixed-size chunks at a steady cadence, hiding what speculation accepted); fixed-only also "
                        "refuses stream_mode \"normal\" (docs/server.md, 'Speculation side channel')")
    s.add_argument("--stream-chunk", type=int, default=4, help="fixed streams: tokens per event")
    s.add_argument("--stream-interval-ms", type=float, default=200.0,
                   help="fixed streams: ms between events; set it at or above chunk / (plain tokens/s) of this "
                        "server, or decoding time shows through")
    s.add_argument("--stream-pad-bytes", type=int, default=512,
                   help="fixed streams: every event is padded to a multiple of this many bytes (0: no padding)")
    s.add_argument("--replicas", type=int, default=1,
                   help="engine replicas (Ray actors, each with its own model) behind this one endpoint, routed by "
                        "fewest running requests (docs/scale.md; needs `make setup-ray`)")
    s.add_argument("--ray-address", default=None,
                   help="run the replicas on this Ray cluster (auto, or HOST:PORT of `ray start --head`; default: a "
                        "local Ray instance)")
    s.add_argument("--replica-cpus", type=int, default=None,
                   help="CPUs (torch threads) per replica (default: the cluster's CPUs / --replicas)")
    s.add_argument("--resource", action="append", default=[], metavar="FIELD:NAME=PATH",
                   help="a file a request's spec may name by NAME (FIELD: head, datastore, skip_config or autotune; "
                        "repeatable); requests never name paths")
    s.add_argument("--allowed-host", action="append", default=[], metavar="HOST",
                   help="without an API key, a Host header the server answers besides loopback names (repeatable)")
    s.add_argument("--log-level", default="warning")
    s.set_defaults(fn=cmd_serve)

    ov = sub.add_parser("overlap", help="model the overlapped draft/verify pair from a bench run (measured vs "
                        "modelled here; predicted with a machine per model)")
    ov.add_argument("results", help="bench results JSON with pair_serial / pair_overlap records")
    ov.add_argument("--target", default=None, help="default: the results' target")
    ov.add_argument("--draft", default=None, help="default: the results' draft")
    ov.add_argument("--threads-apart", type=int, default=None,
                    help="threads each model gets on a machine of its own (default: this machine's cores)")
    ov.add_argument("--ray-address", default=None)
    ov.add_argument("-o", "--out", default=None, help="write the figures as JSON")
    ov.set_defaults(fn=cmd_overlap)

    lk = sub.add_parser("leak", help="measure what streamed responses' timing and sizes tell an observer, normal "
                        "vs stream_mode fixed (docs/server.md)")
    _add_model_args(lk, default_target="smollm2-135m")
    lk.add_argument("--method", default="prompt_lookup", help="the speculative method measured (default prompt_lookup)")
    lk.add_argument("--per-class", type=int, default=40, help="prompts per class (>= 10)")
    lk.add_argument("--max-tokens", type=int, default=48, help="tokens per response (ignore_eos: all the same length)")
    lk.add_argument("--chunk", type=int, default=4, help="fixed streams: tokens per event")
    lk.add_argument("--interval-ms", type=float, default=None,
                    help="fixed streams: ms between events (default: calibrated, chunk at --margin of the slowest "
                         "warm-up rate)")
    lk.add_argument("--margin", type=float, default=0.7, help="fraction of the slowest warm-up rate the cadence uses")
    lk.add_argument("--pad-bytes", type=int, default=512, help="fixed streams: events padded to a multiple of this")
    lk.add_argument("--dataset", default=None, help="Spec-Bench question.jsonl (default: the shared copy)")
    lk.add_argument("--quiet", action="store_true", help="no progress bar")
    lk.add_argument("--out", default="leak.json", help="JSON results file")
    lk.set_defaults(fn=cmd_leak)

    lt = sub.add_parser("loadtest", help="load-test a local specdraft server (spec on vs off)")
    lt.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    lt.add_argument("--concurrency", default="1,4,16", help="comma list of concurrent clients")
    lt.add_argument("--requests", type=int, default=16, help="requests per concurrency level and mode")
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run (and per request)")
    lt.add_argument("--modes", default="spec,plain", help="spec (server default) and/or plain (spec off)")
    lt.add_argument("--spec", default=None, help="SpecConfig JSON for the spec mode (default: the server's)")
    lt.add_argument("--out", default="loadtest.json", help="JSON results file")
    lt.add_argument("--api-key", default=None, help="the server's API key (default: $SPECDRAFT_API_KEY)")
    lt.add_argument("--soak", action="store_true", help="mixed load at each --concurrency level (--requests each), "
                    "every greedy answer checked against the same request alone, then --disconnects requests whose "
                    "clients leave at random points, and the server's /health before and after")
    lt.add_argument("--disconnects", type=int, default=1000, help="--soak: requests whose clients disconnect")
    lt.add_argument("--soak-methods", default="prompt_lookup,plain", help="--soak: methods the requests draw from")
    lt.set_defaults(fn=cmd_loadtest)

    from .bench.batchbench import add_batchbench_args

    bb = sub.add_parser("batchbench", help="batch engine: speculation vs plain across batch sizes (the crossover)")
    add_batchbench_args(bb)
    bb.set_defaults(fn=cmd_batchbench)

    from .bench.harness import add_bench_args

    at = sub.add_parser("autotune", help="measure drafting configurations here; write the best (and method=auto's arms)")
    _add_model_args(at)
    at.add_argument("--prompts", default=None, help="calibration prompts jsonl (default: Spec-Bench's last prompt "
                    "per task + the last code edits)")
    at.add_argument("--n", type=int, default=8, help="calibration prompts")
    at.add_argument("--max-new-tokens", type=int, default=64)
    at.add_argument("--temperature", type=float, default=0.0, help="calibrate for this temperature (seed 0)")
    at.add_argument("--only", default=None, help="comma list: try only these configurations (names or methods)")
    at.add_argument("--arms", type=int, default=3, help="how many of the best configurations method=auto chooses among")
    at.add_argument("--no-tree-search", action="store_true", help="skip the hardware-aware tree search")
    at.add_argument("-o", "--out", default=None, help="output JSON (default: where method=auto looks for it)")
    at.set_defaults(fn=cmd_autotune)

    b = sub.add_parser("bench", help="benchmark methods on Spec-Bench (see docs/benchmarks.md)")
    add_bench_args(b)
    b.set_defaults(fn=cmd_bench)
    return p


def _apply_quantize(a) -> None:
    """--quantize Q is --target NAME:Q (hf backend only: a GGUF file carries its own quantization)."""
    if getattr(a, "quantize", None) is None:
        return
    from .models.lowbit import parse_quant

    if a.backend != "hf":
        raise SpecDraftError(f"--quantize is for the hf backend; on {a.backend}, pick a GGUF variant "
                             "(--target NAME:Q8_0, made by `specdraft models quantize`)")
    parse_quant(a.quantize)
    a.target = f"{a.target}:{a.quantize}"


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
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
