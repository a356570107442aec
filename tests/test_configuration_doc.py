"""docs/configuration.md lists every environment variable the code reads, and nothing else.

A variable counts as read where a string literal in the code is exactly its name (`os.environ.get("TTS_X")`,
`ENV = "TTS_X"`, `setting("TTS_X")`, `{"role": "TTS_X"}`); the one computed family, `serving/limits.py`'s
f"TTS_{field}", is expanded from `Limits`' fields. Two scopes, each checked both ways against its own part of the page:
the library (tts_engine/, serving/, server/, ui/, app.py) against every table above "## Benchmarks and tests", and
bench/ + tests/ against that section's table (less what the library already reads)."""
from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
NAME = re.compile(r"(?:QWEN_)?TTS_[A-Z0-9_]*[A-Z0-9]")
LIBRARY = ("tts_engine", "serving", "server", "ui", "app.py")
TOOLS = ("bench", "tests")
TOOLS_SECTION = "## Benchmarks and tests"
# a name made up by a test of the choice switch itself (tests/test_measured.py), not a setting
NOT_SETTINGS = {"TTS_SOME_CHOICE"}


def _limits_names() -> set[str]:
    from serving.limits import Limits

    return {f"TTS_{f.name.upper()}" for f in dataclasses.fields(Limits)}


# files whose f"TTS_{...}" names are known, and how to list them
COMPUTED = {"serving/limits.py": _limits_names}


def _files(parts) -> list[Path]:
    out = []
    for part in parts:
        p = ROOT / part
        out += [p] if p.is_file() else sorted(p.rglob("*.py"))
    return [p for p in out if p.resolve() != Path(__file__).resolve()]   # (this file names variables as data)


def read_in_code(parts) -> dict[str, set[str]]:
    """{variable: {files that name it}} over the .py files of `parts` (module doc)."""
    found: dict[str, set[str]] = {}
    for path in _files(parts):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                found.setdefault(node.value, set()).add(rel)
            elif isinstance(node, ast.JoinedStr) and len(node.values) > 1 \
                    and isinstance(node.values[0], ast.Constant) \
                    and str(node.values[0].value).startswith(("TTS_", "QWEN_TTS_")):
                assert rel in COMPUTED, (f"{rel}:{node.lineno} computes a TTS_ variable's name: list what it reads "
                                         "in tests/test_configuration_doc.py COMPUTED")
                for name in COMPUTED[rel]():
                    found.setdefault(name, set()).add(rel)
    for name in NOT_SETTINGS:
        found.pop(name, None)
    return found


def listed_in_doc() -> tuple[dict[str, str], dict[str, str]]:
    """({variable: its row} above TOOLS_SECTION, {variable: its row} in it), from the tables' first cells."""
    library, tools = {}, {}
    target = library
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith(TOOLS_SECTION):
            target = tools
        m = re.match(r"\|\s*`([A-Z0-9_]+)`\s*\|", line)
        if m:
            assert m.group(1) not in library and m.group(1) not in tools, f"{m.group(1)} has two rows"
            target[m.group(1)] = line
    return library, tools


def test_every_variable_the_library_reads_has_one_row_and_every_row_is_read():
    code = read_in_code(LIBRARY)
    doc, _ = listed_in_doc()
    missing = {k: sorted(v) for k, v in code.items() if k not in doc}
    stale = sorted(set(doc) - set(code))
    assert not missing, f"read by the code, missing from docs/configuration.md: {missing}"
    assert not stale, f"listed in docs/configuration.md, read nowhere in {', '.join(LIBRARY)}: {stale}"
    assert len(code) >= 40   # the scan itself works (there are ~50)


def test_every_row_names_the_files_that_read_it():
    code = read_in_code(LIBRARY)
    doc, _ = listed_in_doc()
    for name, row in doc.items():
        where = row.rstrip().rstrip("|").rsplit("|", 1)[-1]
        for path in code.get(name, ()):
            assert f"`{path}`" in where, f"{name}: its row's last column should name {path}"


def test_benchmark_and_test_variables_are_listed_apart():
    library = read_in_code(LIBRARY)
    tools = {k: v for k, v in read_in_code(TOOLS).items() if k not in library}
    _, doc = listed_in_doc()
    missing = {k: sorted(v) for k, v in tools.items() if k not in doc}
    stale = sorted(set(doc) - set(tools))
    assert not missing, f"read by bench/ or tests/, missing from '{TOOLS_SECTION}': {missing}"
    assert not stale, f"listed under '{TOOLS_SECTION}', read nowhere in bench/ or tests/ (or by the library): {stale}"


@pytest.mark.parametrize("source,expect", [
    ('import os\nos.environ.get("TTS_NEW_THING", "1")\n', {"TTS_NEW_THING"}),
    ('ENV = "TTS_OTHER"\nDOC = "TTS_OTHER=1 turns it on"\n', {"TTS_OTHER"}),   # prose mentioning a name is no read
])
def test_the_scan_finds_a_read(tmp_path, monkeypatch, source, expect):
    (tmp_path / "m.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert set(read_in_code(["m.py"])) == expect
