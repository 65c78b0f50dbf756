#!/usr/bin/env bash
# EAGLE-3 head for Qwen2.5-Coder-1.5B (its Q4_0 copy on llama.cpp), continued from the token ids in the
# repository: data/eagle3/qwen2.5-coder-1.5b/ holds the prompts the target wrote (synth.jsonl), its answers
# as token ids (answers.jsonl) and the settings they were made with (meta.json). A machine without
# them under $SPECDRAFT_HOME gets them copied there; `train eagle3` then recomputes their features with a
# batched prefill (no answer is generated again), writes and answers more prompts up to --synth, and trains.
#
#   scripts/eagle3_qwen.sh data            # more data only (append; safe to kill at any moment, rerun resumes)
#   scripts/eagle3_qwen.sh train STEPS     # train on the data as it is (resumes from DIR/train_state.pt)
#
# Run it detached for long runs: setsid nohup scripts/eagle3_qwen.sh data > eagle3_data.log 2>&1 &
# THREADS (default: all cores) sets the threads; SYNTH (default 6000) the number of prompts to reach.
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${SPECDRAFT_HOME:-$HOME/.cache/specdraft}
OUT=$HOME_DIR/eagle3/qwen2.5-coder-1.5b
SEED_DIR=data/eagle3/qwen2.5-coder-1.5b
PY=.venv/bin/python
THREADS=${THREADS:-$(nproc)}

if [ ! -f "$OUT/data/answers.jsonl" ]; then
  mkdir -p "$OUT/data"
  cp "$SEED_DIR/meta.json" "$OUT/data/meta.json"
  gunzip -c "$SEED_DIR/synth.jsonl.gz" > "$OUT/data/synth.jsonl"
  gunzip -c "$SEED_DIR/answers.jsonl.gz" > "$OUT/data/answers.jsonl"
  echo "eagle3: the committed token ids copied to $OUT/data"
fi
"$PY" -m specdraft.cli models quantize qwen2.5-coder-1.5b --type Q4_0 > /dev/null
COMMON=(train eagle3 --target qwen2.5-coder-1.5b:Q4_0 --gen-backend llama -o "$OUT" --threads "$THREADS" --seed 0)
case "${1:-}" in
  data)
    # a long context for 16 rows of up to 384 new tokens after prompts of up to a few hundred
    SPECDRAFT_LLAMA_CTX=${SPECDRAFT_LLAMA_CTX:-8192} exec "$PY" -m specdraft.cli "${COMMON[@]}" --data-only \
      --synth "${SYNTH:-6000}" --synth-max-tokens 96 --max-new-tokens 384 --gen-batch 16 ;;
  train)
    RESUME=(); [ -f "$OUT/train_state.pt" ] && RESUME=(--resume)
    exec "$PY" -m specdraft.cli "${COMMON[@]}" --train-only --steps "${2:?STEPS}" \
      --checkpoint-every 50 "${RESUME[@]}" ;;
  *) echo "usage: $0 data | train STEPS" >&2; exit 2 ;;
esac
