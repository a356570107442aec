"""Matmul kernels chosen by measurement (tts_engine/cpu/kernels.py), the W8A8 mode (quant.W8A8Linear) and
quantize="auto" (tts_engine/cpu/auto_precision.py).

The table: measured once, written under the cache folder, read back without measuring; another machine's file is
ignored; a failing candidate is left out and all failing leaves the default. W8A8 matches a float reference within
a stated bound, its rows are independent, its candidates agree, and it runs under the runner's oneDNN switch. auto
picks the fastest mode of the table among those whose quality is acceptable. No timing is asserted: where an order
matters, made-up times are written into the table."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tts_engine.model import quant
from tts_engine.cpu import auto_precision
from tts_engine.cpu import kernels
from tts_engine.model.quant import QUANT_MODES, W8A8Linear, precision_label, quantize_linear


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(kernels.TUNE_ENV, raising=False)
    monkeypatch.setattr(kernels, "ROTATE_MIN_BYTES", 4 << 20)   # small scratch buffers: tests time nothing
    monkeypatch.setattr(kernels, "ROTATE_MAX_BYTES", 4 << 20)
    kernels.reset_kernel_table()
    yield tmp_path
    kernels.reset_kernel_table()


def test_measured_once_then_read_back(cache, monkeypatch):
    t = kernels.KernelTable()
    assert t.path.is_relative_to(cache / "kernels")
    assert t.ensure("w8a8", [(64, 128), (32, 64)]) == 2 * len(kernels.ROW_BUCKETS)
    e = t.lookup("w8a8", 64, 128, 1)
    names = set(kernels.FORMATS["w8a8"].candidates)   # + our own "vnni" where it builds and the CPU has VNNI
    assert {"int_mm", "int8pack_a8"} <= names and e["winner"] in names and set(e["us"]) == names
    data = json.loads(t.path.read_text())
    assert data["machine"]["torch"] == torch.__version__ and data["machine"]["threads"] == torch.get_num_threads()
    assert data["entries"][t.entry_key("w8a8", 64, 128, 1)]["winner"] == e["winner"]

    monkeypatch.setattr(kernels, "time_candidates", lambda *a, **k: pytest.fail("measured again"))
    again = kernels.KernelTable()
    assert again.ensure("w8a8", [(64, 128), (32, 64)]) == 0
    assert again.choice("w8a8", 64, 128, 1) == e["winner"] and again.choice("w8a8", 32, 64, 3) == \
        t.choice("w8a8", 32, 64, 4)


def test_another_cpus_table_is_ignored(cache, monkeypatch):
    t = kernels.KernelTable()
    t.entries[t.entry_key("w8a8", 16, 32, 1)] = {"winner": "int8pack_a8", "us": {"int8pack_a8": 1.0}}
    t.save()
    assert kernels.KernelTable().choice("w8a8", 16, 32) == "int8pack_a8"     # this machine: read back
    other = dict(t.key, cpu=dict(t.key["cpu"], model_name="Some Other CPU", model="999"))
    assert kernels.table_path(other) != t.path
    # another CPU's file, even at this machine's path, is not used
    t.path.write_text(json.dumps({"machine": other, "entries": t.entries}))
    fresh = kernels.KernelTable()
    assert fresh.entries == {} and fresh.choice("w8a8", 16, 32) == kernels.FORMATS["w8a8"].default
    t.path.write_text("{not json")
    assert kernels.KernelTable().entries == {}


def test_a_failing_kernel_is_left_out(cache, monkeypatch, caplog):
    def broken(*a):
        raise RuntimeError("not on this CPU")

    monkeypatch.setitem(kernels.FORMATS["w8a8"].candidates, "int_mm", broken)
    t = kernels.KernelTable()
    t.ensure("w8a8", [(32, 64)])
    e = t.lookup("w8a8", 32, 64, 1)
    assert e["winner"] in ("int8pack_a8", *kernels.OWN_PACKED) and "int_mm" not in e["us"] and "int8pack_a8" in e["us"]
    for name in list(kernels.FORMATS["w8a8"].candidates):
        monkeypatch.setitem(kernels.FORMATS["w8a8"].candidates, name, broken)
    with caplog.at_level("WARNING", logger="tts_engine"):
        t.ensure("w8a8", [(48, 64)])
    assert "no w8a8 kernel ran" in caplog.text
    assert t.choice("w8a8", 48, 64) == kernels.FORMATS["w8a8"].default


def test_tuning_off_measures_nothing(cache, monkeypatch):
    monkeypatch.setenv(kernels.TUNE_ENV, "0")
    monkeypatch.setattr(kernels, "time_candidates", lambda *a, **k: pytest.fail("measured with tuning off"))
    t = kernels.KernelTable()
    assert t.ensure("w8a8", [(64, 64)]) == 0 and t.choice("w8a8", 64, 64) == "int_mm"


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_w8a8_candidates_compute_the_same_numbers(rows):
    torch.manual_seed(0)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    q = torch.randint(-127, 128, (96, 256), dtype=torch.int8)
    s127 = torch.rand(96) * 1e-4
    xq, amax = kernels.quantize_rows(x)
    assert xq.dtype == torch.int8 and xq.abs().max() == 127                  # each row uses its whole grid
    exact = (xq.double() @ q.double().T) * amax.double() * s127.double()
    y1 = kernels.w8a8_int_mm(x, q, s127, s127.to(torch.bfloat16))
    torch.testing.assert_close(y1.double(), exact, rtol=1e-6, atol=1e-6 * exact.abs().max().item())
    y2 = kernels.w8a8_int8pack(x, q, s127, s127.to(torch.bfloat16))        # bf16 result and scale: ~2^-8
    torch.testing.assert_close(y2.double(), exact, rtol=0, atol=1e-2 * exact.abs().max().item())
    with kernels.onednn_off():   # as ModelRunner runs 1-2 row bf16 frames: _int_mm still gives the same
        torch.testing.assert_close(kernels.w8a8_int_mm(x, q, s127).double(), y1.double())
        assert not torch._C._get_mkldnn_enabled()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 40])
def test_w8a8_layer_matches_a_float_reference(cache, dtype, rows):
    """Bound: per-channel int8 weights and per-row int8 activations each add ~0.3-0.5% relative error on Gaussian
    data (rounding step / sqrt(12) against the row's spread); the layer must stay within 2% of fp32 (norm of the
    error / norm of the result) and within 0.1% of the same arithmetic done in float64 from its own int8 values."""
    torch.manual_seed(1)
    lin = nn.Linear(256, 192, bias=True)
    layer = quantize_linear(lin, "w8a8")
    assert isinstance(layer, W8A8Linear) and "w8a8" in QUANT_MODES
    x = torch.randn(rows, 256)
    y = layer(x.to(dtype).reshape(1, rows, 256))
    assert y.dtype == dtype and y.shape == (1, rows, 192)
    y = y[0].double()
    ref = lin(x).double()
    assert ((y - ref).norm() / ref.norm()).item() < 0.02
    xq, amax = kernels.quantize_rows(x.to(dtype))
    own = (xq.double() @ layer.int8_weight().double().T) * amax.double() * layer.scale127.double() + lin.bias.double()
    assert ((y - own).norm() / own.norm()).item() < 1e-3 * (1 if dtype == torch.float32 else 10)
    # a row's result does not depend on the other rows of the batch (per-row activation scales)
    big = torch.cat([x[:1], 100 * x[1:]]) if rows > 1 else x
    torch.testing.assert_close(layer(big.to(dtype))[:1], layer(x[:1].to(dtype)), rtol=0, atol=1e-6)
    assert precision_label(torch.bfloat16, "w8a8") == "int8 weights x int8 activations"
    assert precision_label(torch.float32, "w8a8") == "int8 weights x int8 activations (fp32 elsewhere)"


def test_w8a8_layer_runs_the_kernel_the_table_names(cache, monkeypatch):
    t = kernels.kernel_table()
    for b in kernels.ROW_BUCKETS:
        t.entries[t.entry_key("w8a8", 32, 64, b)] = {"winner": "int8pack_a8" if b == 1 else "int_mm", "us": {}}
    calls = []
    for name in ("int_mm", "int8pack_a8"):
        real = kernels.FORMATS["w8a8"].candidates[name]
        monkeypatch.setitem(kernels.FORMATS["w8a8"].candidates, name,
                            lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    layer = W8A8Linear(nn.Linear(64, 32, bias=False))
    assert layer.kernel_names == {1: "int8pack_a8", 4: "int_mm"}
    layer(torch.randn(1, 64))
    layer(torch.randn(4, 64))
    assert calls == ["int8pack_a8", "int_mm"]


def _left_out(why: str) -> list[str]:
    """The modes auto's explanation names as left out for quality ("...; int4, w4a8 left out: ...")."""
    if " left out" not in why:
        return []
    return [m.strip() for m in why.split(" left out")[0].split(";")[-1].split(",")]


