#!/usr/bin/env bash
# The soak figures of docs/server.md: SmolLM2-135M fp32 batch server (draft: its first 4 layers), mixed
# load at 16, 32 and 64 clients (64 requests each), then 1,000 random disconnects. About 10 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PORT=${PORT:-8011}
.venv/bin/specdraft serve --target smollm2-135m --dtype float32 --draft smollm2-135m --draft-layers 4 \
  --method prompt_lookup --max-batch 16 --max-queue 128 --port $PORT &
SERVER=$!
trap 'kill -TERM $SERVER; wait $SERVER' EXIT
until curl -sf http://127.0.0.1:$PORT/health > /dev/null; do sleep 1; done
.venv/bin/specdraft loadtest --url http://127.0.0.1:$PORT --soak --concurrency 16,32,64 --requests 64 \
  --disconnects 1000 --soak-methods prompt_lookup,plain,draft_model --timeout 600 --out docs/results/soak/soak.json
