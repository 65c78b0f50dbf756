"""``specdraft bench``: fair by construction.

- every method runs on the same token ids, interleaved per prompt (A B C A B C ...), after a
  warm-up of each method, in one process, with a fixed torch thread count;
- tokens are counted from token ids; wall time is the method's own call, prefill included;
- results are written (atomically) after every record, so Ctrl-C leaves a valid file and a rerun
  with the same ``--out`` resumes;
- greedy outputs are compared with the engine's plain decoding; each mismatch records the first
  diverging position and the target's top-2 logit gap there (near-tie or bug?).

``--ray`` shards the prompts over Ray workers (bench/shard.py); each runs ``run_prompt`` as a local run does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from ..commands.flags import add_device_args
from ..core import methods
from ..core import prompts as data
from ..core.config import SamplingParams, SpecConfig, for_method, spec_keys, unread
from ..core.errors import ConfigError, SpecDraftError
from ..core.extras import needs_extra
from ..core.fidelity import output_terms
from ..core.metrics import decode_phase
from ..drafters.runs_on import unavailable
from ..models.backends import BACKENDS, check_draft_flags
from ..scale import cluster
from .environment import environment
from .report import read_results, render

BASELINES = (
    "hf_generate",
    "hf_assisted",
    "hf_prompt_lookup",
    "llama_cpp",
    "llama_cpp_lookup",
    "llama_cpp_draft",
    "ov_genai",
    "ov_genai_lookup",
    "ov_genai_draft",
    "ov_genai_eagle3",
)
# the engine's remote_draft method (the draft in a Ray actor) in turns and drafting while the target verifies
PAIRS = {"pair_serial": False, "pair_overlap": True}
WARM_UP = {"id": "warm-up", "prompt": "Say hello in three languages."}  # not one of any preset's prompts
HF = "hf:"  # "BACKEND:METHOD" (hf:, llama:, openvino:) runs METHOD on that backend in the same run


def on_backend(name: str) -> tuple[str | None, str]:
    """A method name -> (the backend it names, the method): 'llama:suffix' -> ('llama', 'suffix');
    a name without a backend prefix -> (None, name)."""
    b, sep, inner = name.partition(":")
    return (b, inner) if sep and b in BACKENDS else (None, name)


# The options a preset may fill (--preset headline), with their values when neither the user nor a preset
# gives one; in BenchOptions they are None until then, so that a value typed at its default is still given.
UNGIVEN = {
    "target": "qwen2.5-coder-1.5b",
    "backend": "hf",
    "reference": "plain",
    "llama_k": "10",
    "methods": "plain,draft_model,prompt_lookup",
    "max_new_tokens": 128,
    "out": "results/bench.json",
}


@dataclass(frozen=True)
class BenchOptions:
    """``specdraft bench``'s flags (a --config file may set any of them too: plan_bench). None in a field of
    UNGIVEN: not given (``with_defaults`` fills it)."""

    action: str = "run"  # run | report
    results: str | None = None  # with report: the results JSON
    target: str | None = None
    draft: str | None = None
    draft_layers: int | None = None
    dtype: str = "bfloat16"
    threads: int | None = None
    backend: str | None = None
    draft_backend: str | None = None
    device: str = "auto"  # core/device.py
    draft_device: str | None = None  # None: --device's
    reference: str | None = None
    llama_k: str | None = None  # a comma list
    pair_threads: int = 1
    llama_draft_k: str = "4"  # a comma list
    methods: str | None = None
    config: str | None = None
    dataset: str | None = None
    tasks: str | None = None
    n_per_task: int | None = None
    preset: str | None = None
    max_new_tokens: int | None = None
    json_schema: str | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    k: int | None = None
    repeats: int = 1
    sweep: list = field(default_factory=list)  # FIELD=v1,v2,... each
    no_chat: bool = False
    out: str | None = None
    no_plots: bool = False
    ray: str | None = None
    ray_workers: int | None = None
    ray_worker_cpus: int | None = None

    def with_defaults(self) -> "BenchOptions":
        """These options with UNGIVEN's values where none was given (nor filled by a preset)."""
        return replace(self, **{k: v for k, v in UNGIVEN.items() if getattr(self, k) is None})

    def ray_options(self) -> cluster.RayOptions:
        return cluster.RayOptions(self.ray, self.ray_workers, self.ray_worker_cpus, self.threads)


