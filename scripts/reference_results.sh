#!/usr/bin/env bash
# Regenerate the committed reference results in results/ from real sweeps of the embedded models.
set -euo pipefail
cd "$(dirname "$0")/.."
for model in smollm2 gemma3; do
  rm -rf "results/reference-$model"
  python3 -m kveval sweep "configs/reference-$model.yaml" --out "results/reference-$model" --quiet
done
