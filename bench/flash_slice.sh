#!/usr/bin/env bash
# The issue-5 benchmark set on one GPU machine: make the flash-slice checkpoint, then dsv4rt bench
# decode / prefill / serve and bench/vs_transformers.py on it. Results: JSON and logs in $1 (default
# bench/results). Run from the repository root: bash bench/flash_slice.sh [OUT_DIR] [MODEL_DIR]
set -uo pipefail
out=${1:-bench/results}
model=${2:-/tmp/flash-slice}
mkdir -p "$out"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }
[ -d "$model" ] || python3 -m dsv4rt make-tiny "$model" --preset flash-slice
stamp "model ready"
python3 -m dsv4rt bench decode --model "$model" --batch 1,8,32,64 --context 4096,65536,1048576 --reps 30 \
    --json "$out/decode.json"
stamp "decode"
python3 -m dsv4rt bench prefill --model "$model" --tokens 8192,65536 --json "$out/prefill.json"
stamp "prefill"
python3 -m dsv4rt bench serve --model "$model" --requests 64 --prompt-len 64,2048 --output-len 16,128 \
    --json "$out/serve.json"
stamp "serve"
python3 bench/vs_transformers.py "$model" --context 4096 --steps 16 --agree-tokens 256
cp bench/results/vs_transformers.json "$out/" 2>/dev/null
stamp "vs transformers"
