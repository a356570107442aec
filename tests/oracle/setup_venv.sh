#!/usr/bin/env bash
# Creates the oracle virtual environment (official qwen-tts 0.1.1 + transformers 4.57.3) at $1
# (default .venv-oracle). It shares torch, numpy, librosa... with the environment of the `python3` that runs
# this script (a virtual environment or the system Python): a .pth file puts that environment's site-packages
# after the oracle's own, so the oracle's pinned transformers/huggingface-hub win and everything else is shared.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-.venv-oracle}
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv --without-pip "$venv" 2>/dev/null || "$py" -m venv "$venv"
fi
# the running environment's package folders (purelib and platlib, plus user site where it is enabled)
"$py" - "$venv" <<'PY'
import site, sys, sysconfig, subprocess, pathlib
venv = pathlib.Path(sys.argv[1])
dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
if site.ENABLE_USER_SITE:
    dirs.append(site.getusersitepackages())
target = subprocess.check_output([str(venv / "bin" / "python"), "-c",
                                  "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
seen = []
for d in dirs:
    if d not in seen and pathlib.Path(d).is_dir():
        seen.append(d)
(pathlib.Path(target) / "_main_env.pth").write_text("\n".join(seen) + "\n")
PY
"$venv/bin/python" -m pip --version >/dev/null 2>&1 || "$venv/bin/python" -m ensurepip -q
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$here/requirements.txt"
"$venv/bin/python" -c "import sys; sys.path.insert(0, '$here/../..'); import tests.oracle.official" >/dev/null
echo "oracle venv ready: $venv"
