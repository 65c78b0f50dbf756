#!/usr/bin/env bash
# The "engine chooses how to draft" tables of docs/benchmark-log.md: Qwen2.5-Coder 1.5B + 0.5B,
# core18 + code_edit (27 prompts), greedy and T=1 on the llama.cpp backend, greedy on transformers bf16.
# Run from the repo root after `make models`. autotune first: `auto` reads the file it writes (per target,
# draft, backend, dtype and CPU); auto_online ignores it. Each bench resumes its --out.
set -euo pipefail
S=".venv/bin/python -m specdraft.cli"
mkdir -p results/auto
$S autotune --backend llama --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --max-new-tokens 64 \
  -o results/auto/autotune_llama.json
$S autotune --backend hf --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --max-new-tokens 48 --n 6 \
  --only prompt_lookup,suffix,draft_model,hybrid,cascade -o results/auto/autotune_hf.json
L="$S bench --backend llama --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --config docs/configs/auto_llama.json \
  --preset core18+code_edit --max-new-tokens 64"
$L --methods plain,llama_cpp,prompt_lookup_ca,suffix_ca,draft_model_k4,hybrid,cascade,auto_online,auto \
  --out results/auto/llama_greedy.json
# auto and auto_online again after exploration became budgeted in cost-curve seconds (the run above had one
# try of another arm in 16 steps, whatever it cost)
$L --methods plain,prompt_lookup_ca,auto_online,auto --out results/auto/llama_greedy_auto.json
$L --methods plain,prompt_lookup_ca,hybrid,auto_online,auto --temperature 1 --out results/auto/llama_t1.json
# the hf config + the tree autotune's search chose on this machine
.venv/bin/python - <<'PY'
import json
cfg = json.load(open("docs/configs/auto_hf.json"))
cfg["variants"]["searched_tree"] = json.load(open("results/auto/autotune_hf.json"))["tree"]["spec"]
json.dump(cfg, open("results/auto/auto_hf_with_tree.json", "w"), indent=1)
PY
H="$S bench --backend hf --dtype bfloat16 --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --config results/auto/auto_hf_with_tree.json --preset core18+code_edit --max-new-tokens 48"
$H --methods plain,prompt_lookup_ca,draft_model_k3,static_2-1-1,searched_tree,hybrid,auto \
  --out results/auto/hf_greedy.json
# the tree search again after it learned depth-conditional acceptance (autotune's _tree_search on its default
# calibration prompts), then that tree against the hand-written one
.venv/bin/python - <<'PY'
import argparse, json
from specdraft.api import SpecDecoder
from specdraft.commands.autotune import _prompts, _tree_search
from specdraft import prompts as data
from specdraft.core.config import SamplingParams
rows = _prompts(argparse.Namespace(prompts=None, n=6), data)
dec = SpecDecoder.load("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", dtype="bfloat16")
tree = _tree_search(dec, [dec.encode(r["prompt"], chat=True) for r in rows], SamplingParams(max_new_tokens=48))
json.dump(tree, open("results/auto/tree_hf2.json", "w"), indent=1)
cfg = json.load(open("docs/configs/auto_hf.json"))
cfg["variants"]["searched_tree"] = tree["spec"]
json.dump(cfg, open("results/auto/auto_hf2.json", "w"), indent=1)
PY
$S bench --backend hf --dtype bfloat16 --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --config results/auto/auto_hf2.json --preset core18+code_edit --max-new-tokens 48 \
  --methods plain,static_2-1-1,searched_tree --out results/auto/hf_tree2.json
# auto without a file on hf (its default arms include the hybrid), next to the hybrid
$S bench --backend hf --dtype bfloat16 --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --config docs/configs/auto_hf.json --preset core18+code_edit --max-new-tokens 48 \
  --methods plain,hybrid,auto_online --out results/auto/hf_auto_online.json