def add_parser(sub):
    b = sub.add_parser("bench", help="benchmark methods on Spec-Bench (see docs/benchmark-log.md)")
    b.add_argument(
        "action",
        nargs="?",
        default="run",
        choices=["run", "report"],
        help="run (default) or re-render a report from --out / a results file",
    )
    b.add_argument("results", nargs="?", default=None, help="with 'report': the results JSON")
    b.add_argument("--target", default=None, help=f"default {UNGIVEN['target']}")
    b.add_argument("--draft", default=None)
    b.add_argument("--draft-layers", type=int, default=None)
    b.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16", "float16"],
        help="the hf backend's weights (the hf: methods' with --backend llama)",
    )
    b.add_argument("--threads", type=int, default=None)
    b.add_argument(
        "--backend",
        default=None,
        choices=tuple(BACKENDS),
        help="the engine's model backend (default hf); with llama, METHOD runs on the GGUF file and "
        "hf:METHOD on transformers in the same run",
    )
    b.add_argument(
        "--draft-backend",
        default=None,
        choices=tuple(BACKENDS),
        help="the draft's backend (default: --backend's); transformers' baselines (hf_assisted) keep a "
        "transformers copy of the draft",
    )
    add_device_args(b)
    b.add_argument(
        "--reference",
        default=None,
        help="the method speedups are measured against (default plain; e.g. llama_cpp: llama.cpp's plain decoding)",
    )
    b.add_argument(
        "--llama-k",
        default=None,
        help="draft tokens of llama_cpp_lookup and ov_genai_lookup (default "
        "10); a comma list runs each (llama_cpp_lookup[k=4], ...) so the strongest setting is in the table",
    )
    b.add_argument(
        "--pair-threads",
        type=int,
        default=1,
        help="pair_serial / pair_overlap (method remote_draft, the draft in a Ray actor, in turns / "
        "drafting while the target verifies): threads of the draft's process",
    )
    b.add_argument(
        "--llama-draft-k",
        default="4",
        help="draft tokens of llama_cpp_draft, ov_genai_draft and "
        "ov_genai_eagle3 (OpenVINO GenAI's EAGLE-3 decoding with the head of --config's spec.head; a comma "
        "list, likewise)",
    )
    b.add_argument(
        "--methods",
        default=None,
        help=f"default {UNGIVEN['methods']}; comma list of {tuple(methods.REGISTRY) + BASELINES}, "
        "or BACKEND:METHOD (e.g. llama:suffix: METHOD on that backend, beside --backend's, in the same run), or "
        "llama_cpp@MODEL / ov_genai@MODEL (llama.cpp's / OpenVINO GenAI's plain decoding of another GGUF, "
        "e.g. the Q4_K_M file beside a NAME:Q4_0 target)",
    )
    b.add_argument(
        "--config",
        default=None,
        help="JSON or YAML: any of these options, plus 'spec' (base SpecConfig) and 'variants' {name: SpecConfig}",
    )
    b.add_argument("--dataset", default=None)
    b.add_argument(
        "--tasks", default=None, help="comma list (mt_bench, translation, summarization, qa, math_reasoning, rag)"
    )
    b.add_argument("--n-per-task", type=int, default=None)
    b.add_argument(
        "--preset",
        default=None,
        help="headline: the README's results table (every fastest plain and "
        "speculative CPU decoder against specdraft's methods, core18+code_edit; `make bench`); core18: 18 "
        "generic Spec-Bench prompts; code_edit: 9 snippet-rewriting prompts shipped with specdraft "
        "(bench/code_edit.jsonl); join prompt presets with +: core18+code_edit; multiturn: conversations resent "
        "whole every turn (Spec-Bench's two-turn chats, agent-like code edits) against llama.cpp keeping its "
        "cached prefix (bench/multiturn.py; takes --target, --backend, --methods, --n-per-task, "
        "--max-new-tokens, --threads, --out)",
    )
    b.add_argument("--max-new-tokens", type=int, default=None, help=f"default {UNGIVEN['max_new_tokens']}")
    b.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="constrain every engine method's output to this "
        "JSON schema (plain included; e.g. specdraft/bench/structured_schema.json with --preset structured); "
        "records say whether each output parses and validates",
    )
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument(
        "--k", type=int, default=None, help="draft tokens per step for the engine's methods (and the pair_* methods)"
    )
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument(
        "--sweep",
        action="append",
        default=[],
        help="KEY=v1,v2,... over spec keys (SpecConfig fields or the methods' own settings)",
    )
    b.add_argument("--no-chat", action="store_true", help="feed raw prompts instead of the chat template")
    b.add_argument("--out", default=None, help=f"default {UNGIVEN['out']}")
    b.add_argument("--no-plots", action="store_true")
    cluster.add_ray_args(
        b,
        "shard the PROMPTS over Ray worker actors (each loads the models once; every method of a "
        "prompt runs interleaved on one worker; speedups are computed per worker, then aggregated; "
        "docs/benchmark-log.md#sharding-over-ray). No value: a local Ray instance; else a cluster address "
        "(auto, HOST:PORT). Put it after the positional arguments, or write --ray=ADDRESS",
    )
    return b


