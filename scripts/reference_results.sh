#!/usr/bin/env bash
# Regenerate the committed reference results in results/ from a real sweep of the embedded models.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf results/reference-cpu
python3 -m kveval sweep configs/reference-cpu.yaml --out results/reference-cpu --quiet
