"""The talker's whole per-frame step in one C++ call (tts_engine/cpu/talker_step.py, talker_step.cpp).

- Frames decoded through the step against the Python path (ModelRunner._advance_python) over the same fused stack:
  W8A8 (head in the call), W4A8 (head in the call), bf16 (the eager head between two calls), bf16 and fp32
  activations, 1 and several rows with different codebook-0 settings (greedy, sampled, top-k 1 / 0, top-p, EOS
  allowed or ignored, repetition penalty): the same 16 codes and done flags every frame, and the same row state
  (positions, steps, seen ids, hidden states, the talker cache) at the end.
- The refused input falls back to the Python path for good; TTS_TALKER_STEP=0 leaves the Python path; the trial at
  load times both paths and remembers the choice; fp32 engines never get it.

Where the CPU has AVX-512 VNNI and g++ is on PATH the library must build and run (a failure fails here)."""
from __future__ import annotations

import pytest
import torch

from tts_engine.cpu import cpu_ext
from tts_engine.cpu import fused_step
from tts_engine.cpu import predictor_frame
from tts_engine.cpu import talker_step
from tts_engine.cpu.measured import entry_of
from tts_engine.model.prompt import Prompt
from tts_engine.model.sampling import SamplingParams

from test_cpu_ext_kernels import built


@pytest.fixture
def step_lib():
    return built(talker_step.library, "the talker step")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tts_engine.tiny import make_tiny

    d = tmp_path_factory.mktemp("tstep")
    return {"0b6": make_tiny(d / "cv", kind="custom_voice", seed=0, arch="tiny"),
            # W4A8 needs every input width a multiple of 64
            "small": make_tiny(d / "small", kind="custom_voice", seed=0, arch="small")}


def load(ckpt, mode: str, dtype: str, monkeypatch):
    from tts_engine.loader import Qwen3TTSModel

    monkeypatch.setenv(fused_step.ENV, "1")
    monkeypatch.setenv(predictor_frame.ENV, "1")
    return Qwen3TTSModel.from_pretrained(str(ckpt), device="cpu", dtype=dtype,
                                         quantize=None if mode in ("bf16", "fp32") else mode)


def runner(model, rows: int, monkeypatch, step: str):
    from tts_engine.engine.model_runner import ModelRunner

    monkeypatch.setenv(talker_step.ENV, step)
    t = model.talker
    return ModelRunner(t, model.prompts.tts_pad, rows=rows, max_len=96, eos_id=t.cfg.codec_eos_token_id)


def params(B: int) -> list[SamplingParams]:
    """B rows: sampled (top-k 50, penalty), greedy, top-k 1, whole vocabulary with top-p, EOS ignored, hot."""
    out = []
    for i in range(B):
        out.append(SamplingParams(do_sample=i % 5 != 1, top_k=[50, 50, 1, 0, 20][i % 5],
                                  top_p=[1.0, 1.0, 1.0, 0.8, 1.0][i % 5], temperature=[0.9, 1.0, 1.0, 1.2, 1.5][i % 5],
                                  repetition_penalty=[1.05, 1.3, 1.0, 1.05, 2.0][i % 5], ignore_eos=i % 5 == 4,
                                  seed=31 * i + 7))
    return out


def prompts(r, B: int):
    g = torch.Generator().manual_seed(5)
    D = r.talker.cfg.hidden_size
    return [Prompt(prefill=(torch.randn(6 + i, D, generator=g) * 0.5).to(r.dtype),
                   trailing=(torch.randn(3 + 2 * i, D, generator=g) * 0.5).to(r.dtype)) for i in range(B)]


CASES = [("w8a8", "bf16", "0b6"), ("w8a8", "fp32", "0b6"), ("w4a8", "bf16", "small"), ("bf16", "bf16", "0b6")]


