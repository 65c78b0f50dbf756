"""Does this llama.cpp build decode multi-token batches on this CPU? Asked in a child process.

Some builds die on some CPUs: llama-cpp-python 0.3.36 built with GGML_NATIVE on an Intel Xeon with
AMX decodes a 1-token batch and segfaults on any batch of 2 or more (its AMX "extra buffer type"
holds the weights). A crash inside the engine would take a server down with every request in it, so
the first load of a model on a (llama.cpp build, CPU) pair decodes batches of ``SIZES`` tokens in a
child process first, with the default buffers and, if those crash, without the extra buffer types;
the outcome is kept under ``$SPECDRAFT_HOME/llama-probe/`` and later loads read it.

The child is this file run as a script (``python llama_probe.py MODEL.gguf 1``): it imports
llama_cpp and nothing of specdraft, so a crash costs a second, not a package import.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SIZES = (1, 2, 8, 32)
GGUF_MAGIC = b"GGUF"  # the first bytes of every GGUF file
CRASH_HOOK = "SPECDRAFT_LLAMA_PROBE_CRASH"  # tests: "extra" kills the child when extra buffers are on, "all" always
CPU_FLAGS = (
    "avx",
    "avx2",
    "avx_vnni",
    "fma",
    "f16c",
    "bmi2",
    "avx512f",
    "avx512vbmi",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)  # what a llama.cpp build can be compiled for


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # "decoded batches of 1, 2, 8, 32 tokens" or how the child died
    crashed: bool = False  # killed by a signal or hung: the build, not the install, is at fault


def cpu_flags() -> list[str]:
    """This CPU's flags among those llama.cpp builds for (the build and the probe cache depend on them)."""
    try:
        line = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    have = set(line.split(":", 1)[1].split())
    return [f for f in CPU_FLAGS if f in have]


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512_BF16 or AMX): there bf16 halves a small
    model's memory traffic at no cost in speed, elsewhere it is emulated and slower than float32."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))


def build_id() -> str | None:
    """Which llama.cpp build is installed: its shared libraries' names, sizes and times, and the CPU."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = sorted(Path(spec.submodule_search_locations[0]).glob("lib/*.so*"))
    parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in libs] + cpu_flags()
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    from .catalog import home  # the parent's only: the child runs this file as a script

    return home() / "llama-probe"


# --- the child ---------------------------------------------------------------------------------
def _child(path: str, extra_bufts: bool) -> int:
    """Load ``path`` and decode one batch of each size (ids 100.., positions 0..n-1, logits on the
    last); print each size before decoding it, so the parent knows which one killed us."""
    import llama_cpp as ll

    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    mp.use_extra_bufts = extra_bufts
    model = ll.llama_model_load_from_file(path.encode(), mp)
    if not model:
        print(f"could not load {path}", file=sys.stderr)
        return 3
    cp = ll.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 64, 64
    cp.n_threads = cp.n_threads_batch = 2
    ctx = ll.llama_init_from_model(model, cp)
    batch = ll.llama_batch_init(max(SIZES), 0, 1)
    hook = os.environ.get(CRASH_HOOK, "")
    for n in SIZES:
        print(n, flush=True)
        if n > 1 and (hook == "all" or (hook == "extra" and extra_bufts)):
            os.kill(os.getpid(), signal.SIGSEGV)
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        batch.n_tokens = n
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = 100 + i, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == n - 1
        if ll.llama_decode(ctx, batch) != 0:
            print(f"llama_decode of {n} tokens returned an error", file=sys.stderr)
            return 4
    return 0


# --- the parent --------------------------------------------------------------------------------
def run_probe(path: str | Path, extra_bufts: bool, timeout: float = 600) -> ProbeResult:
    """Run the child on ``path``; never raises for a crash, returns how it went."""
    cmd = [sys.executable, str(Path(__file__).resolve()), str(path), str(int(extra_bufts))]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ProbeResult(False, f"no answer within {timeout:.0f} s", crashed=True)
    sizes = [ln for ln in p.stdout.split() if ln.isdigit()]
    if p.returncode == 0:
        return ProbeResult(True, f"decoded batches of {', '.join(map(str, SIZES))} tokens")
    at = f" at a batch of {sizes[-1]} tokens" if sizes else " before decoding"
    if p.returncode < 0:
        return ProbeResult(False, f"killed by {signal.Signals(-p.returncode).name}{at}", crashed=True)
    last = (p.stderr.strip().splitlines() or ["no message"])[-1]
    return ProbeResult(False, f"exited with status {p.returncode}{at}: {last}")


def is_gguf(path: Path) -> bool:
    """Whether ``path`` starts with the GGUF magic (a file llama.cpp could parse at all)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def _key(path: Path) -> str:
    st = path.stat()
    return f"{path.name}:{st.st_size}"


def _seen(file: Path) -> dict:
    """The kept verdicts, {"NAME:SIZE": probe_record's dict}; a cache, so a bad file is said and probed again.
    (Imported here: this module also runs as the child script, outside the package.)"""
    from ..core import homefiles as h

    verdict = h.obj(
        {"extra_bufts": h.nullable(h.BOOL), "crashed": h.BOOL, "default": h.TEXT, "fallback": h.nullable(h.TEXT)},
        required=("extra_bufts", "crashed", "default", "fallback"),
    )
    try:
        return h.read_json(file, h.obj({}, keys=h.TEXT, values=verdict), "the llama.cpp probe record") or {}
    except h.HomeFileError as e:
        print(f"warning: {e}; probing again", file=sys.stderr)
        return {}


def probe_record(path: str | Path, fresh: bool = False) -> dict:
    """The probe's verdict for this model on this build and CPU, cached: {"extra_bufts": True (the
    default buffers work) | False (only without the extra buffer types) | None (neither),
    "crashed": whether the default buffers' child died of a signal, "default": detail,
    "fallback": detail or None}. Only what says something about the build is kept: a child that decoded
    or died of a signal, never one that could not load the file (that is the file's fault)."""
    from ..core.errors import ModelFileError

    path = Path(path)
    if not is_gguf(path):  # nothing to probe: llama.cpp would refuse it on any build
        raise ModelFileError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    bid = build_id()
    file = cache_dir() / f"{bid}.json"
    seen = _seen(file)
    if not fresh and _key(path) in seen:
        return seen[_key(path)]
    default = run_probe(path, True)
    fallback = None if default.ok else run_probe(path, False)
    rec = {
        "extra_bufts": True if default.ok else (False if fallback.ok else None),
        "crashed": default.crashed,
        "default": default.detail,
        "fallback": fallback and fallback.detail,
    }
    if not (default.ok or default.crashed):
        return rec
    seen[_key(path)] = rec
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(seen, indent=1))
    os.replace(tmp, file)
    return rec


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2] == "1"))
