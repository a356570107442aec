"""The one attach point of a device's fast paths (engine/backends.py, tts_engine/cpu/backend.py) and the runner's
bookkeeping written once: a runner built with the backend off serves model/'s plain PyTorch path (and fp32 gives the
same codes either way), `RowParams.select` is the construction it replaced, and `decode` is `advance(complete())`."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tts_engine.cpu.measured import entry_of
from tts_engine.cpu import fused_step, predictor_frame, talker_step
from tts_engine.engine.model_runner import ModelRunner
from tts_engine.loader import Qwen3TTSModel
from tts_engine.model.prompt import Prompt
from tts_engine.model.sampling import RowParams, SamplingParams, host_facts

ROOT = Path(__file__).resolve().parents[1]


def _load(folder, dtype: str):
    return Qwen3TTSModel.from_pretrained(str(folder), device="cpu", dtype=dtype)


def _runner(model, rows: int = 3, **kw) -> ModelRunner:
    t = model.talker
    return ModelRunner(t, model.prompts.tts_pad, rows=rows, max_len=96, eos_id=t.cfg.codec_eos_token_id, **kw)


def _prefill(r: ModelRunner, rows, sampling: bool = True) -> None:
    D = r.hidden.shape[1]
    g = torch.Generator().manual_seed(1)
    for row in rows:
        p = Prompt(prefill=(torch.randn(20 + 3 * row, D, generator=g) * 0.05).to(r.dtype),
                   trailing=(torch.randn(6, D, generator=g) * 0.05).to(r.dtype))
        r.prefill(row, p, SamplingParams(seed=row + 7, ignore_eos=True, do_sample=sampling,
                                         subtalker_dosample=sampling, top_k=30 + row))


def _decode_frames(r: ModelRunner, rows, frames: int) -> list[torch.Tensor]:
    return [r.decode(rows)[0].clone() for _ in range(frames)]


def test_backend_off_serves_the_plain_path_and_fp32_gives_the_same_codes(tiny_cv_folder):
    fast, plain = _runner(_load(tiny_cv_folder, "fp32")), _runner(_load(tiny_cv_folder, "fp32"), fast_paths=False)
    assert fast.backend is not None and fast.backend.name == "cpu" and plain.backend is None
    assert plain.path_entries == {} and plain.talker_step is None
    entries = {part: entry_of(e) for part, e in fast.path_entries.items()}
    assert {"talker stack", "predictor stack", "predictor frame", "talker step", "compiled predictor",
            "threads"} <= set(entries)
    assert all(set(e) == {"path", "how", "why"} for e in entries.values())
    for r in (fast, plain):
        _prefill(r, range(3))
    assert all(torch.equal(a, b) for a, b in zip(_decode_frames(fast, [0, 1, 2], 5), _decode_frames(plain, [0, 1, 2], 5)))
    assert all(torch.equal(a, b) for a, b in zip(_decode_frames(fast, [2, 0], 3), _decode_frames(plain, [2, 0], 3)))


def test_backend_off_attaches_nothing_where_the_backend_would(tiny_cv_folder, monkeypatch):
    """bf16 with the fused step forced on: the backend fuses the projections and gives both stacks a fused step; a
    runner built with the backend off on a fresh load leaves every hook of model/ as the loader made it."""
    monkeypatch.setenv(fused_step.ENV, "1")
    monkeypatch.setenv(predictor_frame.ENV, "0")
    monkeypatch.setenv(talker_step.ENV, "0")
    fast_model, plain_model = _load(tiny_cv_folder, "bf16"), _load(tiny_cv_folder, "bf16")
    fast, plain = _runner(fast_model, rows=1), _runner(plain_model, rows=1, fast_paths=False)
    t = fast_model.talker
    assert t.model.layers[0].self_attn.qkv_proj is not None           # fused projections: the backend's doing
    assert t.model.fused is not None and t.model.fused.state == "on", fast.path_entries
    assert entry_of(fast.path_entries["talker stack"]) == {"path": "fused", "how": f"forced by {fused_step.ENV}",
                                                           "why": f"{fused_step.ENV}=1"}
    p = plain_model.talker
    assert p.model.layers[0].self_attn.qkv_proj is None               # the checkpoint's layout, as loaded
    assert p.model.fused is None and p.code_predictor.model.fused is None
    assert getattr(p.code_predictor, "frame", None) is None and p.code_predictor.compiled is None
    assert not hasattr(p, "_matmul_threads")                          # no Linear.forward wrapped
    with plain.step_scope(1):                                         # no oneDNN switch on the plain path
        assert torch._C._get_mkldnn_enabled() == torch.backends.mkldnn.is_available()
    with fast.step_scope(1):                                          # bf16, one row: PyTorch's gemv
        assert not torch._C._get_mkldnn_enabled()
    _prefill(plain, [0])
    assert plain.decode([0])[0].shape == (1, 16)


def _old_rows_params(rp: RowParams, rows, host):
    """The construction `RowParams.select` replaced."""
    return RowParams(**{k: (v[rows] if k != "host" else host) for k, v in rp.__dict__.items()})


def test_row_params_select_equals_the_old_construction():
    params = [SamplingParams(seed=i, top_k=10 * i, do_sample=i % 2 == 0, temperature=0.5 + i) for i in range(4)]
    rp = RowParams.stack(params, torch.device("cpu"))
    for rows, chosen in ((slice(1, 3), params[1:3]), (torch.tensor([3, 0]), [params[3], params[0]]),
                         (slice(0, 1), params[:1])):
        host = host_facts(chosen)
        got, want = rp.select(rows, host), _old_rows_params(rp, rows, host)
        assert got.host == want.host == RowParams.stack(chosen, torch.device("cpu")).host
        for k, v in want.__dict__.items():
            if k != "host":
                assert torch.equal(getattr(got, k), v), k
                assert torch.equal(v, getattr(RowParams.stack(chosen, torch.device("cpu")), k)), k
    view = rp.select(slice(0, 2), host_facts(params[:2]))
    assert view.seed.data_ptr() == rp.seed.data_ptr()                 # a slice gives views of the rows' tensors


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_is_advance_of_complete(tiny_cv_folder, dtype):
    """Two runners over one model in the same state: `decode` on one, `advance(complete())` on the other give the
    same codes, done flags and row state frame after frame, for dense and non-dense row sets."""
    model = _load(tiny_cv_folder, dtype)
    a, b = _runner(model), _runner(model)
    for r in (a, b):
        _prefill(r, range(3))
    for rows in ([0, 1, 2], [0, 1, 2], [2], [0, 2], [1], [0, 1, 2]):
        codes_a, done_a = a.decode(rows)
        codes_b = b.complete(rows)
        done_b = b.advance(rows, codes_b)
        assert torch.equal(codes_a, codes_b) and torch.equal(done_a, done_b), rows
        assert a.host_len == b.host_len
        for name in ("pos", "step", "seen", "hidden", "c0"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_decode_hands_the_codes_over_between_the_halves(tiny_cv_folder):
    model = _load(tiny_cv_folder, "fp32")
    r = _runner(model)
    _prefill(r, range(2))
    seen = []
    real_advance = r._advance
    r.on_frame_codes = lambda codes: seen.append(("codes", codes.clone()))
    r._advance = lambda *a: (seen.append(("advance", None)), real_advance(*a))[1]
    codes, _ = r.decode([0, 1])
    assert [s[0] for s in seen] == ["codes", "advance"] and torch.equal(seen[0][1], codes)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_model_codec_and_runner_do_not_import_the_cpu_package():
    """model/ is what the checkpoint computes and codec/decoder.py the codec: both reach tts_engine.cpu only through
    the hooks the CPU package sets; the runner only through engine/backends.py; the loader builds nothing."""
    files = sorted((ROOT / "tts_engine" / "model").glob("*.py"))
    files += [ROOT / "tts_engine" / "codec" / "decoder.py", ROOT / "tts_engine" / "engine" / "model_runner.py"]
    for f in files:
        bad = {m for m in _imports(f) if m == "tts_engine.cpu" or m.startswith("tts_engine.cpu.")}
        assert not bad, (f.name, bad)
    loader = ROOT / "tts_engine" / "loader.py"
    assert not any("cpu_build" in m for m in _imports(loader))
    assert "prepare(" not in loader.read_text(encoding="utf-8")
    # the build is asked for in one place only: the CPU backend's build_libraries (cpu_build.prepare)
    callers = [p.relative_to(ROOT).as_posix() for p in (ROOT / "tts_engine").rglob("*.py")
               if "cpu_build.prepare(" in p.read_text(encoding="utf-8")]
    assert callers == ["tts_engine/cpu/backend.py"], callers


def test_engine_without_fast_paths_speaks_the_same_fp32_audio(tiny_cv_folder):
    """`TTSEngine(fast_paths=False)`: no backend, no thread governor, and in fp32 the same audio as the default."""
    from tts_engine import TTSEngine

    plain = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32", fast_paths=False)
    fast = TTSEngine.from_pretrained(str(tiny_cv_folder), device="cpu", dtype="fp32")
    try:
        assert plain.runner.backend is None and plain.worker.governor is None
        assert fast.runner.backend is not None
        a = plain.synthesize("Hello there.", voice="ryan", seed=5, max_new_tokens=6)
        b = fast.synthesize("Hello there.", voice="ryan", seed=5, max_new_tokens=6)
        assert a.size > 0 and (a == b).all()
    finally:
        plain.close()
        fast.close()


def test_the_gpu_seam_attaches_tts_engine_gpu_backend_or_falls_back_with_one_line(monkeypatch, caplog):
    """On CUDA `attach_backend` calls `tts_engine.gpu.backend.attach(runner)`; where that module is absent or its
    attach raises, one log line and no backend (the eager / CUDA graph path)."""
    import logging
    import sys
    import types

    from tts_engine.engine.backends import attach_backend

    def runner():
        return types.SimpleNamespace(device=torch.device("cuda"), backend=None, path_entries={})

    monkeypatch.setitem(sys.modules, "tts_engine.gpu", None)          # absent
    with caplog.at_level(logging.INFO, logger="tts_engine"):
        r = runner()
        assert attach_backend(r) is None and r.backend is None
    assert len([x for x in caplog.records if "GPU fast paths" in x.getMessage()]) == 1

    class Backend:
        def entry(self):
            return {"path": "fused", "how": "default", "why": "a test"}

    def attach(r):
        return Backend()

    def fail(r):
        raise RuntimeError("no kernels here")

    gpu = types.ModuleType("tts_engine.gpu")
    gpu.backend = types.SimpleNamespace(attach=fail)
    monkeypatch.setitem(sys.modules, "tts_engine.gpu", gpu)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tts_engine"):
        r = runner()
        assert attach_backend(r) is None and r.backend is None
    assert ["no kernels here" in x.getMessage() for x in caplog.records] == [True]

    gpu.backend = types.SimpleNamespace(attach=attach)
    r = runner()
    got = attach_backend(r)
    assert isinstance(got, Backend) and r.backend is got
    from tts_engine.cpu.measured import entry_of

    assert list(r.path_entries) == ["gpu frame"] and r.path_entries["gpu frame"] is got
    assert entry_of(r.path_entries["gpu frame"]) == {"path": "fused", "how": "default", "why": "a test"}