@pytest.mark.parametrize("mode,dtype,size", CASES)
@torch.inference_mode()
def test_frames_equal_the_python_path(step_lib, own_kernels, ckpts, monkeypatch, mode, dtype, size):
    if mode == "w4a8" and not cpu_ext.has_w4a8():
        pytest.skip("no W4A8 kernel here")
    model = load(ckpts[size], mode, dtype, monkeypatch)
    calls = {"step": 0}
    real = talker_step.StepPlan.run
    monkeypatch.setattr(talker_step.StepPlan, "run",
                        lambda self, *a, **k: (calls.__setitem__("step", calls["step"] + 1), real(self, *a, **k))[1])
    for B in (1, 5):
        py, st = runner(model, B, monkeypatch, "0"), runner(model, B, monkeypatch, "1")
        assert py.talker_step is None and entry_of(py.path_entries["talker step"]) == {
            "path": "python", "how": f"forced by {talker_step.ENV}", "why": f"{talker_step.ENV}=0"}
        assert st.talker_step is not None and st.talker_step.state == "on", st.path_entries
        assert entry_of(st.path_entries["talker step"])["how"] == f"forced by {talker_step.ENV}"
        in_call = st.talker_step.plan.head_in_call(B)
        assert in_call == (mode != "bf16"), "W8A8 (vnni) and W4A8 heads run in the call, bf16 heads between two"
        ps, ins = params(B), prompts(py, B)
        for r in (py, st):
            for row in range(B):
                r.prefill(row, ins[row], ps[row])
        rows = list(range(B))
        before = calls["step"]
        for f in range(14):
            want, want_done = py.decode(rows)
            got, got_done = st.decode(rows)
            assert torch.equal(got, want), f"B={B} frame {f}: {(got != want).sum()} codes differ\n{got}\n{want}"
            assert torch.equal(got_done, want_done), f"B={B} frame {f}"
        assert calls["step"] - before == 14 and st.talker_step.state == "on"
        for name in ("pos", "step", "seen", "hidden", "c0"):
            assert torch.equal(getattr(st, name), getattr(py, name)), name
        L = max(st.host_len)
        assert torch.equal(st.cache.k[:, :, :, :L], py.cache.k[:, :, :, :L])
        assert torch.equal(st.cache.v[:, :, :, :L], py.cache.v[:, :, :, :L])


@torch.inference_mode()
def test_rows_out_of_order_and_logits_of_the_head(step_lib, own_kernels, ckpts, monkeypatch):
    """Non-dense rows (an index tensor) take the step too; its head logits equal the eager head's."""
    model = load(ckpts["0b6"], "w8a8", "bf16", monkeypatch)
    py, st = runner(model, 4, monkeypatch, "0"), runner(model, 4, monkeypatch, "1")
    ps, ins = params(4), prompts(py, 4)
    for r in (py, st):
        for row in range(4):
            r.prefill(row, ins[row], ps[row])
    rows = [3, 1]
    for _ in range(4):
        codes = py.complete(rows)
        assert torch.equal(st.complete(rows), codes)
        assert torch.equal(st.advance(rows, codes), py.advance(rows, codes))
    assert torch.equal(st.c0, py.c0) and torch.equal(st.hidden, py.hidden) and torch.equal(st.seen, py.seen)
    # the head's logits of the call, against the eager head on the hidden state it wrote
    r = torch.tensor(rows)
    rp = st.rows_view(rows)[2]
    codes = st.complete(rows)
    done, logits = st.talker_step.plan.run(r, rp, codes, with_logits=True)
    assert torch.equal(logits, st.talker.codec_head(st.hidden[r]).float())


@torch.inference_mode()
def test_a_refused_input_falls_back_for_good(step_lib, own_kernels, ckpts, monkeypatch):
    model = load(ckpts["0b6"], "w8a8", "bf16", monkeypatch)
    py, st = runner(model, 1, monkeypatch, "0"), runner(model, 1, monkeypatch, "1")
    for r in (py, st):
        r.prefill(0, prompts(py, 1)[0], params(1)[0])
    bad = py.complete([0]).clone()
    bad[0, 3] = 1 << 20   # out of the table: the call refuses (nothing written), the Python path raises as before
    with pytest.raises(IndexError):
        st.advance([0], bad)
    assert st.talker_step.state == "off" and st.talker_step.record.how == "fell back"
    assert "refused" in st.talker_step.record.why
    codes = py.complete([0])
    assert torch.equal(st.complete([0]), codes)
    assert torch.equal(st.advance([0], codes), py.advance([0], codes))
    assert torch.equal(st.c0, py.c0)


@torch.inference_mode()
def test_trial_at_load_is_remembered_and_leaves_row_0_as_it_was(step_lib, own_kernels, ckpts, monkeypatch):
    model = load(ckpts["0b6"], "w8a8", "bf16", monkeypatch)
    r = runner(model, 2, monkeypatch, "auto")
    rec = r.talker_step.record
    assert r.talker_step is not None and r.talker_step.state in ("on", "off"), rec
    assert rec.how == "measured now" and "Python" in rec.why and "the same ids" in rec.why
    assert entry_of(r.path_entries["talker step"]) == rec.entry()
    assert len(r.talker_step.times["step"]) == talker_step.TRIAL_PAIRS
    for name in ("pos", "step", "seen", "hidden", "c0", "trailing_len", "max_new"):
        assert not getattr(r, name).any(), name
    again = runner(model, 2, monkeypatch, "auto")
    assert again.talker_step.state == r.talker_step.state and again.talker_step.record.how == "remembered"
    assert again.talker_step.times["step"] == []


