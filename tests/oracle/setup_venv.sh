#!/usr/bin/env bash
# Creates the oracle virtual environment (official qwen-tts 0.1.1 + transformers 4.57.3) at $1
# (default .venv-oracle). It shares torch, numpy, librosa... with the main environment.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-.venv-oracle}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
fi
"$venv/bin/pip" install -q --no-deps -r "$here/requirements.txt"
"$venv/bin/python" -c "import sys; sys.path.insert(0, '$here/../..'); import tests.oracle.official" >/dev/null
echo "oracle venv ready: $venv"
