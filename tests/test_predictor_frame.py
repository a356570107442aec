"""The code predictor's whole frame in one C++ call (tts_engine/cpu/predictor_frame.py, predictor_frame.cpp).

- The sampler alone (ttsp_choose) against sampling.choose_residual on bf16-valued logits (many equal values, so
  torch.topk's order of equal values matters): greedy and sampled rows mixed, top_k 1 / 10 / 50 / 0 (whole
  vocabulary), top_p < 1, temperatures, per-row seeds and frames: the same ids.
- A frame against the Python loop (ModelRunner._predict_residuals_loop) over the same fused stack, W8A8 and W4A8, fp32
  and bf16 activations, B = 1 and B > 1 with different per-row parameters, the tiny 1.7B shape (a projection between
  the talker's and the predictor's widths): the same 16 codes per row.
- bf16 stacks (the heads' bf16 sums in another order than aten's): every code is the sampler's choice on the frame's
  own logits, and those logits are close to the Python loop's teacher-forced on the frame's codes.
- In an engine: the frame serves (counted), TTS_PREDICTOR_FRAME=0 leaves the loop, a failure falls back for good, the
  first frames time both paths and the choice is remembered, fp32 engines never get it.

Where the CPU has AVX-512 VNNI and g++ is on PATH the library must build and run (a failure fails here)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tts_engine.cpu import cpu_ext
from tts_engine.cpu import fused_step
from tts_engine.cpu import predictor_frame
from tts_engine.cpu.measured import entry_of
from tts_engine.model.sampling import RowParams, SamplingParams, choose_residual

from test_cpu_ext_kernels import built


@pytest.fixture
def frame_lib():
    return built(predictor_frame.library, "the predictor frame")


def row_params(B: int, seed: int = 0, top_p: bool = True) -> list[SamplingParams]:
    """B rows with different sub-talker settings: sampled and greedy, top_k 50 / 1 / 0 / 10, top_p < 1, temperatures."""
    ks, ps, ts = [50, 1, 0, 10, 50, 3, 2048, 7], [1.0, 0.8, 1.0, 0.5, 0.95, 1.0, 0.7, 1.0], [0.9, 1.0, 0.5, 1.3]
    return [SamplingParams(subtalker_dosample=(i % 4 != 1), subtalker_top_k=ks[i % 8],
                           subtalker_top_p=ps[i % 8] if top_p else 1.0, subtalker_temperature=ts[i % 4],
                           seed=1000 * seed + 17 * i) for i in range(B)]


# --- the sampler ----------------------------------------------------------------------------------------------------
def test_sampler_matches_choose_residual(frame_lib):
    g = torch.Generator().manual_seed(0)
    n = same = 0
    for trial in range(30):
        B = 8
        logits = (torch.randn(B, 2048, generator=g) * 2).to(torch.bfloat16).float()   # many equal values
        rp = RowParams.stack(row_params(B, trial, top_p=trial % 2 == 1), "cpu")
        frame = torch.randint(0, 500, (B,), generator=g)
        for book in (1, 8, 15):
            want = choose_residual(logits, frame, book, rp)
            got = predictor_frame.choose(logits, frame, book, rp)
            n += B
            same += int((want == got).sum())
    # top-p rows may, in principle, drop another of several equal candidates at the cut than torch's unstable sort
    # does; on these inputs (and every run so far) not one draw differed
    assert same == n, f"{n - same} of {n} ids differ"


def test_sampler_greedy_rows_and_top_k_1_take_the_first_maximum(frame_lib):
    logits = torch.zeros(3, 2048)
    logits[:, 5] = logits[:, 9] = 2.0   # a tie: torch.argmax and top-k 1 give the first
    params = [SamplingParams(subtalker_dosample=False), SamplingParams(subtalker_top_k=1, seed=3),
              SamplingParams(subtalker_top_k=1, subtalker_top_p=0.1, seed=4)]
    rp = RowParams.stack(params, "cpu")
    frame = torch.tensor([0, 1, 2])
    got = predictor_frame.choose(logits, frame, 4, rp)
    assert got.tolist() == choose_residual(logits, frame, 4, rp).tolist() == [5, 5, 5]


# --- frames against the Python loop ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tts_engine.tiny import make_tiny

    d = tmp_path_factory.mktemp("pframe")
    return {"0b6": make_tiny(d / "cv", kind="custom_voice", seed=0, arch="tiny"),
            "1b7": make_tiny(d / "cv17", kind="custom_voice", size="1b7", seed=0, arch="tiny"),
            # W4A8 needs every input width a multiple of 64 (the tiny predictor's attention output is 32 wide)
            "small": make_tiny(d / "small", kind="custom_voice", seed=0, arch="small")}


def runner_for(ckpt, mode: str, dtype: str, rows: int = 8, monkeypatch=None):
    """A ModelRunner over a tiny model with the fused step on (TTS_FUSED_STEP=1) and the predictor frame attached
    (forced on), whatever TTS_PREDICTOR_FRAME says outside."""
    from tts_engine.engine.model_runner import ModelRunner
    from tts_engine.loader import Qwen3TTSModel

    monkeypatch.setenv(fused_step.ENV, "1")
    monkeypatch.setenv(predictor_frame.ENV, "1")
    model = Qwen3TTSModel.from_pretrained(str(ckpt), device="cpu", dtype=dtype,
                                          quantize=None if mode == "bf16" else mode)
    t = model.talker
    r = ModelRunner(t, model.prompts.tts_pad, rows=rows, max_len=64, eos_id=t.cfg.codec_eos_token_id)
    return r


def frame_inputs(r, B: int, seed: int, top_p: bool = True):
    g = torch.Generator().manual_seed(seed)
    D = r.talker.cfg.hidden_size
    h = (torch.randn(B, D, generator=g) * 2).to(r.dtype)
    c0 = torch.randint(0, 2048, (B,), generator=g)
    frame = torch.randint(0, 300, (B,), generator=g)
    rp = RowParams.stack(row_params(B, seed, top_p), "cpu")
    return h, c0, frame, rp


EXACT = [("w8a8", "fp32", "0b6"), ("w8a8", "bf16", "0b6"), ("w4a8", "bf16", "small"), ("w4a8", "fp32", "small"),
         ("w8a8", "bf16", "1b7"), ("w8a8", "fp32", "1b7")]


@pytest.mark.parametrize("mode,dtype,size", EXACT)
@torch.inference_mode()
def test_frame_codes_equal_the_python_loop(frame_lib, own_kernels, ckpts, monkeypatch, mode, dtype, size):
    if mode == "w4a8" and not cpu_ext.has_w4a8():
        pytest.skip("no W4A8 kernel here")
    r = runner_for(ckpts[size], mode, dtype, monkeypatch=monkeypatch)
    cp = r.talker.code_predictor
    assert cp.model.fused.state == "on" and cp.frame is not None, r.path_entries
    n = same = 0
    for B, seed in ((1, 0), (1, 1), (3, 2), (8, 3), (5, 4)):
        h, c0, frame, rp = frame_inputs(r, B, seed, top_p=False)
        want = r._predict_residuals_loop(h, c0, frame, rp)
        got = cp.frame.plan.run(h, c0, frame, rp, r.cp_cache)
        assert got.shape == want.shape == (B, 16)
        assert torch.equal(got[:, 0], c0)
        n += want.numel()
        same += int((got == want).sum())
        assert torch.equal(got, want), f"B={B} seed={seed}: {(got != want).sum()} codes differ\n{got}\n{want}"
    assert same == n


@pytest.mark.parametrize("team,whole,mode,size", [("claim", True, "w8a8", "0b6"), ("barrier", True, "w8a8", "0b6"),
                                                  ("claim", False, "w8a8", "0b6"), ("claim", True, "w4a8", "small"),
                                                  ("claim", True, "bf16", "0b6"), ("claim", True, "w8a8", "1b7")])
@torch.inference_mode()
def test_frame_in_one_parallel_region_equals_the_python_loop(frame_lib, own_kernels, ckpts, monkeypatch, team, whole,
                                                             mode, size):
    """At 2 threads, the whole frame in one parallel region (run_frame_team; with a projection, 1b7: one region per
    pass) or each pass's stack in one (fused_step.cpp run_team): the same codes as the Python loop (bf16: as the
    split path's frame, whose heads sum in another order than aten's)."""
    if mode == "w4a8" and not cpu_ext.has_w4a8():
        pytest.skip("no W4A8 kernel here")
    r = runner_for(ckpts[size], mode, "bf16", monkeypatch=monkeypatch)
    threads = torch.get_num_threads()
    plan = r.talker.code_predictor.frame.plan
    if mode == "bf16":   # the reference: the split path's frame
        r._predict_residuals_loop = lambda h, c0, frame, rp: (predictor_frame.set_team("split"),
                                                              plan.run(h, c0, frame, rp, r.cp_cache),
                                                              predictor_frame.set_team(team, whole))[1]
    was = predictor_frame.set_team(team, whole)
    torch.set_num_threads(2)
    try:
        for B, seed in ((1, 0), (4, 1)):
            h, c0, frame, rp = frame_inputs(r, B, seed, top_p=False)
            want = r._predict_residuals_loop(h, c0, frame, rp)
            got = r.talker.code_predictor.frame.plan.run(h, c0, frame, rp, r.cp_cache)
            assert torch.equal(got, want), f"B={B}: {(got != want).sum()} codes differ"
        codes, logits = plan.run(h, c0, frame, rp, r.cp_cache, with_logits=True)   # the logits too, bit for bit
        split_codes, split_logits = plan.run(h, c0, frame, rp, r.cp_cache, with_logits=True,
                                             team=fused_step.TEAM_MODES["split"])
        assert torch.equal(codes, split_codes) and torch.equal(logits, split_logits)
    finally:
        torch.set_num_threads(threads)
        predictor_frame.set_team(was)


@pytest.mark.parametrize("team", ["split", "claim"])
@torch.inference_mode()
def test_the_frame_profile_splits_a_call_into_its_stages(frame_lib, own_kernels, ckpts, monkeypatch, team):
    """predictor_frame.profile: one call counted, its stages (stack, heads, sampling, ...) inside the call's time,
    the stack's own stages (fused_step's profile) filled; nothing counted once the block is left."""
    r = runner_for(ckpts["0b6"], "w8a8", "bf16", monkeypatch=monkeypatch)
    plan = r.talker.code_predictor.frame.plan
    h, c0, frame, rp = frame_inputs(r, 2, 3, top_p=False)
    threads = torch.get_num_threads()
    was = predictor_frame.set_team(team)
    torch.set_num_threads(2)
    try:
        with predictor_frame.profile() as prof:
            plan.run(h, c0, frame, rp, r.cp_cache)
        plan.run(h, c0, frame, rp, r.cp_cache)   # outside: not counted
        with predictor_frame.profile() as empty:
            pass
    finally:
        torch.set_num_threads(threads)
        predictor_frame.set_team(was)
    f = prof.frame
    assert f["calls"] == 1 and all(f[k] > 0 for k in ("stack", "head", "sample", "norm", "call")), f
    assert sum(v for k, v in f.items() if k not in ("call", "calls")) <= f["call"], f
    assert prof.stack["qkv"] > 0 and prof.stack["down"] > 0 and prof.stack["qkv"] < f["stack"], prof.stack
    assert empty.frame["calls"] == 0 and empty.frame["call"] == 0 and empty.stack["qkv"] == 0


@pytest.mark.parametrize("mode,dtype", [("w8a8", "bf16"), ("w8a8", "fp32")])
@torch.inference_mode()
def test_frame_with_top_p_rows_mostly_equals_the_python_loop(frame_lib, own_kernels, ckpts, monkeypatch, mode, dtype):
    """top_p < 1 rows too: equal but where torch's unstable sort drops another of several equal candidates at the
    cut (none here so far); one such flip changes the rest of that row's frame, so rows are compared whole."""
    r = runner_for(ckpts["0b6"], mode, dtype, monkeypatch=monkeypatch)
    rows = same = 0
    for seed in range(4):
        h, c0, frame, rp = frame_inputs(r, 8, 10 + seed, top_p=True)
        want = r._predict_residuals_loop(h, c0, frame, rp)
        got = r.talker.code_predictor.frame.plan.run(h, c0, frame, rp, r.cp_cache)
        rows += 8
        same += int((got == want).all(dim=1).sum())
    assert same >= rows - 1, f"{rows - same} of {rows} rows differ"


