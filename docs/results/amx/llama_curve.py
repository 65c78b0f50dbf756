"""ms per llama_decode of n tokens after a 60-token context (median of 5 after one warm-up), straight on
llama-cpp-python, so that differently built wheels can be compared in their own venvs:

    VENV/bin/python docs/results/amx/llama_curve.py MODEL.gguf 1 1,2,4,8,16   # 1: extra buffer types on

Used for the AMX table of docs/benchmark-log.md (2026-12-02); `specdraft costs --backend llama` measures the
same through the engine's interface, with the installed build.
"""

import os
import statistics
import sys
import time

import llama_cpp as ll

path = sys.argv[1]
extra = sys.argv[2] == "1"
ns = [int(x) for x in sys.argv[3].split(",")]
ll.llama_backend_init()
cb = ll.llama_log_callback(lambda *a: None)
ll.llama_log_set(cb, None)
mp = ll.llama_model_default_params()
mp.use_extra_bufts = extra
m = ll.llama_model_load_from_file(path.encode(), mp)
cp = ll.llama_context_default_params()
cp.n_ctx = 1024
cp.n_batch = cp.n_ubatch = 512
cp.n_threads = cp.n_threads_batch = 2
cp.no_perf = True
ctx = ll.llama_init_from_model(m, cp)
mem = ll.llama_get_memory(ctx)
b = ll.llama_batch_init(512, 0, 1)


def feed(toks, start):
    b.n_tokens = len(toks)
    for i, t in enumerate(toks):
        b.token[i], b.pos[i], b.n_seq_id[i] = t, start + i, 1
        b.seq_id[i][0] = 0
        b.logits[i] = 1
    assert ll.llama_decode(ctx, b) == 0


feed(list(range(100, 160)), 0)
out = {}
for n in ns:
    ts = []
    for r in range(6):
        t0 = time.perf_counter()
        feed(list(range(200, 200 + n)), 60)
        dt = time.perf_counter() - t0
        ll.llama_memory_seq_rm(mem, 0, 60, -1)
        if r:
            ts.append(dt)
    out[n] = 1000 * statistics.median(ts)
t1 = out[ns[0]]
print(
    os.path.basename(path),
    "extra" if extra else "plain-bufs",
    " | ".join(f"{n}:{out[n]:.0f}ms({out[n] / t1:.2f}x)" for n in ns),
)
