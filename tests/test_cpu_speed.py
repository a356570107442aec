"""CPU speed work (issue 9): the codec's transposed convs as one matmul + overlap-add equal aten's
ConvTranspose1d (the official op) and stream exactly; `bench --profile` produces its table."""
from __future__ import annotations

import pytest
import torch

from tts_engine.codec import decoder
from tts_engine.codec.decoder import CausalTransConv


@pytest.mark.parametrize("c_in, c_out, k, s", [(12, 8, 16, 8), (10, 6, 10, 5), (8, 8, 2, 2), (6, 4, 5, 3)])
@pytest.mark.parametrize("max_len", [64, 2])   # matmul form everywhere / aten's op beyond 2 inputs
@pytest.mark.parametrize("direct", [True, False])   # oneDNN called directly (1x1 conv form) / the generic ops
def test_trans_conv_matmul_equals_conv_transpose(c_in, c_out, k, s, max_len, direct, monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setattr(CausalTransConv, "MATMUL_MAX_LEN", max_len)
    monkeypatch.setattr(decoder, "_MKLDNN", direct and decoder._MKLDNN)
    m = CausalTransConv(c_in, c_out, k, s)
    x = torch.randn(3, c_in, 7)
    # the official op: ConvTranspose1d over the whole input, right-trimmed by k - s
    want = m.conv(x)[..., : x.shape[-1] * s]
    hist = torch.zeros(3, c_in, m.ctx)
    with torch.inference_mode():
        whole, _ = m.step(x, hist)
        assert whole.shape == want.shape
        assert (whole - want).abs().max() < 1e-5
        # streaming in pieces equals the whole
        parts, h = [], hist
        for a, b in ((0, 1), (1, 3), (3, 7)):
            y, h = m.step(x[..., a:b], h)
            parts.append(y)
        assert torch.allclose(torch.cat(parts, -1), whole, atol=1e-6, rtol=0)


def test_bench_profile_table(tmp_path):
    from bench.speed import torch_profile
    from tts_engine.engine.engine import TTSEngine
    from tests.live_server import tiny_checkpoint

    tiny_checkpoint(tmp_path / "cv", kind="custom_voice")
    eng = TTSEngine.from_pretrained(str(tmp_path / "cv"), device="cpu", dtype="fp32", max_batch=1, max_seq_len=128)
    eng.speakers_for_bench = eng.speakers
    try:
        table, summary = torch_profile(eng, 3, top=5)
    finally:
        eng.close()
    rows = [ln for ln in table.splitlines() if ln.startswith("| `")]
    assert len(rows) == 5 and "aten::" in table
    assert summary["aten_calls_per_frame"] > 10 and summary["self_cpu_ms_per_frame"] > 0


def test_small_bf16_batches_run_atens_gemv_and_restore_onednn(tmp_path):
    """bf16 on a CPU: frames of 1-2 rows run with oneDNN off (PyTorch's own gemv reads weights faster there);
    the switch is put back after every frame, and an fp32 engine never touches it."""
    from tts_engine import TTSEngine
    from tests.live_server import tiny_checkpoint

    ck = str(tiny_checkpoint(tmp_path / "cv", kind="custom_voice", size="0b6", seed=0))
    for dtype, want_off in (("bf16", True), ("fp32", False)):
        eng = TTSEngine.from_pretrained(ck, device="cpu", dtype=dtype)
        seen, orig = [], eng.runner._predict_residuals   # (the first half of every frame, inside its step scope)

        def spy(*a, orig=orig, seen=seen):
            seen.append(torch._C._get_mkldnn_enabled())
            return orig(*a)

        eng.runner._predict_residuals = spy
        try:
            wav = eng.synthesize("Hello there.", voice="ryan", seed=1, max_new_tokens=8)
        finally:
            eng.close()
        assert wav.size > 0 and seen and all(on is not want_off for on in seen)
        assert torch._C._get_mkldnn_enabled() == torch.backends.mkldnn.is_available()


def _in_threads(steps):
    """Run `steps` [(thread 0 or 1, enter or leave, "off" or "on")] in this order, each region entered and left in
    its own thread (a region spans two steps), and return the oneDNN switch seen after each step."""
    import threading

    from tts_engine.cpu import kernels

    go = [threading.Event() for _ in steps]
    done = [threading.Event() for _ in steps]
    seen = []

    def worker(me):
        open_ = {}
        for i, (who, what, kind) in enumerate(steps):
            if who != me:
                continue
            go[i].wait(10)
            if what == "enter":
                open_[kind] = (kernels.onednn_off if kind == "off" else kernels.onednn_on)()
                open_[kind].__enter__()
            else:
                open_.pop(kind).__exit__(None, None, None)
            seen.append(torch._C._get_mkldnn_enabled())
            done[i].set()

    threads = [threading.Thread(target=worker, args=(t,)) for t in (0, 1)]
    for t in threads:
        t.start()
    for i in range(len(steps)):
        go[i].set()
        assert done[i].wait(10)
    for t in threads:
        t.join(10)
    return seen


@pytest.mark.parametrize("order", ["A in, B in, A out, B out", "A in, B in, B out, A out", "A off, B on, A out, B out"])
def test_overlapping_onednn_regions_in_two_threads_restore_the_switch(order):
    """Two engines' workers switch oneDNN off around their small bf16 frames at the same time (and on for _int_mm
    inside them): however their regions overlap, oneDNN is off while any wants it off and none on, and back on
    after the last. (A save-and-restore per region left it off for the rest of the process in the first order.)"""
    steps = {"A in, B in, A out, B out": [(0, "enter", "off"), (1, "enter", "off"), (0, "leave", "off"),
                                          (1, "leave", "off")],
             "A in, B in, B out, A out": [(0, "enter", "off"), (1, "enter", "off"), (1, "leave", "off"),
                                          (0, "leave", "off")],
             "A off, B on, A out, B out": [(0, "enter", "off"), (1, "enter", "on"), (0, "leave", "off"),
                                           (1, "leave", "on")]}[order]
    before = torch._C._get_mkldnn_enabled()
    try:
        torch._C._set_mkldnn_enabled(True)
        seen = _in_threads(steps)
        want = {"A in, B in, A out, B out": [False, False, False, True],
                "A in, B in, B out, A out": [False, False, False, True],
                "A off, B on, A out, B out": [False, True, True, True]}[order]
        assert seen == want
        assert torch._C._get_mkldnn_enabled() is True
    finally:
        torch._C._set_mkldnn_enabled(before)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_convs_ignore_the_process_wide_onednn_switch(dtype):
    """The worker turns oneDNN off process-wide around small bf16 gemvs (`aten_bf16_gemv`); a codec decode on
    the codec thread meanwhile must still run oneDNN's kernels (aten's fallbacks are up to 200x slower), and give
    the same audio."""
    from torch.profiler import ProfilerActivity, profile

    from tts_engine.codec.decoder import CodecDecoder, CodecDecoderConfig
    from tts_engine.tiny import tiny_speech_tokenizer_config

    torch.manual_seed(0)
    dec = CodecDecoder(CodecDecoderConfig.from_dict(tiny_speech_tokenizer_config()["decoder_config"])).to(dtype).eval()
    codes = torch.randint(0, 2048, (1, 16, 3), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = dec(codes)
        prev = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                got = dec(codes)
        finally:
            torch._C._set_mkldnn_enabled(prev)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::mkldnn_convolution" in ops
    assert not [o for o in ops if "slow_conv" in o or "thnn" in o or "conv_transpose" in o], ops
    assert torch.equal(got, want)


def test_onednn_outside_is_the_process_setting_whatever_another_thread_holds():
    """`kernels.onednn_outside`: what the switch is outside every thread's region, also while another thread (another
    engine's worker) holds oneDNN off."""
    import threading

    from tts_engine.cpu import kernels

    before = torch._C._get_mkldnn_enabled()
    inside, leave = threading.Event(), threading.Event()

    def other():
        with kernels.onednn_off():
            inside.set()
            leave.wait(10)

    try:
        torch._C._set_mkldnn_enabled(True)
        t = threading.Thread(target=other)
        t.start()
        assert inside.wait(10)
        assert torch._C._get_mkldnn_enabled() is False and kernels.onednn_outside() is True
        leave.set()
        t.join(10)
        torch._C._set_mkldnn_enabled(False)
        assert kernels.onednn_outside() is False
    finally:
        leave.set()
        torch._C._set_mkldnn_enabled(before)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_chunks_between_the_halves_get_onednn_while_another_engine_holds_it_off(tmp_path, dtype):
    """The chunk decoded between a split frame's halves runs with oneDNN on (the codec's linear layers need it) even
    while another engine's worker holds oneDNN off for its own small bf16 frame (the runner once read the switch at
    the start of its frame, and took another engine's region for the process's setting)."""
    import threading

    from tts_engine import TTSEngine
    from tts_engine.cpu import kernels
    from tests.live_server import tiny_checkpoint

    ck = str(tiny_checkpoint(tmp_path / "cv", kind="custom_voice", size="0b6", seed=0))
    eng = TTSEngine.from_pretrained(ck, device="cpu", dtype=dtype, overlap_codec=False)
    seen, orig = [], eng.worker._between_halves

    def spy(*a):
        seen.append(torch._C._get_mkldnn_enabled())
        return orig(*a)

    eng.worker._between_halves = spy
    inside, leave = threading.Event(), threading.Event()

    def other_engine():
        with kernels.onednn_off():
            inside.set()
            leave.wait(60)

    t = threading.Thread(target=other_engine)
    t.start()
    try:
        assert inside.wait(10)
        wav = eng.synthesize("Hello there.", voice="ryan", seed=1, max_new_tokens=6)
    finally:
        leave.set()
        t.join(10)
        eng.close()
    assert wav.size > 0 and seen and all(seen), seen