@pytest.mark.parametrize("size", ["0b6", "1b7"])
@torch.inference_mode()
def test_bf16_frame_samples_its_own_logits_and_they_match_the_loop(frame_lib, own_kernels, ckpts, monkeypatch, size):
    """bf16 stacks: the heads' sums run in another order than aten's bf16 gemv, so ids may differ where logits nearly
    tie. Every id is still the sampler's choice on the frame's own logits, and the Python loop teacher-forced on the
    frame's ids gives close logits."""
    r = runner_for(ckpts[size], "bf16", "bf16", monkeypatch=monkeypatch)
    cp = r.talker.code_predictor
    assert cp.frame is not None, r.path_entries
    B = 4
    h, c0, frame, rp = frame_inputs(r, B, 7)
    codes, logits = cp.frame.plan.run(h, c0, frame, rp, r.cp_cache, with_logits=True)
    x = torch.stack([h, r.talker.codec_embed(c0)], dim=1)
    top1 = 0
    for j in range(15):
        assert torch.equal(choose_residual(logits[j], frame, j + 1, rp), codes[:, j + 1])
        ref = cp.step(x, r.cp_cache, None, start=0 if j == 0 else j + 1, head=j)
        assert F.cosine_similarity(ref, logits[j], dim=-1).min() > 0.999
        top1 += int((ref.argmax(-1) == logits[j].argmax(-1)).sum())
        x = cp.model.codec_embedding[j](codes[:, j + 1])[:, None]
    assert top1 >= 0.9 * 15 * B


