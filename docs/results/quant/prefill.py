"""Per-matrix cost of one Qwen 1.5B MLP matrix (1536 -> 8960) by rows: bf16, the int8 / int4 kernels,
and the prefill path (dequantize, then one bf16 matmul). Run: python docs/results/quant/prefill.py"""

import time

import torch
from torch import nn

from specdraft.bench.costs import cpu_name
from specdraft.models.lowbit import Int4Linear, Int8Linear

torch.set_num_threads(2)
torch.manual_seed(0)
lin = nn.Linear(1536, 8960, bias=False).to(torch.bfloat16)
q8, q4 = Int8Linear(lin), Int4Linear(lin, 128)


def ms(f, x, n=10):
    with torch.no_grad():
        f(x)
        t = time.perf_counter()
        for _ in range(n):
            f(x)
    return 1000 * (time.perf_counter() - t) / n


ways = {
    "bf16": lambda x: lin(x),
    "int8 kernel": lambda x: torch.ops.aten._weight_int8pack_mm(x, q8.qweight, q8.scales),
    "int8 dequantize + bf16": lambda x: x @ (q8.qweight.to(x.dtype) * q8.scales[:, None]).t(),
    "int4 kernel": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4.qweight, 128, q4.scales_zeros),
    "int4 dequantize + bf16": lambda x: x @ q4.weight.t(),
}
rows = [1, 4, 16, 32, 64, 256, 1024]
print(f"{cpu_name()}, 2 threads, ms per 1536x8960 matmul")
print("| way | " + " | ".join(f"{r} rows" for r in rows) + " |")
print("|---" * (len(rows) + 1) + "|")
for name, f in ways.items():
    print(f"| {name} | " + " | ".join(f"{ms(f, torch.randn(r, 1536, dtype=torch.bfloat16)):.2f}" for r in rows) + " |")
