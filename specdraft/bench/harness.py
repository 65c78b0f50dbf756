"""``specdraft bench``: fair by construction.

- every method runs on the same token ids, interleaved per prompt (A B C A B C ...), after a
  warm-up of each method, in one process, with a fixed torch thread count;
- tokens are counted from token ids; wall time is the method's own call, prefill included;
- results are written (atomically) after every record, so Ctrl-C leaves a valid file and a rerun
  with the same ``--out`` resumes;
- greedy outputs are compared with the engine's plain decoding; each mismatch records the first
  diverging position and the target's top-2 logit gap there (near-tie or bug?).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import methods
from ..config import SamplingParams, SpecConfig
from ..errors import ConfigError, SpecDraftError
from . import data
from .report import render

BASELINES = ("hf_generate", "hf_assisted", "hf_prompt_lookup", "llama_cpp", "llama_cpp_lookup", "llama_cpp_draft")
HF = "hf:"  # with --backend llama, "hf:METHOD" runs METHOD on the transformers backend in the same run


def add_bench_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("action", nargs="?", default="run", choices=["run", "report"],
                   help="run (default) or re-render a report from --out / a results file")
    b.add_argument("results", nargs="?", default=None, help="with 'report': the results JSON")
    b.add_argument("--target", default="qwen2.5-coder-1.5b")
    b.add_argument("--draft", default=None)
    b.add_argument("--draft-layers", type=int, default=None)
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="the hf backend's weights (the hf: methods' with --backend llama)")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--backend", default="hf", choices=("hf", "llama"),
                   help="the engine's model backend; with llama, METHOD runs on the GGUF file and hf:METHOD on "
                        "transformers in the same run")
    b.add_argument("--reference", default="plain",
                   help="the method speedups are measured against (e.g. llama_cpp: llama.cpp's plain decoding)")
    b.add_argument("--llama-k", default="10", help="draft tokens of llama_cpp_lookup; a comma list runs each "
                   "(llama_cpp_lookup[k=4], ...) so the strongest setting is in the table")
    b.add_argument("--llama-draft-k", default="4", help="draft tokens of llama_cpp_draft (a comma list, likewise)")
    b.add_argument("--methods", default="plain,draft_model,prompt_lookup",
                   help=f"comma list of {tuple(methods.REGISTRY) + BASELINES}, or {HF}METHOD (see --backend)")
    b.add_argument("--config", default=None, help="JSON or YAML: any of these options, plus 'spec' (base SpecConfig) "
                   "and 'variants' {name: SpecConfig}")
    b.add_argument("--dataset", default=None)
    b.add_argument("--tasks", default=None, help="comma list (mt_bench, translation, summarization, qa, math_reasoning, rag)")
    b.add_argument("--n-per-task", type=int, default=None)
    b.add_argument("--preset", default=None, help="core18: the 18 prompts of the core-engine issue; code_edit: 9 "
                   "snippet-rewriting prompts shipped with specdraft (bench/code_edit.jsonl); join with +: core18+code_edit")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--json-schema", default=None, metavar="FILE", help="constrain every engine method's output to this "
                   "JSON schema (plain included; e.g. specdraft/bench/structured_schema.json with --preset structured); "
                   "records say whether each output parses and validates")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--k", type=int, default=None, help="draft tokens per step for the engine's methods")
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--sweep", action="append", default=[], help="FIELD=v1,v2,... over SpecConfig fields")
    b.add_argument("--no-chat", action="store_true", help="feed raw prompts instead of the chat template")
    b.add_argument("--out", default="results/bench.json")
    b.add_argument("--no-plots", action="store_true")


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


def build_variants(a, cfg: dict) -> list[tuple[str, str, SpecConfig | None]]:
    """-> [(name, kind, spec)] where kind is an engine method or a baseline name."""
    base = dict(cfg.get("spec", {}))
    if a.k is not None:
        base["k"] = a.k
        base.setdefault("max_k", max(16, a.k))
    named = {n: SpecConfig.from_dict(d) for n, d in cfg.get("variants", {}).items()}
    sweeps = []
    for s in a.sweep:
        if "=" not in s:
            raise ConfigError(f"--sweep expects FIELD=v1,v2,..., got {s!r}")
        f, vs = s.split("=", 1)
        if f not in SpecConfig.__dataclass_fields__ or f == "method":
            raise ConfigError(f"--sweep field {f!r} is not a SpecConfig field")
        sweeps.append((f, [_parse_value(v) for v in vs.split(",")]))
    out = []
    for m in [x.strip() for x in a.methods.split(",") if x.strip()]:
        if m.startswith(HF) and (m[len(HF):] in methods.REGISTRY or m[len(HF):] in named):
            inner = m[len(HF):]
            spec = named[inner] if inner in named else SpecConfig.from_dict({**base, "method": inner})
            out.append((m, spec.method, spec))
        elif m in named:
            out.append((m, named[m].method, named[m]))
        elif m in ("llama_cpp_lookup", "llama_cpp_draft"):
            ks = [int(k) for k in str(a.llama_k if m == "llama_cpp_lookup" else a.llama_draft_k).split(",")]
            out += [(m if len(ks) == 1 else f"{m}[k={k}]", m, {"k": k}) for k in ks]
        elif m in BASELINES:
            out.append((m, m, None))
        elif m in methods.REGISTRY:
            if m == "plain" or not sweeps:
                out.append((m, m, SpecConfig.from_dict({**base, "method": m})))
            else:
                combos = [{}]
                for f, vs in sweeps:
                    combos = [{**c, f: v} for c in combos for v in vs]
                for c in combos:
                    d = {**base, "method": m, **c}
                    if "k" in c:
                        d["max_k"] = max(d.get("max_k", 16), c["k"])
                    label = m + "[" + ",".join(f"{f}={v}" for f, v in c.items()) + "]"
                    out.append((label, m, SpecConfig.from_dict(d)))
        else:
            raise ConfigError(f"unknown method {m!r}; choose from {', '.join(tuple(methods.REGISTRY) + BASELINES)} "
                              f"or a variant named in --config")
    if not any(n == "plain" for n, _, _ in out):
        out.insert(0, ("plain", "plain", SpecConfig(method="plain")))  # the reference for speedup and exactness
    else:  # plain first, so that exactness can be checked as soon as a method finishes
        out.sort(key=lambda t: t[0] not in ("plain", HF + "plain"))
    return out


def environment(a, threads: int) -> dict:
    import transformers

    from .. import __version__

    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                                  cwd=Path(__file__).resolve().parents[2]).stdout.strip()
        except Exception:
            return None

    from .costs import cpu_name

    try:
        from importlib.metadata import version

        llama_version = version("llama_cpp_python")
    except Exception:
        llama_version = None
    cpu = cpu_name()
    return {
        "specdraft": __version__,
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp_python": llama_version,
        "python": platform.python_version(),
        "cpu": cpu,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "threads": threads,
        "dtype": a.dtype,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _save(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def top2_gap_at(target, prompt_ids: list[int], ref_tokens: list[int], pos: int, sp: SamplingParams | None = None) -> float:
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
        from ..processors import RequestProcessor

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
    if backend != "hf" and (name.startswith(HF) or name.startswith("hf_")):
        return HF + "plain"
    return "plain"


def make_runners(a, variants, dec, hf_dec, threads: int) -> tuple[list, dict]:
    from .runners import EngineRunner, HFRunner, LlamaCppRunner

    runners, skipped = [], {}
    for name, kind, spec in variants:
        if kind in methods.REGISTRY:
            d = hf_dec if name.startswith(HF) else dec
            if d.backend not in methods.method(kind).backends:
                raise ConfigError(f"method {kind!r} is not available on the {d.backend} backend; methods there: "
                                  f"{', '.join(methods.methods_on(d.backend))} (or {HF}{kind} for transformers)")
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
                if mode == "draft" and not a.draft:
                    raise ConfigError("llama_cpp_draft needs --draft NAME")
                draft = str(resolve_gguf(a.draft)[0]) if mode == "draft" else None
                k = spec["k"] if spec else 10
                gguf_of = a.target.rsplit(":", 1)[0] if ":int" in a.target else a.target  # NAME:int4 is an hf copy
                runners.append(LlamaCppRunner(name, str(resolve_gguf(gguf_of)[0]), threads, dec.eos_ids, mode, draft, k))
            except (ImportError, SpecDraftError) as e:
                skipped[name] = f"skipped: {'llama-cpp-python not installed' if isinstance(e, ImportError) else e}"
                print(f"{name}: {skipped[name]}", file=sys.stderr)
    return runners, skipped


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


def run_bench(a) -> dict:
    from ..api import SpecDecoder
    from ..models.loading import set_threads

    cfg = _load_config(a.config) if a.config else {}
    for key, val in cfg.items():
        if key not in ("spec", "variants"):
            attr = key.replace("-", "_")
            if not hasattr(a, attr):
                raise ConfigError(f"unknown option {key!r} in {a.config}")
            setattr(a, attr, val)
    schema = _read_schema(a.json_schema) if a.json_schema else None
    sp = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                        max_new_tokens=a.max_new_tokens, json_schema=schema).validate()
    variants = build_variants(a, cfg)
    if schema is not None:
        other = [n for n, k, _ in variants if k not in methods.REGISTRY]
        if other:  # a baseline without the constraint would not be the same workload
            raise ConfigError(f"--json-schema constrains specdraft's methods only; drop the baselines {other}")
    needs_draft = any(k in ("hf_assisted", "llama_cpp_draft") or (k in methods.REGISTRY and methods.method(k).needs == "draft_model")
                      for _, k, _ in variants)
    uses_draft = needs_draft or any(k in methods.REGISTRY and methods.method(k).uses_draft for _, k, _ in variants)
    if needs_draft and not a.draft:
        raise ConfigError(f"{' / '.join(methods.methods_needing('draft_model'))} / hf_assisted need --draft NAME")
    rows = data.preset_rows(a.preset, a.dataset, a.tasks.split(",") if a.tasks else None, a.n_per_task)
    if not rows:
        raise SpecDraftError("no prompts selected")
    threads = set_threads(a.threads)
    draft = a.draft if uses_draft else None
    dec = SpecDecoder.load(a.target, draft=draft, dtype=a.dtype, draft_layers=a.draft_layers, threads=threads,
                           backend=a.backend)
    hf_dec = dec
    if a.backend != "hf" and any(n.startswith(HF) or k.startswith("hf_") for n, k, _ in variants):
        hf_dec = SpecDecoder.load(a.target.partition(":")[0], draft=draft, dtype=a.dtype,  # NAME:TYPE is a GGUF variant
                                  draft_layers=a.draft_layers, threads=threads)
    runners, skipped = make_runners(a, variants, dec, hf_dec, threads)

    out = Path(a.out)
    settings = {
        "target": a.target, "draft": a.draft, "draft_layers": a.draft_layers, "dtype": a.dtype,
        "backend": a.backend, "reference": a.reference,
        "sampling": sp.to_dict(), "chat": not a.no_chat, "repeats": a.repeats,
        "methods": {n: (s.to_dict() if isinstance(s, SpecConfig) else {"baseline": k, **(s or {})})
                    for n, k, s in variants},
        "prompts": [r["id"] for r in rows],
    }
    doc = {"settings": settings, "environment": environment(a, threads), "skipped": skipped, "records": []}
    if out.exists():
        old = json.loads(out.read_text())
        if old.get("settings") != settings:
            raise SpecDraftError(f"{out} holds results of other settings; pass another --out to start afresh")
        doc["records"] = old.get("records", [])
        print(f"resuming {out}: {len(doc['records'])} records already done", file=sys.stderr)
    done = {(r["prompt_id"], r["method"], r["repeat"]) for r in doc["records"]}
    ref = {(r["method"], r["prompt_id"]): r["token_ids"] for r in doc["records"]
           if r["method"] in ("plain", HF + "plain") and r["repeat"] == 0}

    encoded = {r["id"]: dec.encode(r["prompt"], chat=not a.no_chat) for r in rows}
    # warm-up: every method once on a short generation (not recorded)
    warm_sp = SamplingParams(**{**sp.to_dict(), "max_new_tokens": min(8, sp.max_new_tokens)})
    for rn in runners:
        rn.run(encoded[rows[0]["id"]], warm_sp)

    from tqdm import tqdm

    todo = [(rep, r, rn) for rep in range(a.repeats) for r in rows for rn in runners
            if (r["id"], rn.name, rep) not in done]
    bar = tqdm(todo, desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True)
    try:
        for rep, r, rn in bar:
            bar.set_postfix_str(f"{r['task']}:{r['id']} {rn.name}")
            ids = encoded[r["id"]]
            rsp = SamplingParams(**{**sp.to_dict(), "seed": sp.seed + rep if sp.seed is not None else None})
            res = rn.run(ids, rsp)
            rec = {"prompt_id": r["id"], "task": r["task"], "method": rn.name, "repeat": rep,
                   "prompt_tokens": len(ids), "new_tokens": len(res["token_ids"]), **res}
            base = reference_of(rn.name, a.backend)
            if rn.name == base and rep == 0:
                ref[base, r["id"]] = res["token_ids"]
            elif sp.greedy and (base, r["id"]) in ref:
                target = (hf_dec if base.startswith(HF) else dec).target
                rec.update(compare(target, ids, ref[base, r["id"]], res["token_ids"], rsp))
            if schema is not None:
                rec["schema_valid"] = schema_valid(dec.tokenizer.decode(res["token_ids"], skip_special_tokens=True), schema)
            doc["records"].append(rec)
            _save(out, doc)
    except KeyboardInterrupt:
        bar.close()
        print(f"\ninterrupted: {len(doc['records'])} records saved in {out}; rerun the same command to resume",
              file=sys.stderr)
        raise
    bar.close()
    return doc


def main_bench(a) -> int:
    if a.action == "report":
        path = Path(a.results or a.out)
        if not path.exists():
            raise SpecDraftError(f"no results file {path}")
        doc = json.loads(path.read_text())
    else:
        t0 = time.time()
        doc = run_bench(a)
        path = Path(a.out)
        print(f"bench finished in {time.time() - t0:.0f}s", file=sys.stderr)
    md = render(doc, path, plots=not a.no_plots)
    print(md)
    return 0
