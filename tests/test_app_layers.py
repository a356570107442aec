"""The rooms above the engine keep to their layers (an AST scan of the imports and attribute reads):

- `ui/` (the page, and app.py that starts it) uses `tts_engine`'s public API (the names of `tts_engine.__all__` and
  the modules of `tts_engine.PUBLIC_MODULES`) and `serving/`; of `server/` only `server.openai_api.install`, in
  `ui/server.py`, which mounts the speech API beside the page on one FastAPI app.
- `server/` is HTTP only (FastAPI routes, request parsing, response encoding): web and audio-encoding libraries, the
  public `tts_engine` API and `serving/` for the rest; no torch, no Gradio, nothing of the page.
- `serving/` (what the page and the API share) uses `tts_engine`'s public API too, and imports neither of them.
- None of them reads an engine's private or internal attributes (`engine._x`, `engine.model`, `engine.runner`, ...).
- None of the three imports `bench/` or `tests/`.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import tts_engine

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = {"tts_engine", "serving", "server", "ui", "bench", "tests", "app"}
# where an HTTP handler may need more than the standard library: the web framework, and audio encoding
SERVER_THIRD_PARTY = {"fastapi", "starlette", "pydantic", "numpy", "soundfile"}
# an engine's internals: what it is made of, not what it offers
ENGINE_INTERNALS = {"model", "runner", "worker", "scheduler", "config", "reference_cache"}
UI_MAY_USE_SERVER = {("ui/server.py", "server.openai_api", "install")}


def _files(room: str) -> list[Path]:
    """The room's modules; the page's room includes app.py, the entry point that starts it."""
    return sorted((ROOT / room).glob("*.py")) + ([ROOT / "app.py"] if room == "ui" else [])


def imports(source: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every absolute import: `import a.b` -> ("a.b", None), `from a import b, c`
    -> ("a", "b"), ("a", "c")."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out += [(node.lineno, node.module, a.name) for a in node.names]
    return out


def public_engine_import(module: str, name: str | None) -> bool:
    """True for `import tts_engine`, `from tts_engine import <public name>`, and the modules of
    `tts_engine.PUBLIC_MODULES` (imported, imported from, or named by `from <package> import <module>`)."""
    if name is not None and f"{module}.{name}" in tts_engine.PUBLIC_MODULES:   # from tts_engine.voices import blend
        return True
    if module == "tts_engine":
        return name is None or name in tts_engine.__all__
    return module in tts_engine.PUBLIC_MODULES


def engine_reaches(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every read of an engine's private attribute (`engine._x`) or of what it is made of
    (`engine.model`, `self._engine.config`, ...): an expression named `engine`/`eng` (or ending so) on the left."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        left = ast.unparse(node.value)
        last = left.rsplit(".", 1)[-1].lstrip("_")
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if last in ("engine", "eng", "base") and (private or node.attr in ENGINE_INTERNALS):
            out.append((node.lineno, f"{left}.{node.attr}"))
    return out


def _stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names


def _violations_ui(rel: str, source: str) -> list[str]:
    bad = []
    for line, module, name in imports(source):
        root = module.split(".")[0]
        where = f"{rel}:{line}: {module}" + (f" import {name}" if name else "")
        if root == "tts_engine" and not public_engine_import(module, name):
            bad.append(where + " (not tts_engine's public API)")
        elif root == "server" and (rel, module, name) not in UI_MAY_USE_SERVER:
            bad.append(where + " (the page uses serving/, not the HTTP layer)")
        elif root in ("bench", "tests", "app"):
            bad.append(where + " (the library imports no benchmark, test or entry point)")
    return bad


def _violations_server(rel: str, source: str) -> list[str]:
    bad = []
    for line, module, name in imports(source):
        root = module.split(".")[0]
        where = f"{rel}:{line}: {module}" + (f" import {name}" if name else "")
        if root == "tts_engine":
            if not public_engine_import(module, name):
                bad.append(where + " (not tts_engine's public API)")
        elif root in FIRST_PARTY - {"serving", "server"}:
            bad.append(where + " (server/ is HTTP: it uses serving/ and tts_engine's public API only)")
        elif root not in FIRST_PARTY and not _stdlib(module) and root not in SERVER_THIRD_PARTY:
            bad.append(where + " (not HTTP: move it to serving/)")
    return bad


def _violations_serving(rel: str, source: str) -> list[str]:
    bad = []
    for line, module, name in imports(source):
        root = module.split(".")[0]
        where = f"{rel}:{line}: {module}" + (f" import {name}" if name else "")
        if root == "tts_engine" and not public_engine_import(module, name):
            bad.append(where + " (not tts_engine's public API)")
        elif root in ("ui", "server", "bench", "tests", "app", "gradio", "fastapi", "starlette"):
            bad.append(where + " (serving/ sits below the page and the HTTP API)")
    return bad


CHECKS = {"ui": _violations_ui, "server": _violations_server, "serving": _violations_serving}


@pytest.mark.parametrize("room", sorted(CHECKS))
def test_each_room_imports_only_what_its_layer_may(room):
    files = _files(room)
    assert files
    bad = [v for p in files for v in CHECKS[room](str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("room", ["ui", "server", "serving"])
def test_no_room_reads_an_engines_internals(room):
    bad = [f"{p.relative_to(ROOT)}:{line}: {expr}" for p in _files(room)
           for line, expr in engine_reaches(p.read_text(encoding="utf-8"))]
    assert not bad, "\n".join(bad)


def test_importing_the_package_stays_light():
    """`import tts_engine` loads no torch: its public names are loaded on first use."""
    import subprocess

    code = "import sys, tts_engine; assert 'torch' not in sys.modules, 'torch imported'; tts_engine.chunk_schedule"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_public_names_and_modules_exist():
    """Every name of `__all__` resolves (lazily) and every public module imports: the list is no wish list."""
    import importlib

    for name in tts_engine.__all__:
        assert getattr(tts_engine, name) is not None, name
    for module in tts_engine.PUBLIC_MODULES:
        importlib.import_module(module)


def test_the_scan_sees_each_kind_of_reach():
    """The checks above flag what the page and the API used to do (so a pass means something)."""
    old_ui = ("from tts_engine.engine.request import chunk_schedule\nfrom tts_engine.cpu import remembered_choice\n"
              "from tts_engine.checkpoint import resolve_checkpoint\nfrom server import voices_api\n"
              "import tts_engine.tiny\nfrom tts_engine import loader\n")
    assert len(_violations_ui("ui/x.py", old_ui)) == 6
    assert not _violations_ui("ui/x.py", "from tts_engine import TTSError, asr, chunk_schedule\n"
                                         "from tts_engine.voices.voice import Voice\nimport tts_engine.audio\n"
                                         "from serving.registry import EngineRegistry\n")
    assert len(_violations_server("server/x.py", "import torch\nimport gradio\nfrom ui import layout\n"
                                                 "from tts_engine.model.quant import QUANT_MODES\n")) == 4
    assert not _violations_server("server/x.py", "import json\nfrom fastapi import FastAPI\n"
                                                 "from serving.limits import Limits\nfrom tts_engine import TTSError\n")
    assert len(_violations_serving("serving/x.py", "from server import openai_api\nimport gradio\n"
                                                   "from tts_engine.cpu.cpu_info import cpu_info\n")) == 3
    reach = ("self._engine._speaker_id('a')\nx = engine.model.quantize_why\neng.config.supports_clone\n"
             "self._engine.speaker_id('a')\nengine.precision_why\n")
    assert [line for line, _ in engine_reaches(reach)] == [1, 2, 3]


def test_the_public_api_says_what_the_page_needs(tmp_path):
    """What ui/ and server/ read through the public API: a checkpoint's description without loading it, and an
    engine's device, clone support, precision and why, speaker ids, chunk schedule."""
    from itertools import islice

    from tts_engine import TTSEngine, TTSError, chunk_schedule, inspect_checkpoint, make_tiny

    cv = inspect_checkpoint(str(make_tiny(tmp_path / "cv", kind="custom_voice", size="0b6", seed=0)))
    base = inspect_checkpoint(str(make_tiny(tmp_path / "base", kind="base", size="0b6", seed=0)))
    assert (cv.kind, cv.size, cv.supports_clone, cv.supports_instruct) == ("custom_voice", "0b6", False, False)
    assert "ryan" in cv.speakers and cv.languages[0] == "auto" and cv.folder == tmp_path / "cv"
    assert base.kind == "base" and base.supports_clone and base.speakers == []
    with pytest.raises(TTSError, match="not a Qwen3-TTS 12 Hz checkpoint"):
        inspect_checkpoint(str(tmp_path))
    assert list(islice(chunk_schedule((1, 1), 12), 6)) == [1, 1, 2, 4, 8, 12]

    eng = TTSEngine.from_pretrained(str(cv.folder), device="cpu", dtype="fp32", quantize="none")
    try:
        assert str(eng.device) == "cpu" and not eng.supports_clone and eng.hidden_size == cv.hidden_size
        assert eng.precision == "fp32" and eng.precision_why == ""        # named, not chosen by "auto"
        assert eng.speaker_id("Ryan") == eng.speaker_id("ryan")
        with pytest.raises(TTSError, match="unknown speaker"):
            eng.speaker_id("nobody")
    finally:
        eng.close()
