"""``specdraft doctor``: what this machine is, what works on it, and which backend and method to pick.

It prints the CPU and its instruction set, the torch and llama.cpp builds, the llama.cpp probe's
verdict (llama_probe.py), the models that are ready, a short cost curve per backend (ms per forward
of 1 / 4 / 8 / 16 tokens) and a recommendation read off that curve. Exit status 1 when something the
README promises does not work here (a backend that cannot load or decode), 0 otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

TOKENS = (1, 4, 8, 16)


@dataclass
class Report:
    lines: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def say(self, what: str, text: str) -> None:
        self.lines.append((what, text))
        print(f"{what:8s} {text}", flush=True)

    def problem(self, what: str, text: str) -> None:
        self.problems.append(f"{what}: {text}")
        self.say(what, "PROBLEM: " + text)


def isa_summary(flags: list[str]) -> str:
    names = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16",
             "avx_vnni": "AVX_VNNI", "amx_tile": "AMX (tile)", "amx_int8": "AMX_INT8", "amx_bf16": "AMX_BF16"}
    return " ".join(names[f] for f in names if f in flags) or "no AVX2"


def check_cpu_and_torch(r: Report, threads: int) -> None:
    import os

    import torch

    from .costs import cpu_name
    from .models.llama_probe import cpu_flags

    r.say("cpu", f"{cpu_name().split(' (')[0]}, {os.cpu_count()} cores; {isa_summary(cpu_flags())}")
    r.say("torch", f"{torch.__version__}, kernels for {torch.backends.cpu.get_cpu_capability()}, "
                   f"bf16 matmul {'native' if 'avx512_bf16' in cpu_flags() or 'amx_bf16' in cpu_flags() else 'emulated'}"
                   f", {threads} threads")


def check_llama(r: Report, model_path) -> bool:
    """The llama.cpp build and the probe's verdict on ``model_path``; -> whether the backend works."""
    import importlib.metadata as md

    from .models.llama_probe import probe_record
    from .models.llama_setup import cache_root

    try:
        version = md.version("llama_cpp_python")
    except md.PackageNotFoundError:
        r.problem("llama", "llama-cpp-python is not installed (`make setup` builds it)")
        return False
    works = cache_root() / "works"
    variant = works.read_text() if works.exists() else "not built by `make setup` here"
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    cpu = next((p.split("CPU :", 1)[1] for p in info.split("\n") if "CPU :" in p), info)
    on = [kv.split("=")[0].strip() for kv in cpu.split("|") if kv.strip().endswith("= 1")]
    r.say("llama", f"llama-cpp-python {version}, build {variant}; compiled for {' '.join(on)}")
    if model_path is None:
        r.say("probe", "skipped: no GGUF model pulled yet (`make models`)")
        return True
    rec = probe_record(model_path)
    if rec["extra_bufts"]:
        r.say("probe", f"{model_path.name}: default buffers {rec['default']}")
    elif rec["extra_bufts"] is False:
        r.say("probe", f"{model_path.name}: default buffers {rec['default']}; loads without extra buffer types "
                       f"({rec['fallback']}); `make setup` rebuilds llama.cpp without the feature that crashes")
    else:
        r.problem("probe", f"{model_path.name}: llama.cpp {rec['default']} (default buffers), {rec['fallback']} "
                           "(without extra buffer types): the llama backend is unusable here")
        return False
    return True


def check_models(r: Report) -> list[str]:
    from .models import catalog

    ready = [s["name"] for s in catalog.status() if s["dense"]]
    missing = [s["name"] for s in catalog.status() if not s["dense"]]
    r.say("models", (f"ready: {', '.join(ready)}" if ready else "none ready")
          + (f"; not pulled: {', '.join(missing)} (`make models`)" if missing else ""))
    return ready


# label: (suffix, backend); openvino is optional: a model it cannot convert is a note, not a problem
PATHS = {"hf bf16": ("", "hf"), "hf w8a8": (":w8a8", "hf"), "llama gguf": ("", "llama"), "openvino gguf": ("", "openvino")}


