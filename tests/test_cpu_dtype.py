"""The engine's CPU dtype choice when none is given: bf16 where the CPU has native bf16 (AVX-512 BF16 / AMX),
fp32 otherwise; TTS_CPU_DTYPE overrides; an explicit dtype always wins."""
from __future__ import annotations

import pytest
import torch

from tts_engine.errors import TTSError
from tts_engine import loader as q

CPU = torch.device("cpu")


@pytest.mark.parametrize("flags, onednn, want", [
    ({"avx2", "avx512f", "avx512_bf16"}, True, torch.bfloat16),
    ({"avx2", "amx_bf16", "amx_tile"}, True, torch.bfloat16),
    ({"avx2", "avx512f", "avx512_vnni"}, True, torch.float32),     # AVX-512 without bf16: emulated, slower
    ({"avx2", "avx512_bf16"}, False, torch.float32),               # oneDNN cannot use it
    (set(), True, torch.float32),                                  # no /proc/cpuinfo
])
def test_auto_choice_follows_cpu_flags(monkeypatch, flags, onednn, want):
    monkeypatch.setenv(q.CPU_DTYPE_ENV, "auto")
    monkeypatch.setattr(q, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    assert q.default_dtype(CPU) == want
    assert q.default_dtype(torch.device("cuda")) == torch.bfloat16


def test_env_override_and_bad_value(monkeypatch):
    monkeypatch.setattr(q, "cpu_flags", lambda: {"avx512_bf16"})
    monkeypatch.setenv(q.CPU_DTYPE_ENV, "fp32")
    assert q.default_dtype(CPU) == torch.float32
    monkeypatch.setattr(q, "cpu_flags", lambda: set())
    monkeypatch.setenv(q.CPU_DTYPE_ENV, "bf16")
    assert q.default_dtype(CPU) == torch.bfloat16
    monkeypatch.setenv(q.CPU_DTYPE_ENV, "fp16")
    with pytest.raises(TTSError):
        q.default_dtype(CPU)


def test_cpu_flags_reads_proc_cpuinfo():
    flags = q.cpu_flags()
    assert isinstance(flags, set)
    if flags:   # Linux: the usual baseline flags are there
        assert "fpu" in flags


def test_engine_reports_auto_choice(monkeypatch, tmp_path):
    from tts_engine.engine.engine import TTSEngine
    from tts_engine.tiny import make_tiny

    ck = tmp_path / "cv"
    make_tiny(ck, kind="custom_voice")
    monkeypatch.setenv(q.CPU_DTYPE_ENV, "auto")
    monkeypatch.setattr(q, "cpu_has_fast_bf16", lambda: True)
    eng = TTSEngine.from_pretrained(str(ck), device="cpu", max_batch=1)
    try:
        assert eng.model.dtype == torch.bfloat16 and eng.model.dtype_auto
        assert eng.runner.dtype == torch.bfloat16
        assert eng.model.speech_tokenizer.decoder.pre_conv.conv.weight.dtype == torch.bfloat16
        assert len(eng.synthesize("Hi.", voice=eng.speakers[0], greedy=True, max_new_tokens=3)) > 0
    finally:
        eng.close()
    eng = TTSEngine.from_pretrained(str(ck), device="cpu", dtype="fp32", max_batch=1)   # explicit wins
    try:
        assert eng.model.dtype == torch.float32 and not eng.model.dtype_auto
    finally:
        eng.close()
