#!/usr/bin/env bash
# Run every recording benchmark on a GPU and write the CSVs to $1 (default: the
# package's results folder). Used with the device machine as
#   bash benchmarks/run_all.sh "$OUT"
set -euo pipefail
out="${1:-llmnote/data/results}"
export PYTHONUNBUFFERED=1
for b in "${@:2}"; do python3 "benchmarks/$b.py" --out "$out"; done
