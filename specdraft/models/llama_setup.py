"""``make setup``'s llama.cpp step: build llama-cpp-python for this CPU and prove it decodes here.

No binary wheel of the pinned version exists for Linux x86_64, so it is built from source for this
CPU and cached under ``$SPECDRAFT_HOME/llama-wheels/<pin and CPU flags>/<variant>/``. A build is
installed only after the probe (llama_probe.py, a child process) decoded batches of 1, 2, 8 and 32
tokens on SmolLM2 with it. If the child dies, the next variant is built, without the feature that
killed it, AMX first:

- ``native``: GGML_NATIVE (everything this CPU has);
- ``amx-clang``: on AMX CPUs where clang is installed: clang, every feature named, ggml's AMX kernels
  (GCC 12 miscompiles their tile configuration: see AMX_MACROS);
- ``no-amx``: every feature of this CPU named explicitly, AMX off (ggml's AMX buffers segfault on
  batches of 2+ tokens with 0.3.36 on an Intel Xeon with AMX);
- ``no-avx512``: AVX2 kernels only.

The variant that worked is recorded beside the wheels, so the next setup on this CPU goes straight to
it; the installed one is recorded in the venv, so a later ``make setup`` with nothing new does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..core.extras import needs_extra
from .llama_probe import cpu_flags, probe_record

# (variant, CPU flags it needs to be worth trying, feature groups turned off: None = GGML_NATIVE)
VARIANTS = [
    ("native", (), None),
    ("amx-clang", ("amx_int8",), set()),
    ("no-amx", ("amx_tile",), {"amx"}),
    ("no-avx512", ("avx512f",), {"amx", "avx512"}),
]
# GCC 12's _tile_loadconfig declares an 8-byte read of the 64-byte tile config, so the optimizer may drop
# ggml's stores to the rest of it and ldtilecfg faults (docs/benchmark-log.md). clang compiles it right but
# spells the macro __AMXINT8__ where ggml tests __AMX_INT8__: the amx-clang variant defines ggml's names.
AMX_MACROS = "-D__AMX_INT8__=1 -D__AMX_TILE__=1"
CMAKE_OPTION = {
    "avx": "AVX",
    "avx2": "AVX2",
    "avx_vnni": "AVX_VNNI",
    "fma": "FMA",
    "f16c": "F16C",
    "bmi2": "BMI2",
    "avx512f": "AVX512",
    "avx512vbmi": "AVX512_VBMI",
    "avx512_vnni": "AVX512_VNNI",
    "avx512_bf16": "AVX512_BF16",
    "amx_tile": "AMX_TILE",
    "amx_int8": "AMX_INT8",
    "amx_bf16": "AMX_BF16",
}
BUILD_MINUTES = 6  # measured on 2 cores (4.5-6 min)


def pin() -> str:
    req = Path(__file__).resolve().parents[2] / "requirements-llama.txt"
    return next(ln.replace(" ", "") for ln in req.read_text().splitlines() if ln.startswith("llama-cpp-python"))


def cmake_args(off: set[str] | None) -> str:
    """GGML_NATIVE for the native variant; otherwise each feature of this CPU on, those in ``off`` off."""
    # LLAVA_BUILD: llama-cpp-python's multimodal library (mtmd), which nothing here loads: a tenth of the build
    base = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF"
    if off is None:
        return f"-DGGML_NATIVE=ON {base}"
    have, off_prefixes = set(cpu_flags()), tuple(off)
    opts = [
        f"-DGGML_{opt}={'ON' if flag in have and not flag.startswith(off_prefixes) else 'OFF'}"
        for flag, opt in CMAKE_OPTION.items()
    ]
    return " ".join(["-DGGML_NATIVE=OFF", *opts, base])


def build_wheel(variant: str, off: set[str] | None, out: Path) -> Path:
    """Build the pinned sdist into ``out`` (minutes), printing progress with an ETA meanwhile."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CMAKE_ARGS": cmake_args(off), "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    if variant == "amx-clang":
        env.update(CC="clang", CXX="clang++", CFLAGS=AMX_MACROS, CXXFLAGS=AMX_MACROS)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir", "-w", str(out), pin()]
    log = out / "build.log"
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        print(
            f"[specdraft] building {pin()} for this CPU ({variant}), about {BUILD_MINUTES} min on 2 cores",
            file=sys.stderr,
        )
        while True:
            try:
                p.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                el = time.time() - t0
                print(
                    f"[specdraft]   {el / 60:.1f} min, about {max(BUILD_MINUTES - el / 60, 0.5):.0f} min left",
                    file=sys.stderr,
                )
    if p.returncode != 0:
        sys.exit(f"error: building {pin()} ({variant}) failed; see {log}")
    return next(out.glob("llama_cpp_python-*.whl"))


def install(wheel: Path) -> None:
    """Replace whatever build is installed by ``wheel`` (its dependencies too, where missing)."""
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "uninstall", "-q", "-y", "llama-cpp-python"], check=True, capture_output=True)
    subprocess.run([*pip, "install", "-q", str(wheel)], check=True)


