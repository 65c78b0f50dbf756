"""The 196 linear layers of Qwen2.5 1.5B (28 x q, k, v, o, gate, up, down; random weights, no LM head)
through oneDNN's int8 matmul (what lowbit.W8A8Linear calls), signed vs unsigned inputs, 1-16 rows:
ms for one pass over all of them (min of 3), 2 threads. `.venv/bin/python docs/results/w8a8/onednn_linears.py`"""

import time

import torch

torch.set_num_threads(2)
SHAPES = [(1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536), (1536, 8960)]
layers = []
for _ in range(28):
    for o, i in SHAPES:
        w = torch.randn(o, i) * 0.02
        s = w.abs().amax(1) / 127
        q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        layers.append((torch.ops.onednn.qlinear_prepack(q, [1, i]), s, torch.zeros(o, dtype=torch.long), i))


def one_pass(xs: dict, signed: bool) -> None:
    for packed, s, z, i in layers:
        q = torch.round(xs[i] * 20).clamp(-127, 127)
        xq, zp = (q.to(torch.int8), 0) if signed else (q.add(128).to(torch.uint8), 128)
        torch.ops.onednn.qlinear_pointwise(xq, 1.0, zp, packed, s, z, None, 1.0, 0, torch.float32, "none", [], "")


print(f"GB of int8 weights: {sum(p[1].numel() * p[3] for p in layers) / 1e9:.2f}")
for signed in (False, True):
    row = []
    for m in (1, 2, 4, 8, 16):
        xs = {1536: torch.randn(m, 1536), 8960: torch.randn(m, 8960)}
        one_pass(xs, signed)
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            one_pass(xs, signed)
            ts.append(time.perf_counter() - t0)
        row.append(f"{m} rows {1000 * min(ts):.0f} ms")
    print("int8 inputs" if signed else "uint8 inputs", " | ".join(row), flush=True)