# --- in an engine ---------------------------------------------------------------------------------------------------
def test_engine_frames_go_through_one_call(frame_lib, own_kernels, ckpts, monkeypatch):
    from tts_engine.engine.engine import TTSEngine

    monkeypatch.setenv(fused_step.ENV, "1")
    monkeypatch.setenv(predictor_frame.ENV, "1")
    calls = {"frame": 0, "loop": 0}
    real_run, real_loop = predictor_frame.FramePlan.run, None
    from tts_engine.engine import model_runner

    real_loop = model_runner.ModelRunner._predict_residuals_loop
    monkeypatch.setattr(predictor_frame.FramePlan, "run",
                        lambda self, *a, **k: (calls.__setitem__("frame", calls["frame"] + 1), real_run(self, *a, **k))[1])
    monkeypatch.setattr(model_runner.ModelRunner, "_predict_residuals_loop",
                        lambda self, *a: (calls.__setitem__("loop", calls["loop"] + 1), real_loop(self, *a))[1])
    engine = TTSEngine.from_pretrained(str(ckpts["0b6"]), device="cpu", quantize="w8a8", max_batch=2,
                                       max_seq_len=128)
    try:
        assert engine.paths()["predictor frame"] == {"path": "frame", "how": f"forced by {predictor_frame.ENV}",
                                                     "why": f"{predictor_frame.ENV}=1"}
        wav = engine.synthesize("Hello there.", voice=engine.speakers[0], seed=1, max_new_tokens=6)
        assert wav.size > 0
        assert calls["frame"] >= 5 and calls["loop"] == 0, calls
    finally:
        engine.close()