def _fake_table(times_us: dict, cfg) -> kernels.KernelTable:
    """A table whose every per-frame shape has the given made-up time per format (nothing is measured)."""
    t = kernels.KernelTable()
    for fused in (True, False):
        for N, K, _ in auto_precision.frame_shapes(cfg, fused):
            for fmt, us in times_us.items():
                name = auto_precision.DENSE_KERNEL.get(fmt, kernels.FORMATS[fmt].default)
                t.entries[t.entry_key(fmt, N, K, 1)] = {"winner": name, "us": {name: us}}
    return t


def test_auto_picks_the_fastest_mode_of_acceptable_quality(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "time_candidates", lambda *a, **k: pytest.fail("measured"))
    cfg = auto_precision.default_talker_config()
    table = _fake_table({"bf16": 40.0, "int8": 20.0, "w8a8": 10.0, "int4": 5.0}, cfg)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    # no quality record for this checkpoint: the built-in one (int4 measured below the threshold) decides
    mode, why = auto_precision.pick(torch.bfloat16, cfg, folder, table)
    assert mode == "w8a8" and "w8a8" in why and "int4" in _left_out(why)
    good = {k: 0.9999 for k in auto_precision.MIN_COS}
    bad = dict(good, cp_logits_cos_min=0.97)
    auto_precision.record_quality(folder, "w8a8", bad)
    auto_precision.record_quality(folder, "int4", good)
    assert auto_precision.pick(torch.bfloat16, cfg, folder, table)[0] == "int4"
    auto_precision.record_quality(folder, "int4", bad)
    assert auto_precision.pick(torch.bfloat16, cfg, folder, table)[0] == "int8"
    slow = _fake_table({"bf16": 1.0, "int8": 20.0, "w8a8": 10.0, "int4": 5.0}, cfg)
    assert auto_precision.pick(torch.bfloat16, cfg, folder, slow)[0] is None   # dense bf16 when it is fastest
    fp32 = _fake_table({"fp32": 1.0, "int8": 20.0}, cfg)                      # a CPU without native bf16
    assert auto_precision.pick(torch.float32, cfg, folder, fp32)[0] is None