def measure_curves(r: Report, model: str, labels: list[str]) -> dict[str, dict[int, float]]:
    from .costs import measure_costs
    from .errors import SpecDraftError
    from .models.backends import load_model

    curves = {}
    r.say("costs", f"ms per forward of {' / '.join(map(str, TOKENS))} tokens, {model}, 60-token context "
                   "(ratio to one token)")
    for label in labels:
        suffix, b = PATHS[label]
        t0 = time.time()
        try:
            m = load_model(model + suffix, "bfloat16", backend=b)
            measure_costs(m, [1, 16], repeats=2)  # the first forwards of a process pay for kernel set-up
            c = measure_costs(m, list(TOKENS), repeats=3)
        except (SpecDraftError, RuntimeError, OSError) as e:
            (r.say if b == "openvino" else r.problem)("costs" if b != "openvino" else "", f"{label}: {e}")
            continue
        curves[label] = c
        r.say("", f"{label:11s} {c[1]:6.0f} ms | " + " | ".join(f"{c[n] / c[1]:.2f}x" for n in TOKENS[1:])
              + f"   ({time.time() - t0:.0f} s)")
        del m
    return curves


def recommend(r: Report, curves: dict[str, dict[int, float]]) -> None:
    """Read the pick off the measured curves: the fastest one-token backend for speed, and whether a
    step that scores 8 tokens is cheap enough there for speculation to pay on generic prompts."""
    if not curves:
        r.say("pick", "--backend hf (nothing was measured)")
        return
    fast = min(curves, key=lambda k: curves[k][1])
    c = curves[fast]
    r8 = c[8] / c[1]
    backend = {"llama gguf": "llama", "hf w8a8": "hf --target NAME:w8a8", "openvino gguf": "openvino"}.get(
        fast, "hf --dtype bfloat16")
    why = (f"its one-token forward is the cheapest here ({c[1]:.0f} ms); scoring 8 tokens costs {r8:.2f}x one, "
           + ("so a step must keep about that many tokens to pay: `auto` speculates where drafts are long "
              "(code edits, repeated text) and decodes plainly elsewhere" if r8 > 2 else
              "so speculation pays on most prompts"))
    r.say("pick", f"--backend {backend} --method auto: {why}")
    bf = curves.get("hf bf16")
    if bf and fast != "hf bf16":
        r.say("", f"full-precision answers: --backend hf --dtype bfloat16 --draft self:int4 (scoring 8 tokens "
                  f"costs {bf[8] / bf[1]:.2f}x one in bf16; its one token costs {bf[1] / c[1]:.1f}x {fast}'s)")
    ov = curves.get("openvino gguf")
    if ov and fast != "openvino gguf":
        r.say("", f"cheap verification at 4-bit bytes: --backend openvino (8 tokens cost {ov[8] / ov[1]:.2f}x one; its "
                  f"one token costs {ov[1] / c[1]:.1f}x {fast}'s): it pays where drafts are long (code edits)")
    w8 = curves.get("hf w8a8")
    if w8 and fast != "hf w8a8":
        r.say("", f"flat verification at 8-bit bytes: --backend hf --target NAME:w8a8 (8 tokens cost {w8[8] / w8[1]:.2f}x "
                  f"one; its one token costs {w8[1] / c[1]:.1f}x {fast}'s): it pays where drafts are long")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def add_parser(sub):
    """``specdraft doctor``'s flags (main_doctor's arguments)."""
    dr = sub.add_parser("doctor", help="start here: this CPU, what works on it, which backend and method to pick")
    dr.add_argument("--model", default=None, help="the model whose cost curves are measured (default: the Qwen "
                    "1.5B target if pulled, else SmolLM2)")
    dr.add_argument("--no-costs", action="store_true", help="skip the cost curves (a few seconds to a minute)")
    dr.add_argument("--threads", type=int, default=None)
    return dr


def main_doctor(model: str | None = None, costs: bool = True, threads: int | None = None) -> int:
    """``model``: the one whose cost curves are measured (default: the Qwen 1.5B target if pulled, else
    SmolLM2); ``costs`` False skips the curves."""
    from .models import catalog
    from .models.loading import set_threads

    threads = set_threads(threads)
    r = Report()
    print(f"specdraft doctor, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    check_cpu_and_torch(r, threads)
    ready = check_models(r)
    gguf = catalog.gguf_path("smollm2-135m") if "smollm2-135m" in ready else None
    llama_ok = check_llama(r, gguf)
    model = model or next((m for m in ("qwen2.5-coder-1.5b", "smollm2-135m") if m in ready), None)
    if costs and model:
        paths = ["hf bf16", "hf w8a8"] + (["llama gguf"] if llama_ok else []) + (["openvino gguf"] if _has("openvino") else [])
        recommend(r, measure_curves(r, model, paths))
    print(f"{'status':8s} " + ("ok" if not r.problems else f"{len(r.problems)} problem(s): " + "; ".join(r.problems)))
    return 1 if r.problems else 0