def test_forced_off_and_fp32_never_take_it(own_kernels, ckpts, monkeypatch):
    from tts_engine.engine.model_runner import ModelRunner
    from tts_engine.loader import Qwen3TTSModel

    monkeypatch.setenv(fused_step.ENV, "1")
    monkeypatch.setenv(predictor_frame.ENV, "0")
    model = Qwen3TTSModel.from_pretrained(str(ckpts["0b6"]), device="cpu", dtype="bf16", quantize="w8a8")
    r = ModelRunner(model.talker, model.prompts.tts_pad, rows=1, max_len=32, eos_id=2150)
    assert entry_of(r.path_entries["predictor frame"]) == {"path": "loop", "how": f"forced by {predictor_frame.ENV}",
                                                           "why": f"{predictor_frame.ENV}=0"}
    assert model.talker.code_predictor.frame is None
    monkeypatch.setenv(predictor_frame.ENV, "1")
    fp32 = Qwen3TTSModel.from_pretrained(str(ckpts["0b6"]), device="cpu", dtype="fp32")
    r = ModelRunner(fp32.talker, fp32.prompts.tts_pad, rows=1, max_len=32, eos_id=2150)
    assert entry_of(r.path_entries["predictor frame"])["path"] == "loop" and fp32.talker.code_predictor.frame is None
    h, c0, frame, rp = frame_inputs(r, 1, 0)
    with torch.inference_mode():   # the fp32 loop serves, unchanged
        assert r._predict_residuals(h, c0, frame, rp).shape == (1, 16)


@torch.inference_mode()
def test_a_failure_falls_back_to_the_loop_for_good(frame_lib, own_kernels, ckpts, monkeypatch, caplog):
    r = runner_for(ckpts["0b6"], "w8a8", "bf16", monkeypatch=monkeypatch)
    pf = r.talker.code_predictor.frame
    calls = []

    def boom(*a, **k):
        calls.append(1)
        raise RuntimeError("kaputt")
    monkeypatch.setattr(pf.plan, "run", boom)
    h, c0, frame, rp = frame_inputs(r, 2, 5, top_p=False)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        got = r._predict_residuals(h, c0, frame, rp)
        r._predict_residuals(h, c0, frame, rp)
    assert calls == [1] and pf.state == "off" and pf.record.how == "fell back" and "kaputt" in pf.record.why
    assert caplog.text.count("Python loop from now on") == 1
    assert torch.equal(got, r._predict_residuals_loop(h, c0, frame, rp))