def _load_config(path: str) -> dict:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise SpecDraftError("YAML configs need PyYAML (pip install pyyaml), or use JSON") from e
        d = yaml.safe_load(text)
    else:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecDraftError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise SpecDraftError(f"{path} must hold an object")
    return d


def _parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    return v


def build_variants(opts: BenchOptions, cfg: dict) -> list[tuple[str, str, SpecConfig | None]]:
    """-> [(name, kind, spec)] where kind is an engine method or a baseline name."""
    base = dict(cfg.get("spec", {}))
    if opts.k is not None:
        base["k"] = opts.k
        base.setdefault("max_k", max(16, opts.k))
    named = {n: SpecConfig.from_dict(d) for n, d in cfg.get("variants", {}).items()}
    sweeps = []
    for s in opts.sweep:
        if "=" not in s:
            raise ConfigError(f"--sweep expects FIELD=v1,v2,..., got {s!r}")
        f, vs = s.split("=", 1)
        if f not in spec_keys() or f == "method":
            raise ConfigError(f"--sweep key {f!r} is no spec key (a SpecConfig field or a method's own setting)")
        sweeps.append((f, [_parse_value(v) for v in vs.split(",")]))
    listed = [x.strip() for x in opts.methods.split(",") if x.strip()]
    read_elsewhere = {"head"} if "ov_genai_eagle3" in listed else set()  # the head GenAI's EAGLE-3 decoding runs
    _check_read(
        {k: v for k, v in base.items() if k not in read_elsewhere},
        sweeps,
        [on_backend(m)[1] for m in listed if on_backend(m)[1] in methods.REGISTRY],
    )
    out = []
    for m in listed:
        b, inner = on_backend(m)
        if b and (inner in methods.REGISTRY or inner in named):
            spec = named[inner] if inner in named else SpecConfig.from_dict(for_method(base, inner))
            out.append((m, spec.method, spec))
        elif m in named:
            out.append((m, named[m].method, named[m]))
        elif m.startswith(("llama_cpp@", "ov_genai@")):  # plain decoding of another GGUF (e.g. the Q4_K_M file)
            out.append((m, m.split("@", 1)[0], {"model": m.split("@", 1)[1]}))
        elif m in ("llama_cpp_lookup", "llama_cpp_draft", "ov_genai_lookup", "ov_genai_draft", "ov_genai_eagle3"):
            ks = [int(k) for k in str(opts.llama_k if m.endswith("_lookup") else opts.llama_draft_k).split(",")]
            head = {"head": base.get("head")} if m == "ov_genai_eagle3" else {}
            out += [(m if len(ks) == 1 else f"{m}[k={k}]", m, {"k": k, **head}) for k in ks]
        elif m in PAIRS:
            d = {**base, "method": "remote_draft", "prefetch": PAIRS[m], "remote_threads": opts.pair_threads}
            out.append((m, "remote_draft", SpecConfig.from_dict(for_method(d, "remote_draft"))))
        elif m in BASELINES:
            out.append((m, m, None))
        elif m in methods.REGISTRY:
            if m == "plain" or not sweeps:
                out.append((m, m, SpecConfig.from_dict(for_method(base, m))))
            else:
                combos = [{}]
                for f, vs in sweeps:
                    combos = [{**c, f: v} for c in combos for v in vs]
                for c in combos:
                    d = for_method({**base, **c}, m)
                    if "k" in c:
                        d["max_k"] = max(d.get("max_k", 16), c["k"])
                    label = m + "[" + ",".join(f"{f}={v}" for f, v in c.items()) + "]"
                    out.append((label, m, SpecConfig.from_dict(d)))
        else:
            raise ConfigError(
                f"unknown method {m!r}; choose from {', '.join(tuple(methods.REGISTRY) + BASELINES)} "
                f"or a variant named in --config"
            )
    names = {n for n, _, _ in out}
    for b in sorted({on_backend(n)[0] for n in names} - {None, opts.backend}):  # each backend's own reference
        if f"{b}:plain" not in names:
            out.append((f"{b}:plain", "plain", SpecConfig(method="plain")))
    if "plain" not in names:
        out.insert(0, ("plain", "plain", SpecConfig(method="plain")))  # the reference for speedup and exactness
    # plain decoding first, so that exactness can be checked as soon as a method finishes
    out.sort(key=lambda t: on_backend(t[0])[1] != "plain" or t[1] != "plain")
    return out