@torch.inference_mode()
def test_fp32_and_unfused_engines_never_get_it(step_lib, own_kernels, ckpts, monkeypatch):
    model = load(ckpts["0b6"], "fp32", "fp32", monkeypatch)
    r = runner(model, 1, monkeypatch, "1")
    assert r.talker_step is None and "fused step does not serve" in entry_of(r.path_entries["talker step"])["why"]
    monkeypatch.setenv(fused_step.ENV, "0")
    model = load(ckpts["0b6"], "w8a8", "bf16", monkeypatch)
    monkeypatch.setenv(fused_step.ENV, "0")
    r = runner(model, 1, monkeypatch, "1")
    assert r.talker_step is None


def test_engine_synthesis_through_the_step_equals_the_python_path(step_lib, own_kernels, ckpts, monkeypatch):
    """A whole engine (worker thread, chunked streaming, the codec) with the step on gives the same audio as with it
    off, and its frames go through the step (counted); with TTS_TALKER_STEP unset the trial runs at load."""
    from tts_engine.engine.engine import TTSEngine

    monkeypatch.setenv(fused_step.ENV, "1")
    monkeypatch.setenv(predictor_frame.ENV, "1")
    calls = {"step": 0}
    real = talker_step.StepPlan.run
    monkeypatch.setattr(talker_step.StepPlan, "run",
                        lambda self, *a, **k: (calls.__setitem__("step", calls["step"] + 1), real(self, *a, **k))[1])
    wavs = {}
    for mode in ("0", "1", "auto"):
        monkeypatch.setenv(talker_step.ENV, mode)
        engine = TTSEngine.from_pretrained(str(ckpts["0b6"]), device="cpu", dtype="bf16", quantize="w8a8",
                                           max_batch=2, max_seq_len=128)
        try:
            status = engine.paths()["talker step"]
            assert status["how"] in (("measured now", "remembered") if mode == "auto"
                                     else (f"forced by {talker_step.ENV}",)), status
            assert mode == "auto" or status["path"] == {"0": "python", "1": "step"}[mode], status
            before = calls["step"]
            wavs[mode] = engine.synthesize("Hello there.", voice=engine.speakers[0], seed=1, max_new_tokens=8)
            if mode == "1":
                assert calls["step"] - before >= 6, calls
            if mode == "0":
                assert calls["step"] == before
        finally:
            engine.close()
    assert wavs["0"].size > 0
    assert (wavs["1"] == wavs["0"]).all() and (wavs["auto"] == wavs["0"]).all()


@torch.inference_mode()
def test_the_bench_profile_replays_the_served_step_and_leaves_the_row_as_it_was(step_lib, own_kernels, ckpts,
                                                                                   monkeypatch):
    """`ModelRunner.replay_talker_step` (what `python -m bench speed`'s frame profile times) runs the talker step the
    engine serves (the C++ step here, not the Python path) again from the state it started in: the row's state is
    put back, so the stream's next frames are unchanged."""
    model = load(ckpts["0b6"], "w8a8", "bf16", monkeypatch)
    plain, prof = runner(model, 1, monkeypatch, "1"), runner(model, 1, monkeypatch, "1")
    for r in (plain, prof):
        r.prefill(0, prompts(plain, 1)[0], params(1)[0])
    calls = {"step": 0, "python": 0}
    real_step, real_py = talker_step.StepPlan.run, type(prof)._advance_python
    monkeypatch.setattr(talker_step.StepPlan, "run",
                        lambda self, *a, **k: (calls.__setitem__("step", calls["step"] + 1), real_step(self, *a, **k))[1])
    monkeypatch.setattr(type(prof), "_advance_python",
                        lambda self, *a, **k: (calls.__setitem__("python", calls["python"] + 1), real_py(self, *a, **k))[1])
    for f in range(8):
        want, _ = plain.decode([0])
        got, _ = prof.decode([0])
        assert torch.equal(got, want), f"frame {f}"
        before = calls["step"]
        prof.replay_talker_step([0], got)
        assert calls["step"] == before + 1
        for name in ("pos", "step", "seen", "hidden", "c0"):
            assert torch.equal(getattr(prof, name), getattr(plain, name)), (f, name)
    assert calls["python"] == 0
    L = prof.host_len[0]
    assert torch.equal(prof.cache.k[:, :, :, :L], plain.cache.k[:, :, :, :L])
