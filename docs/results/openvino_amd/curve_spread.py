import torch

from specdraft.models.backends import load_model
from specdraft.models.cost_curve import measure_costs

torch.set_num_threads(2)

m = load_model("qwen2.5-coder-1.5b:Q4_0", backend="openvino")
measure_costs(m, [1], repeats=1)
for rep in (2, 5):
    for _ in range(3):
        c = measure_costs(m, [1, 2, 4, 5, 8], context=60, repeats=rep)
        print(rep, {n: f"{v / c[1]:.2f}" for n, v in c.items()}, f"1 tok {c[1]:.0f} ms", flush=True)