def _check_read(base: dict, sweeps: list, listed: list[str]) -> None:
    """The shared spec and the sweeps configure the listed methods, each keeping the keys it reads
    (config.for_method); a key set for none of them is an error."""
    for d in [base] + [{f: v} for f, vs in sweeps for v in vs] if listed else []:
        problem = unread(d, listed)
        if problem:
            raise ConfigError(problem)


def _save(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def top2_gap_at(
    target, prompt_ids: list[int], ref_tokens: list[int], pos: int, sp: SamplingParams | None = None
) -> float:
    """The target's top-2 logit gap before ref token ``pos``, computed as plain decoding computed it
    (the prompt prefilled, then one token per forward): a near-tie there explains a divergence. With
    penalties or a grammar (``sp``), the gap of the processed logits, which greedy decoding ranks."""
    rows = target.new_rows()
    rows.add_rows([prompt_ids[:-1]])
    feed = [prompt_ids[-1]] + ref_tokens[:pos]
    for t in feed:
        logits = rows.forward([[t]])[0, -1]
        rows.commit([1])
    if sp is not None and sp.processed:
        from ..core.processors import RequestProcessor

        proc = RequestProcessor.for_request(sp, prompt_ids, target.vocab_size, target.eos_token_ids(), target.tokenizer)
        proc.commit(ref_tokens[:pos])
        logits = proc.process(logits[None], prompt_ids + ref_tokens[:pos])[0]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare(target, ids, ref: list[int], got: list[int], sp: SamplingParams | None = None) -> dict:
    if got == ref:
        return {"exact": True}
    pos = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    d = {"exact": False, "first_divergence": pos}
    if pos < len(ref):
        d["top2_gap"] = top2_gap_at(target, ids, ref, pos, sp)
    return d


def reference_of(name: str, backend: str) -> str:
    """The plain run a method's greedy output is compared with: its own backend's."""
    b = on_backend(name)[0] or ("hf" if name.startswith("hf_") else backend)
    return "plain" if b == backend else f"{b}:plain"


def make_runners(opts: BenchOptions, variants, decs: dict, threads: int) -> tuple[list, dict]:
    """The runner of each variant; ``decs``: the decoder of each backend the run uses."""
    from .runners import EngineRunner, HFRunner, LlamaCppRunner

    runners, skipped = [], {}
    dec, hf_dec = decs[opts.backend], decs.get("hf")
    for name, kind, spec in variants:
        if kind in methods.REGISTRY:
            d = decs[on_backend(name)[0] or opts.backend]
            why = unavailable(methods.method(kind), d.backend, has_draft=True)  # a missing draft: make_drafter's error
            if why:
                raise ConfigError(f"{why} (or BACKEND:{kind} for a backend it runs on)")
            runners.append(EngineRunner(name, d, spec))
        elif kind == "hf_generate":
            runners.append(HFRunner(name, hf_dec, "plain"))
        elif kind == "hf_assisted":
            runners.append(HFRunner(name, hf_dec, "assisted"))
        elif kind == "hf_prompt_lookup":
            runners.append(HFRunner(name, hf_dec, "prompt_lookup"))
        elif kind.startswith("llama_cpp"):
            try:
                from ..models.backends import resolve_gguf

                mode = {"llama_cpp": "plain", "llama_cpp_lookup": "lookup", "llama_cpp_draft": "draft"}[kind]
                if mode == "draft" and not opts.draft:
                    raise ConfigError("llama_cpp_draft needs --draft NAME")
                draft = str(resolve_gguf(opts.draft)[0]) if mode == "draft" else None
                k = (spec or {}).get("k", 10)
                gguf_of = (spec or {}).get("model") or _gguf_name(opts.target)
                runners.append(
                    LlamaCppRunner(name, str(resolve_gguf(gguf_of)[0]), threads, dec.eos_ids, mode, draft, k)
                )
            except (ImportError, SpecDraftError) as e:
                skipped[name] = f"skipped: {needs_extra(name, 'llama', e) if isinstance(e, ImportError) else e}"
                print(f"{name}: {skipped[name]}", file=sys.stderr)
        elif kind.startswith("ov_genai"):
            try:
                runners.append(_ov_genai_runner(opts, name, kind, spec, threads, dec.eos_ids))
            except (ImportError, SpecDraftError) as e:
                skipped[name] = f"skipped: {needs_extra(name, 'openvino', e) if isinstance(e, ImportError) else e}"
                print(f"{name}: {skipped[name]}", file=sys.stderr)
    return runners, skipped


def _ov_genai_runner(opts: BenchOptions, name: str, kind: str, spec, threads: int, eos_ids):
    """OpenVINO GenAI's plain / prompt-lookup / draft-model decoding of the IR the openvino backend
    converts the target's GGUF file (or ``ov_genai@MODEL``'s) to."""
    from ..models.backends import resolve_gguf
    from ..models.openvino import ir_path
    from .runners import OVGenAIRunner

    def ir_dir(model: str) -> str:
        return str(ir_path(resolve_gguf(model)[0], model).parent)

    mode = {"ov_genai": "plain", "ov_genai_lookup": "lookup", "ov_genai_draft": "draft", "ov_genai_eagle3": "eagle3"}[
        kind
    ]
    if mode == "draft" and not opts.draft:
        raise ConfigError("ov_genai_draft needs --draft NAME")
    main = ir_dir((spec or {}).get("model") or _gguf_name(opts.target))
    draft = ir_dir(opts.draft) if mode == "draft" else None
    if mode == "eagle3":
        main, draft = _ov_genai_eagle3_dirs(opts, (spec or {}).get("head"), main)
    return OVGenAIRunner(name, main, threads, eos_ids, mode, draft, (spec or {}).get("k", 4))


def _ov_genai_eagle3_dirs(opts: BenchOptions, head: str | None, ir_dir: str) -> tuple[str, str]:
    """OpenVINO GenAI's main and draft directories for the EAGLE-3 ``head`` on the target's IR (bench/ov_eagle3.py)."""
    from pathlib import Path

    from ..models.catalog import home
    from .ov_eagle3 import cache_dir_for, prepare

    if not head:
        raise ConfigError("ov_genai_eagle3 needs an EAGLE-3 head: spec.head in --config")
    if opts.temperature > 0:
        raise ConfigError("ov_genai_eagle3: OpenVINO GenAI's EAGLE-3 decoding is greedy only (--temperature 0)")
    xml = Path(ir_dir) / "openvino_model.xml"
    dirs = prepare(head, xml, home() / "openvino" / cache_dir_for(head, xml))
    return str(dirs.main), str(dirs.draft)


def _target_on(backend: str, target: str) -> str:
    """The name ``target`` (--backend's) loads under on another backend: transformers reads the base
    model (NAME:Q4_0 is a GGUF variant), llama.cpp and OpenVINO the GGUF (NAME:int4 is a transformers copy)."""
    return target.partition(":")[0] if backend == "hf" else _gguf_name(target)


def _gguf_name(target: str) -> str:
    """The GGUF llama.cpp's baselines decode for ``target``: NAME:int4 / NAME:w8a8 are hf copies of NAME."""
    from ..models.lowbit import is_quant_suffix

    base, _, suffix = target.rpartition(":")
    return base if base and is_quant_suffix(suffix) else target


def _read_schema(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise SpecDraftError(f"cannot read --json-schema {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise SpecDraftError(f"--json-schema {path} is not valid JSON: {e}") from e


def schema_valid(text: str, schema: dict) -> bool:
    """Does ``text`` parse as JSON and validate against ``schema``."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@dataclass
class Plan:
    """What a run measures, settled before any model loads (all the driver and each Ray worker need)."""

    opts: BenchOptions  # the flags with --config's options applied
    sp: SamplingParams
    schema: dict | None
    variants: list
    rows: list[dict]
    draft: str | None  # the draft model to load, if any method uses one
    settings: dict


@dataclass
class Bench:
    """The loaded models and their runners: one per process (a local run, or each Ray worker)."""

    plan: Plan
    decs: dict  # backend -> its decoder (--backend's, and those BACKEND:METHOD names)
    runners: list
    skipped: dict
    encoded: dict = field(default_factory=dict)

    @property
    def dec(self):
        return self.decs[self.plan.opts.backend]

    def encode(self, r: dict) -> list[int]:
        if r["id"] not in self.encoded:  # the chat template applied once per prompt, outside any timing
            self.encoded[r["id"]] = self.dec.encode(r["prompt"], chat=not self.plan.opts.no_chat)
        return self.encoded[r["id"]]


def _apply_preset(opts: BenchOptions) -> tuple[BenchOptions, dict]:
    """--preset headline: its options where the user gave none -> (options, its variants)."""
    from .headline import NAME, TARGET, headline_config

    if opts.preset != NAME:
        return opts, {}
    target = opts.target or TARGET
    cfg = headline_config(target)
    assert set(cfg) - {"variants", "preset"} <= set(UNGIVEN), "a preset fills only options that can be left ungiven"
    fills = {k: v for k, v in cfg.items() if k != "variants" and getattr(opts, k) is None}
    fills.update(target=target, preset=cfg["preset"])  # the prompts: core18+code_edit
    return replace(opts, **fills), {"variants": cfg["variants"]}


def _apply_config(opts: BenchOptions) -> tuple[BenchOptions, dict]:
    """--preset headline's options, then --config's over the flags, then the defaults of what neither gave;
    -> (options, the config: its 'spec' and 'variants' too)."""
    opts, preset = _apply_preset(opts)
    cfg = {**preset, **(_load_config(opts.config) if opts.config else {})}
    names = {f.name for f in fields(opts)}
    changes = {}
    for key, val in cfg.items():
        if key not in ("spec", "variants"):
            attr = key.replace("-", "_")
            if attr not in names:
                raise ConfigError(f"unknown option {key!r} in {opts.config}")
            changes[attr] = val
    return replace(opts, **changes).with_defaults(), cfg


def plan_bench(opts: BenchOptions) -> Plan:
    """Options, --config, methods and prompts -> the Plan (checks everything that needs no model)."""
    opts, cfg = _apply_config(opts)
    check_draft_flags(
        opts.draft, draft_layers=opts.draft_layers, draft_backend=opts.draft_backend, draft_device=opts.draft_device
    )
    schema = _read_schema(opts.json_schema) if opts.json_schema else None
    sp = SamplingParams(
        temperature=opts.temperature,
        top_k=opts.top_k,
        top_p=opts.top_p,
        seed=opts.seed,
        max_new_tokens=opts.max_new_tokens,
        json_schema=schema,
    ).validate()
    variants = build_variants(opts, cfg)
    if schema is not None:
        other = [n for n, k, _ in variants if k not in methods.REGISTRY]
        if other:  # a baseline without the constraint would not be the same workload
            raise ConfigError(f"--json-schema constrains specdraft's methods only; drop the baselines {other}")
    needs_draft = any(
        k in ("hf_assisted", "llama_cpp_draft") or (k in methods.REGISTRY and methods.method(k).needs == "draft_model")
        for _, k, _ in variants
    )
    uses_draft = needs_draft or any(k in methods.REGISTRY and methods.method(k).uses_draft for _, k, _ in variants)
    if opts.draft and not uses_draft:
        raise ConfigError(
            f"--draft {opts.draft}: none of the methods measured ({', '.join(n for n, _, _ in variants)}) uses a draft "
            "model; add one that does (draft_model, auto, hf_assisted, ...) to --methods, or leave --draft out"
        )
    if needs_draft and not opts.draft:
        raise ConfigError(
            f"{' / '.join(methods.methods_needing('draft_model'))} / hf_assisted / pair_* need --draft NAME"
        )
    rows = data.preset_rows(opts.preset, opts.dataset, opts.tasks.split(",") if opts.tasks else None, opts.n_per_task)
    if not rows:
        raise SpecDraftError("no prompts selected")
    settings = {
        "target": opts.target,
        "draft": opts.draft,
        "draft_layers": opts.draft_layers,
        "dtype": opts.dtype,
        "backend": opts.backend,
        "draft_backend": opts.draft_backend,
        "reference": opts.reference,
        **({"device": opts.device, "draft_device": opts.draft_device} if _devices_given(opts) else {}),
        "sampling": sp.to_dict(),
        "chat": not opts.no_chat,
        "repeats": opts.repeats,
        "methods": {
            n: (s.to_dict() if isinstance(s, SpecConfig) else {"baseline": k, **(s or {})}) for n, k, s in variants
        },
        "prompts": [r["id"] for r in rows],
    }
    return Plan(opts, sp, schema, variants, rows, opts.draft, settings)


def _devices_given(opts: BenchOptions) -> bool:
    """Whether --device / --draft-device were given (results of runs that gave none keep their settings)."""
    return opts.device != "auto" or opts.draft_device is not None


def load_bench(plan: Plan, threads: int) -> Bench:
    """Load the models, make the runners, and warm each runner up once (not recorded)."""
    from ..api import SpecDecoder

    opts = plan.opts
    where = {"device": opts.device, "draft_device": opts.draft_device}
    dec = SpecDecoder.load(
        opts.target,
        draft=plan.draft,
        dtype=opts.dtype,
        draft_layers=opts.draft_layers,
        threads=threads,
        backend=opts.backend,
        draft_backend=opts.draft_backend,
        **where,
    )
    decs = {opts.backend: dec}
    wanted = _other_backends(plan.variants)
    for b in sorted(set(wanted) - {None, opts.backend}):
        try:
            decs[b] = SpecDecoder.load(
                _target_on(b, opts.target),
                draft=plan.draft,
                dtype=opts.dtype,
                draft_layers=opts.draft_layers,
                threads=threads,
                backend=b,
                **where,
            )
        except SpecDraftError as e:  # named as what the run asked of that backend, beside --backend's
            them = "it" if len(wanted[b]) == 1 else "them"
            raise ConfigError(
                f"{', '.join(wanted[b])} run on the {b} backend, which cannot load "
                f"{_target_on(b, opts.target)} here ({e}); leave {them} out of --methods"
            ) from e
    if "hf" in wanted and opts.backend == "hf" and plan.draft and opts.draft_backend not in (None, "hf"):
        from ..models.backends import load_model  # transformers' baselines need a transformers draft

        draft = load_model(
            plan.draft, opts.dtype, num_layers=opts.draft_layers, backend="hf", device=opts.draft_device or opts.device
        )
        decs["hf"] = SpecDecoder(dec.target, draft)
    runners, skipped = make_runners(opts, plan.variants, decs, threads)
    bench = Bench(plan, decs, runners, skipped)
    # warm-up: every method once on a short generation, of a prompt that is not measured (a baseline that
    # caches prefixes across requests, as OpenVINO GenAI's does by default, would find a measured prompt
    # already prefilled)
    warm_sp = SamplingParams(**{**plan.sp.to_dict(), "max_new_tokens": min(8, plan.sp.max_new_tokens)})
    for rn in runners:
        rn.run(bench.encode(WARM_UP), warm_sp)
    return bench


def _other_backends(variants) -> dict[str | None, list[str]]:
    """The backend each variant names (BACKEND:METHOD, transformers' hf_* baselines; None: --backend's) ->
    the variants' names."""
    out: dict[str | None, list[str]] = {}
    for n, k, _ in variants:
        out.setdefault(on_backend(n)[0] or ("hf" if k.startswith("hf_") else None), []).append(n)
    return out


def open_results(out: Path, settings: dict, env: dict) -> dict:
    """A fresh results document, or the one in ``out`` to resume (it must hold the same settings)."""
    doc = {"settings": settings, "environment": env, "skipped": {}, "records": []}
    old = read_results(out, "pass another --out to start afresh")
    if old is not None:
        if old.get("settings") != settings:
            raise SpecDraftError(f"{out} holds results of other settings; pass another --out to start afresh")
        doc["records"] = old.get("records", [])
        if "workers" in old:
            doc["workers"] = old["workers"]
        print(f"resuming {out}: {len(doc['records'])} records already done", file=sys.stderr)
    return doc


def done_keys(records: list[dict]) -> set:
    return {(r["prompt_id"], r["method"], r["repeat"]) for r in records}


def reference_outputs(records: list[dict]) -> dict:
    """(plain method, prompt id) -> the plain output (repeat 0) greedy outputs are compared with."""
    return {
        (r["method"], r["prompt_id"]): r["token_ids"]
        for r in records
        if on_backend(r["method"])[1] == "plain" and r["repeat"] == 0
    }


def run_prompt(bench: Bench, r: dict, rep: int, runners: list, ref: dict, emit) -> None:
    """One prompt, one repeat: ``runners`` one after another on the same token ids (the fairness
    rules' interleaving); each record goes to ``emit`` as soon as it is made. ``ref`` is
    reference_outputs(); this prompt's plain output is added to it."""
    sp, schema = bench.plan.sp, bench.plan.schema
    ids = bench.encode(r)
    rsp = SamplingParams(**{**sp.to_dict(), "seed": sp.seed + rep if sp.seed is not None else None})
    for rn in runners:
        res = rn.run(ids, rsp)
        rec = {
            "prompt_id": r["id"],
            "task": r["task"],
            "method": rn.name,
            "repeat": rep,
            "prompt_tokens": len(ids),
            "new_tokens": len(res["token_ids"]),
            **res,
        }
        rec["decode_tokens"], rec["decode_s"] = decode_phase(rec["new_tokens"], res["wall_s"], res["first_token_s"])
        base = reference_of(rn.name, bench.plan.opts.backend)
        target = bench.decs[on_backend(base)[0] or bench.plan.opts.backend].target
        if rn.name == base and rep == 0:
            ref[base, r["id"]] = res["token_ids"]
        elif sp.greedy and (base, r["id"]) in ref and "@" not in rn.name:  # (name@MODEL decodes another file)
            rec.update(compare(target, ids, ref[base, r["id"]], res["token_ids"], rsp))
        if not sp.greedy:  # scored after the timed run: is this the target's distribution?
            rec.update(output_terms(target, ids, res["token_ids"], rsp))
        if schema is not None:
            rec["schema_valid"] = schema_valid(
                bench.dec.tokenizer.decode(res["token_ids"], skip_special_tokens=True), schema
            )
        emit(rec)


def interrupted(doc: dict, out: Path) -> None:
    print(
        f"\ninterrupted: {len(doc['records'])} records saved in {out}; rerun the same command to resume",
        file=sys.stderr,
    )


def run_local(bench: Bench, doc: dict, out: Path) -> None:
    """Every prompt in this process, repeat by repeat; the file is saved after every record."""
    from tqdm import tqdm

    done, ref = done_keys(doc["records"]), reference_outputs(doc["records"])
    todo = [
        (rep, r, [rn for rn in bench.runners if (r["id"], rn.name, rep) not in done])
        for rep in range(bench.plan.opts.repeats)
        for r in bench.plan.rows
    ]
    bar = tqdm(total=sum(len(rns) for _, _, rns in todo), desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True)

    def emit(rec):
        doc["records"].append(rec)
        _save(out, doc)
        bar.update(1)

    try:
        for rep, r, rns in todo:
            if rns:
                bar.set_postfix_str(f"{r['task']}:{r['id']}")
                run_prompt(bench, r, rep, rns, ref, emit)
    except KeyboardInterrupt:
        bar.close()
        interrupted(doc, out)
        raise
    bar.close()


def run_bench(opts: BenchOptions, run_sharded=None) -> tuple[dict, BenchOptions]:
    """-> (the results document, the options with --config's applied). ``run_sharded(plan, doc, out)`` runs
    a --ray plan (bench/shard.py's, which the CLI passes: it sits beside this module)."""
    from ..models.loading import set_threads

    opts.ray_options().check()
    plan = plan_bench(opts)
    opts = plan.opts
    threads = opts.ray_options().cpus if opts.ray is not None else set_threads(opts.threads)
    out = Path(opts.out)
    doc = open_results(out, plan.settings, environment(opts.dtype, threads))
    if opts.ray is not None:
        if run_sharded is None:
            raise ConfigError("--ray needs the Ray runner: run_bench(opts, specdraft.bench.shard.run_sharded)")
        run_sharded(plan, doc, out)
        return doc, opts
    bench = load_bench(plan, threads)
    doc["skipped"] = bench.skipped
    run_local(bench, doc, out)
    return doc, opts


MULTITURN_TAKES = ("target", "backend", "methods", "n_per_task", "max_new_tokens", "threads", "out", "preset", "action")


def multiturn_options(opts: BenchOptions):
    """--preset multiturn's options (bench/multiturn.py) from the flags; a flag it does not read is an error."""
    from .multiturn import MultiturnOptions

    unread_flags = [
        "--" + f.name.replace("_", "-")
        for f in fields(BenchOptions)
        if f.name not in MULTITURN_TAKES and getattr(opts, f.name) != getattr(BenchOptions(), f.name)
    ]
    if unread_flags:
        raise SpecDraftError(f"--preset multiturn does not take {', '.join(unread_flags)}")
    if opts.action != "run":
        raise SpecDraftError("--preset multiturn: only `bench run` (its summary is printed when it ends)")
    given = {k: getattr(opts, k) for k in MULTITURN_TAKES[:-2] if getattr(opts, k) is not None}
    return MultiturnOptions(**given)


def main_bench(opts: BenchOptions, run_sharded=None) -> int:
    if opts.preset == "multiturn":
        from .multiturn import main_multiturn

        return main_multiturn(multiturn_options(opts))
    if opts.action == "report":
        path = Path(opts.results or opts.with_defaults().out)
        doc = read_results(path, "name a file `specdraft bench` wrote")
        if doc is None:
            raise SpecDraftError(f"no results file {path}")
    else:
        t0 = time.time()
        doc, opts = run_bench(opts, run_sharded)
        path = Path(opts.out)
        print(f"bench finished in {time.time() - t0:.0f}s", file=sys.stderr)
    md = render(doc, path, plots=not opts.no_plots)
    print(md)
    stem = path.with_suffix("")
    plots = sorted(str(p) for p in stem.parent.glob(stem.name + "_*.png")) if not opts.no_plots else []
    print(
        f"results: {path}\nreport: {stem.with_name(stem.name + '_report.md')}\nplots: {', '.join(plots) or 'none'}",
        file=sys.stderr,
    )
    return 0
