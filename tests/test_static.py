"""Names that no test executes still have to exist: the GPU-only paths (CUDA-graph timers, capture code) run on no
CI machine, so an undefined name there shows up only on a lent GPU, as a silent fallback. pyflakes reads every
module of the library, the benchmarks and app.py and this test fails on any undefined name it finds."""
from __future__ import annotations

from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import messages, reporter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WHERE = ("tts_engine", "serving", "server", "ui", "bench", "app.py")
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(reporter.Reporter):
    def __init__(self):
        super().__init__(None, None)
        self.found = []

    def flake(self, message):
        if isinstance(message, UNDEFINED):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: syntax error: {msg}")

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")


def test_no_undefined_names():
    rep = _Collect()
    files = []
    for w in WHERE:
        p = ROOT / w
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    assert len(files) > 100
    for f in files:
        pyflakes_api.checkPath(str(f), rep)
    assert not rep.found, "\n".join(rep.found)


def test_the_check_finds_an_undefined_name(tmp_path):
    """The check itself: the very mistake it was written for (a closure naming its caller's argument)."""
    f = tmp_path / "m.py"
    f.write_text("def timer(fr):\n    def step():\n        return frame.predict()\n    return step\n")
    rep = _Collect()
    pyflakes_api.checkPath(str(f), rep)
    assert len(rep.found) == 1 and "frame" in rep.found[0]
