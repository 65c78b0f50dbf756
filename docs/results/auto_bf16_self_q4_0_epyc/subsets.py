"""Speedups of a bench run on the core18 and code_edit subsets (tokens / wall over the reference's)."""

import json
import sys

recs = json.load(open(sys.argv[1]))["records"]
ref = sys.argv[2] if len(sys.argv) > 2 else "llama_cpp"
edits = {"code_edit", "text_edit"}
for name, keep in (("core18", lambda t: t not in edits), ("code_edit", lambda t: t in edits), ("all", lambda t: True)):
    tot = {}
    for r in recs:
        if keep(r["task"]):
            t = tot.setdefault(r["method"], [0, 0.0])
            t[0] += r["new_tokens"]
            t[1] += r["wall_s"]
    base = tot[ref][0] / tot[ref][1]
    plain = tot["plain"][0] / tot["plain"][1]
    print(
        name,
        "  ".join(
            f"{m}: {n / w:.2f} tok/s {n / w / base:.2f}x {ref}, {n / w / plain:.2f}x plain" for m, (n, w) in tot.items()
        ),
    )
