#!/bin/sh
# 2026-12-03, AMD EPYC (AVX-512, AVX512_BF16, AVX512_VNNI, no AMX), 2 threads: the openvino backend with token trees
# (commit c3e80b5) against every plain and speculative CPU decoder of the same file, one process, interleaved.
set -e
D=docs/results/openvino_trees_epyc
specdraft costs --backend openvino --target qwen2.5-coder-1.5b:Q4_0 --tokens 1,2,4,8,16 --threads 2 --repeats 5 --tree --json $D/costs_tree.json
specdraft bench --backend openvino --target qwen2.5-coder-1.5b:Q4_0 --config $D/variants.json \
  --methods plain,auto,suffix_k16,llama_cpp,llama_cpp@qwen2.5-coder-1.5b,ov_genai,ov_genai_lookup --llama-k 4 \
  --preset core18+code_edit --max-new-tokens 64 --threads 2 --reference llama_cpp --out $D/bench.json
# T=1 (seeded), the same prompts: fidelity Z of each sampled method
specdraft bench --backend openvino --target qwen2.5-coder-1.5b:Q4_0 --config $D/variants.json \
  --methods plain,auto,suffix_k16,llama_cpp,ov_genai_lookup --llama-k 4 \
  --preset core18+code_edit --max-new-tokens 64 --threads 2 --temperature 1.0 --seed 0 --reference llama_cpp --out $D/bench_t1.json