@torch.inference_mode()
def test_first_frames_time_both_paths_and_the_choice_is_remembered(frame_lib, own_kernels, ckpts, monkeypatch):
    r = runner_for(ckpts["0b6"], "w8a8", "bf16", monkeypatch=monkeypatch)
    monkeypatch.delenv(predictor_frame.ENV)
    assert entry_of(predictor_frame.attach(r.talker)["predictor frame"])["how"] == "measuring"
    pf = r.talker.code_predictor.frame
    for i in range(predictor_frame.TRIAL_FRAMES):
        h, c0, frame, rp = frame_inputs(r, 2, 20 + i, top_p=False)
        assert torch.equal(r._predict_residuals(h, c0, frame, rp), r._predict_residuals_loop(h, c0, frame, rp))
    assert len(pf.times["frame"]) == len(pf.times["loop"]) == len(pf.times["frame-team"]) == predictor_frame.TRIAL_FRAMES
    assert pf.state in ("on", "off") and pf.agree[0] == pf.agree[1] == 2 * predictor_frame.TRIAL_FRAMES, pf.record
    assert list((own_kernels / "predictor_frame").glob("*.json"))
    chosen = pf.choice.chosen
    assert chosen in ("loop", "frame", "frame-team") and pf.record.how == "measured now", pf.record
    assert pf.record.why.startswith(f"{chosen} by median") and pf.state == ("off" if chosen == "loop" else "on")
    assert entry_of(predictor_frame.attach(r.talker)["predictor frame"]) == {"path": chosen, "how": "remembered",
                                                                            "why": pf.record.why}
    again = r.talker.code_predictor.frame   # the remembered choice: state and threads as decided
    assert (again.state, again.team) == (pf.state, pf.team)
    assert again.team == {"loop": None, "frame": 0, "frame-team": predictor_frame.PredictorFrame.TEAM}[chosen]


@torch.inference_mode()
def test_a_wrong_frame_in_the_trial_turns_it_off(frame_lib, own_kernels, ckpts, monkeypatch):
    r = runner_for(ckpts["0b6"], "w8a8", "bf16", monkeypatch=monkeypatch)
    monkeypatch.delenv(predictor_frame.ENV)
    predictor_frame.attach(r.talker)
    pf = r.talker.code_predictor.frame
    monkeypatch.setattr(pf.plan, "run", lambda h, c0, *a, **k: torch.cat([c0[:, None], (c0[:, None] + 1 + torch.arange(15)) % 2048], 1))
    for i in range(predictor_frame.TRIAL_FRAMES):
        h, c0, frame, rp = frame_inputs(r, 2, 30 + i, top_p=False)
        rp = RowParams.stack([SamplingParams(subtalker_dosample=False)] * 2, "cpu")
        r._predict_residuals(h, c0, frame, rp)
    assert pf.state == "off" and pf.record.how == "fell back" and "agrees" in pf.record.why


@torch.inference_mode()
def test_the_trial_runs_when_the_runner_is_built(frame_lib, own_kernels, ckpts, monkeypatch):
    """With nothing remembered, building the runner times both paths (random inputs, row 0 of the predictor's
    cache) and decides: no request's frame is ever a trial frame. The next runner reads the remembered choice."""
    from tts_engine.engine.model_runner import ModelRunner
    from tts_engine.loader import Qwen3TTSModel

    monkeypatch.setenv(fused_step.ENV, "1")
    monkeypatch.delenv(predictor_frame.ENV, raising=False)
    model = Qwen3TTSModel.from_pretrained(str(ckpts["0b6"]), device="cpu", dtype="bf16", quantize="w8a8")
    t = model.talker

    def build():
        return ModelRunner(t, model.prompts.tts_pad, rows=4, max_len=64, eos_id=t.cfg.codec_eos_token_id)

    r = build()
    pf = t.code_predictor.frame
    assert pf.state in ("on", "off") and r.path_entries["predictor frame"] is pf.choice, r.path_entries
    assert pf.record.how == "measured now", pf.record
    assert len(pf.times["frame"]) == len(pf.times["loop"]) == predictor_frame.TRIAL_FRAMES
    assert list((own_kernels / "predictor_frame").glob("*.json"))
    h, c0, frame, rp = frame_inputs(r, 2, 40, top_p=False)
    before = len(pf.times["frame"])
    r._predict_residuals(h, c0, frame, rp)
    assert len(pf.times["frame"]) == before     # a request's frame is served, not timed
    r2 = build()
    assert entry_of(r2.path_entries["predictor frame"])["how"] == "remembered"