def test_auto_measures_on_a_fresh_machine_and_says_why(cache, monkeypatch):
    """With an empty table, pick() measures the shapes it needs once (tiny shapes here), saves them, and the
    second pick reads them back."""
    from tts_engine.config import TalkerConfig
    from tts_engine.tiny import tiny_config

    ids = dict.fromkeys(("im_start_token_id", "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id",
                         "tts_eos_token_id", "text_vocab_size"), 0)
    cfg = TalkerConfig.from_dict(tiny_config("custom_voice", "0b6", ids)["talker_config"])
    mode, why = auto_precision.pick(torch.bfloat16, cfg)
    assert mode in (None, "int8", "w8a8") and "matmul time per frame" in why and "int4" in _left_out(why)
    monkeypatch.setattr(kernels, "time_candidates", lambda *a, **k: pytest.fail("measured again"))
    kernels.reset_kernel_table()
    assert auto_precision.pick(torch.bfloat16, cfg)[0] == mode


def test_constants_agree():
    assert kernels.INT4_GROUP == quant.INT4_GROUP


def test_quality_measure_fails_a_damaged_w8a8_talker(tmp_path, cache):
    """The teacher-forced measure that decides auto can fail: damaged W8A8 weights are not acceptable, the intact
    W8A8 talker is."""
    from tts_engine.cpu import talker_quality as quality
    from tts_engine.loader import Qwen3TTSModel
    from tts_engine.tiny import make_tiny

    ckpt = make_tiny(tmp_path / "cv", kind="custom_voice", seed=0)
    ref_model = Qwen3TTSModel.from_pretrained(str(ckpt), device="cpu", dtype="fp32")
    ref = quality.reference_run(ref_model, rows=2, frames=4)
    model = Qwen3TTSModel.from_pretrained(str(ckpt), device="cpu", dtype="fp32", quantize="w8a8")
    intact = quality.measure(ref, model.talker, ref_model.prompts.tts_pad, model.precision)
    assert auto_precision.acceptable(intact.as_dict())
    for m in model.talker.modules():
        if isinstance(m, W8A8Linear):
            m.set_int8_weight(torch.randint(-127, 128, (m.out_features, m.in_features), dtype=torch.int8))
    damaged = quality.measure(ref, model.talker, ref_model.prompts.tts_pad, model.precision)
    assert not auto_precision.acceptable(damaged.as_dict())


def test_w8a8_engine_speaks_and_labels_itself_lossy(tmp_path, cache):
    import numpy as np

    from tts_engine.engine.engine import TTSEngine
    from tts_engine.tiny import make_tiny

    ckpt = make_tiny(tmp_path / "cv", kind="custom_voice", seed=0)
    for dtype in ("fp32", "bf16"):
        engine = TTSEngine.from_pretrained(str(ckpt), device="cpu", dtype=dtype, quantize="w8a8", max_batch=2,
                                           max_seq_len=128)
        try:
            assert engine.lossy and engine.precision.startswith("int8 weights x int8 activations")
            talker = engine.model.talker
            assert isinstance(talker.codec_head, W8A8Linear)
            assert all(isinstance(h, W8A8Linear) for h in talker.code_predictor.lm_head)
            wav = engine.synthesize("Hello there.", voice=engine.speakers[0], seed=1, max_new_tokens=6)
            assert wav.dtype == np.float32 and wav.size > 0 and np.isfinite(wav).all()
        finally:
            engine.close()
    assert any(k.startswith("w8a8 ") for k in kernels.kernel_table().entries)   # measured at load
