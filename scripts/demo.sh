#!/usr/bin/env bash
# The main job: a local cluster (embedded Redis, a coordinator, 4 workers on 127.0.0.1)
# trains the tiny GPT on the Python standard library's sources with the pipefb schedule.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pipefb local train --model gpt --dataset text --loss cross_entropy \
  --schedule pipefb --workers 4 --batch-size 16 --microbatches 4 --steps 60 \
  --optimizer adamw --lr 3e-3 --seed 0 --eval-every 20 --out runs/demo "$@"