def cache_root() -> Path:
    from .catalog import home

    key = hashlib.sha256(f"{pin()} {' '.join(cpu_flags())} {cmake_args(set())}".encode()).hexdigest()[:16]
    return home() / "llama-wheels" / key


def probe_model() -> Path:
    from .catalog import pull

    return pull("smollm2-135m", convert=False)


def viable(name: str, needs: tuple, have: set[str]) -> bool:
    """Worth building here: the CPU has what the variant is for (and clang is installed for amx-clang)."""
    return set(needs) <= have and (name != "amx-clang" or shutil.which("clang++") is not None)


def next_try(variant: str, have: set[str]) -> str:
    """What the variant after ``variant`` changes, in words, for the one line setup prints."""
    names = [v[0] for v in VARIANTS]
    for name, needs, _ in VARIANTS[names.index(variant) + 1 :]:
        if viable(name, needs, have):
            return {
                "amx-clang": "with clang and ggml's AMX kernels",
                "no-amx": "without AMX",
                "no-avx512": "without AVX-512",
            }[name]
    return "none left"


def setup(venv_marker: Path, build=build_wheel, install=install, probe_model=probe_model) -> str:
    """Install a llama.cpp build that decodes multi-token batches here; -> the variant installed."""
    root = cache_root()
    chosen = root / "works"
    if venv_marker.exists() and chosen.exists() and venv_marker.read_text() == chosen.read_text():
        return chosen.read_text()
    have = set(cpu_flags())
    start = chosen.read_text() if chosen.exists() else "native"
    names = [v[0] for v in VARIANTS]
    model = None
    for variant, needs, off in VARIANTS[names.index(start) :]:
        if not viable(variant, needs, have):
            continue
        wheels = sorted((root / variant).glob("llama_cpp_python-*.whl"))
        install(wheels[0] if wheels else build(variant, off, root / variant))
        model = model or probe_model()
        rec = probe_record(model, fresh=True)
        if rec["extra_bufts"]:
            chosen.write_text(variant)
            venv_marker.write_text(variant)
            print(f"[specdraft] llama.cpp ({variant} build) {rec['default']} on SmolLM2", file=sys.stderr)
            return variant
        if not rec["crashed"]:
            sys.exit(f"error: llama.cpp's {variant} build does not run here (a probe {rec['default']}); see above")
        print(
            f"[specdraft] llama.cpp's {variant} build crashed on this CPU (a probe {rec['default']}); "
            f"trying the next build ({next_try(variant, have)})",
            file=sys.stderr,
        )
    sys.exit(
        "error: no llama.cpp build decodes multi-token batches on this CPU; the llama backend is unavailable "
        "(--backend hf works); the probe's outcomes are under " + str(root)
    )


def build_variant(works) -> str:
    """The llama.cpp variant `make setup` installed, from its marker file (or what is wrong with the marker)."""
    if not works.exists():
        return "not built by `make setup` here"
    try:
        name = works.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        name = None
    return name if name in [v[0] for v in VARIANTS] else f"unknown ({works} names no variant; `make setup` rewrites it)"


def check_build(r) -> bool:
    """``specdraft doctor``'s lines on llama.cpp (``r``: its report): the build and the probe's verdict on
    SmolLM2's GGUF file when it is pulled; -> whether the backend works here."""
    import importlib.metadata as md

    from .catalog import gguf_path, status

    ready = [s["name"] for s in status() if s["gguf"]]
    model_path = gguf_path("smollm2-135m") if "smollm2-135m" in ready else None
    try:
        version = md.version("llama_cpp_python")
    except md.PackageNotFoundError:
        r.problem("llama", needs_extra("the llama backend", "llama"))
        return False
    variant = build_variant(cache_root() / "works")
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
        r.say(
            "probe",
            f"{model_path.name}: default buffers {rec['default']}; loads without extra buffer types "
            f"({rec['fallback']}); `make setup` rebuilds llama.cpp without the feature that crashes",
        )
    else:
        r.problem(
            "probe",
            f"{model_path.name}: llama.cpp {rec['default']} (default buffers), {rec['fallback']} "
            "(without extra buffer types): the llama backend is unusable here",
        )
        return False
    return True


def prebuild() -> None:
    """Build the first variant worth trying here into the cache, unless a wheel of it is there or a variant
    was chosen already; nothing installed or probed. ``make setup`` runs it beside pip's install of the other
    requirements (it needs only the standard library and pip), so the two overlap."""
    root = cache_root()
    if (root / "works").exists():
        return
    have = set(cpu_flags())
    variant, _, off = next(v for v in VARIANTS if viable(v[0], v[1], have))
    if not any((root / variant).glob("llama_cpp_python-*.whl")):
        build_wheel(variant, off, root / variant)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("venv", nargs="?", default=".venv")
    ap.add_argument("--build-only", action="store_true", help="build the wheel into the cache; install nothing")
    a = ap.parse_args(argv)
    if a.build_only:
        prebuild()
        return 0
    setup(Path(a.venv) / ".specdraft-llama")
    return 0


if __name__ == "__main__":
    sys.exit(main())
