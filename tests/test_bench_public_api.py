"""bench/ uses the engine's public API only (an AST scan: no `x._private` attribute of an engine object, no
getattr/setattr/hasattr/delattr with a private name, no `from tts_engine... import _private`; a bench's own state
(`self._x`) and other libraries' internals (`torch.ops.aten._weight_int8pack_mm`) are not the engine's), and
`python -m bench` lists every benchmark module and runs the one named."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
LIBRARY = ("tts_engine", "serving", "server", "ui", "app")
REFLECTION = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _foreign_modules(tree: ast.Module) -> set[str]:
    """Names bound in the file to modules that are not the engine's (torch, sys, bench's own, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] not in LIBRARY:
                    names.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in LIBRARY:
                names.update(a.asname or a.name for a in node.names)
    return names


def private_uses(source: str, filename: str = "<bench>") -> list[str]:
    """"file:line: what" for every reach into a private attribute of the engine's objects in `source`."""
    tree = ast.parse(source, filename)
    foreign = _foreign_modules(tree)
    out = []

    def allowed(receiver: ast.AST) -> bool:
        root = _root(receiver)
        return isinstance(root, ast.Name) and (root.id in ("self", "cls") and receiver is root or root.id in foreign)

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not allowed(node.value):
            out.append(f"{filename}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REFLECTION \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value) and not allowed(node.args[0]):
            out.append(f"{filename}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARY:
            out += [f"{filename}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if _private(a.name)]
    return out


def test_no_benchmark_reaches_into_a_private_attribute_of_the_engine():
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        found += private_uses(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, "benchmarks must use the public API (add a documented hook at the end of the class):\n" \
        + "\n".join(found)


@pytest.mark.parametrize("source, hits", [
    ("def f(engine):\n    return engine._make_request('x')\n", 1),
    ("def f(r):\n    r.runner._advance = None\n", 1),
    ("def f(w):\n    return getattr(w, '_kept_choice', None)\n", 1),
    ("from tts_engine.cpu import cpu_ext\ncpu_ext._state['lib'] = 1\n", 1),
    ("from tts_engine.cpu.cpu_ext import _state\n", 1),
    ("class T:\n    def f(self):\n        self._x = 1\n        return self._x\n", 0),
    ("class T:\n    def f(self):\n        return self.engine._advance\n", 1),
    ("import torch\ntorch.ops.aten._weight_int8pack_mm\n", 0),
    ("from torch.utils import _pytree\nfrom torch.utils._pytree import tree_leaves\n", 0),
    ("from bench import common\ncommon._fill(None)\n", 0),
    ("import sys\ngetattr(sys, '_base_executable', None)\n", 0),
    ("def f(engine):\n    return engine.make_request('x'), engine.__class__\n", 0),
])
def test_the_scan_tells_a_private_reach_from_the_rest(source, hits):
    assert len(private_uses(source)) == hits, private_uses(source)


def test_the_index_lists_every_benchmark_module_and_each_has_a_main():
    from bench.__main__ import BENCHMARKS

    modules = {f"bench.{p.stem}" for p in BENCH.glob("*.py") if p.stem not in ("__init__", "__main__", "common")}
    listed = {m for m, _ in BENCHMARKS.values()}
    assert modules - listed == set(), f"benchmarks missing from the index: {sorted(modules - listed)}"
    assert "bench.peers.run" in listed and "peers" in BENCHMARKS
    for name, (module, what) in BENCHMARKS.items():
        assert what and "\n" not in what, name
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(source).body), module


def test_python_m_bench_prints_the_index_and_runs_one_by_name():
    run = lambda *a: subprocess.run([sys.executable, "-m", "bench", *a], cwd=ROOT, capture_output=True,  # noqa: E731
                                    text=True, timeout=300)
    index = run()
    assert index.returncode == 0, index.stderr
    from bench.__main__ import BENCHMARKS

    lines = index.stdout.splitlines()
    for name in BENCHMARKS:
        assert sum(ln.split()[:1] == [name] for ln in lines) == 1, (name, index.stdout)
    peers = run("peers", "-h")
    assert peers.returncode == 0 and "python -m bench peers" in peers.stdout, peers.stderr
    unknown = run("no_such_bench")
    assert unknown.returncode == 2 and "unknown benchmark" in unknown.stderr


def test_the_startup_bench_times_functions_this_checkout_has():
    """`python -m bench startup` times its TRIALS by name in the app's process and skips a name a checkout lacks (an
    older checkout in an A/B): in this checkout every one must exist, or a renamed trial would silently drop out."""
    import importlib

    from bench.startup import TRIALS

    for label, module, attr, _ in TRIALS:
        owner = importlib.import_module(module)
        for part in attr.split("."):
            assert hasattr(owner, part), f"bench/startup.py TRIALS {label!r}: {module}.{attr} is gone; name its new home"
            owner = getattr(owner, part)


def test_every_part_the_engine_offers_to_wrap_is_called_through_the_wrapper_and_put_back(tiny_cv_folder):
    """`TTSEngine.wrap`: each part's calls go through the wrapper during a stream (the codec thread's too, where it
    runs), `make_request` builds without submitting, and the restore function leaves the engine as it was."""
    from tts_engine.engine.engine import TTSEngine

    engine = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", max_batch=1, overlap_codec=True)
    try:
        parts = ("worker step", "prefill", "emit", "code predictor", "talker step", "between halves", "talker stack",
                 "codec thread")
        calls = {p: 0 for p in parts}

        def counting(part):
            def wrapper(inner):
                def counted(*a, **k):
                    calls[part] += 1
                    return inner(*a, **k)
                return counted
            return wrapper

        restores = [engine.wrap(p, counting(p)) for p in parts]
        with pytest.raises(ValueError, match="no part 'nope'"):
            engine.wrap("nope", counting("nope"))
        req, seed = engine.make_request("Hello there.", voice=engine.speakers[0], seed=3, max_new_tokens=6,
                                        sampling={"ignore_eos": True}, first_chunk_frames=1)
        assert seed == 3 and req.params.max_new_tokens == 6 and req.params.seed == 3
        assert calls["prefill"] == 0   # built, not submitted
        wav = engine.synthesize("Hello there.", voice=engine.speakers[0], seed=3, max_new_tokens=6,
                                sampling={"ignore_eos": True}, first_chunk_frames=1)
        engine.worker.codec.drain(30)
        assert wav.size > 0
        assert all(calls[p] > 0 for p in parts), calls
        for restore in reversed(restores):
            restore()
        seen = dict(calls)
        engine.synthesize("Hello there.", voice=engine.speakers[0], seed=3, max_new_tokens=6,
                          sampling={"ignore_eos": True}, first_chunk_frames=1)
        assert calls == seen   # put back: nothing counted any more
        assert "_advance" not in vars(engine.runner) and "_step" not in vars(engine.worker)
    finally:
        engine.close()


def test_the_runner_hooks_rebuild_the_talker_step_and_the_predictor_half_exactly(tiny_cv_folder):
    """bench/talker_step.py's part-by-part talker step (`rows_view`, `step_scope`, `text_vectors`, `finish_step`)
    leaves a runner exactly as `advance` does, and `predict_residuals` on a frame's inputs gives `complete`'s codes."""
    from bench.common import build_talker, make_runner
    from bench.talker_step import split_python
    from tts_engine.checkpoint import read_json
    from tts_engine.config import ModelConfig

    cfg = ModelConfig.from_dict(read_json(tiny_cv_folder / "config.json"))
    talker, _ = build_talker("tts_engine", cfg, torch.float32, None)
    a, _, _ = make_runner("tts_engine", talker, cfg, torch.float32, 2, 64)
    b, _, _ = make_runner("tts_engine", talker, cfg, torch.float32, 2, 64)
    rows = [0, 1]
    with torch.inference_mode():
        for _ in range(3):
            codes = a.complete(rows)
            assert torch.equal(b.complete(rows), codes)
            r, _, rp = b.rows_view(rows)
            assert torch.equal(b.predict_residuals(b.hidden[r], b.c0[r], b.step[r] - 1, rp), codes)
            done_a = a.advance(rows, codes)
            _, done_b = split_python(b, rows, codes)
            assert torch.equal(done_a, done_b)
            for name in ("pos", "step", "seen", "hidden", "c0"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert a.host_len == b.host_len
