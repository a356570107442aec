"""`quantize="auto"`: the fastest precision mode, on the CPU at hand, whose quality against fp32 is acceptable.

Speed: the weight reads of one frame at one stream in each mode, estimated from the kernel table
(`kernels.KernelTable`): every per-frame weight shape of the talker (read once a frame) and of the code predictor
(15 times a frame), timed with its fastest kernel of that mode on this machine, weights read from memory. The
dense mode is timed with the kernel `ModelRunner` runs for one row (PyTorch's gemv for bf16). Only the matmuls
differ between modes, so the mode with the smallest sum is the fastest; measured once per machine, remembered.

Quality: teacher forcing against fp32 (`tts_engine.cpu.talker_quality`, >= 100 frames; `python -m tts_engine.cpu.talker_quality --model
DIR` measures every lossy mode of a checkpoint and records the reports under the cache folder, `quality/`). A
mode is acceptable when every per-frame cosine (talker hidden state, codebook-0 logits, predictor logits) stays
>= MIN_COS: 0.995 sits ~50x bf16's own deviation from fp32 (>= 0.9999) above and int4's (0.987) below. Without a
record for the checkpoint the values measured on the random-weight 0.6B architecture stand in (BUILTIN_QUALITY,
docs/benchmarks.md "W8A8 and quantize=auto").
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from tts_engine.cpu import measured
from tts_engine.cpu import kernels
from tts_engine.model.quant import available_modes

log = logging.getLogger("tts_engine")

MIN_COS = {"hidden_cos_min": 0.995, "c0_logits_cos_min": 0.995, "cp_logits_cos_min": 0.995}
# measured on the random-weight 0.6B CustomVoice architecture, 100 teacher-forced frames (docs/benchmarks.md)
BUILTIN_QUALITY = {
    "int8": {"hidden_cos_min": 0.99984, "c0_logits_cos_min": 0.99984, "cp_logits_cos_min": 0.99993},
    "w8a8": {"hidden_cos_min": 0.99965, "c0_logits_cos_min": 0.99960, "cp_logits_cos_min": 0.99983},
    "int4": {"hidden_cos_min": 0.98731, "c0_logits_cos_min": 0.98587, "cp_logits_cos_min": 0.99359},
    "w4a8": {"hidden_cos_min": 0.98726, "c0_logits_cos_min": 0.98573, "cp_logits_cos_min": 0.99358},
}
MODE_FORMAT = {"int8": "int8", "w8a8": "w8a8", "int4": "int4", "w4a8": "w4a8"}
NAME = "quantize auto"   # its entry in measured.made() and TTSEngine.paths()
DENSE_KERNEL = {"bf16": "aten", "fp32": "linear"}   # what ModelRunner runs for one row of a dense engine


def acceptable(report: dict) -> bool:
    """A quality report (QualityReport.as_dict()) passes when every minimum cosine reaches MIN_COS."""
    return all(float(report.get(k, 0.0)) >= v for k, v in MIN_COS.items())


def default_talker_config():
    """The real 0.6B architecture's talker config (shapes for an estimate made before a checkpoint is read)."""
    from tts_engine.config import TalkerConfig
    from tts_engine.tiny import tiny_config

    ids = dict.fromkeys(("im_start_token_id", "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id",
                         "tts_eos_token_id", "text_vocab_size"), 0)
    return TalkerConfig.from_dict(tiny_config("custom_voice", "0b6", ids, arch="0.6b")["talker_config"])


def frame_shapes(talker_cfg, fused: bool) -> list[tuple[int, int, int]]:
    """(N, K, reads per frame) of every per-frame weight at one stream; `fused`: q/k/v and gate/up as one matmul
    each (quantised engines), else apart (dense engines)."""
    out = []
    for cfg, times in ((talker_cfg, 1), (talker_cfg.code_predictor, 15)):
        D, H, Hkv, hd, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                cfg.intermediate_size)
        L = cfg.num_hidden_layers * times
        if fused:
            out += [((H + 2 * Hkv) * hd, D, L), (2 * inter, D, L)]
        else:
            out += [(H * hd, D, L), (Hkv * hd, D, 2 * L), (inter, D, 2 * L)]
        out += [(D, H * hd, L), (D, inter, L)]
    cp = talker_cfg.code_predictor
    out.append((talker_cfg.vocab_size, talker_cfg.hidden_size, 1))           # codec_head
    out.append((cp.vocab_size, cp.hidden_size, 15))                          # one lm_head per predictor step
    if cp.hidden_size != talker_cfg.hidden_size:
        out.append((cp.hidden_size, talker_cfg.hidden_size, 15))            # small_to_mtp_projection
    return out


def estimate_frame_ms(mode: str | None, dense: str, talker_cfg, table: kernels.KernelTable) -> float | None:
    """Milliseconds of one frame's weight reads in `mode` (None: dense `dense` = "bf16" / "fp32") at one stream,
    from kernels measured here (measured now where the table lacks them). None when a shape has no kernel."""
    fused = mode is not None
    fmt = MODE_FORMAT[mode] if mode else dense
    shapes = frame_shapes(talker_cfg, fused)
    fmt_of = {}
    for N, K, _ in shapes:   # int4's kernel takes N % 16 == 0 and K % group == 0 only; other layers stay dense
        fmt_of[(N, K)] = dense if (fmt == "int4" and (N % 16 or K % kernels.INT4_GROUP)
                                    or fmt == "w4a8" and K % kernels.INT4_GROUP) else fmt
    for f in set(fmt_of.values()):
        table.ensure(f, [s for s, g in fmt_of.items() if g == f], buckets=(1,))
    total = 0.0
    for N, K, times in shapes:
        f = fmt_of[(N, K)]
        e = table.lookup(f, N, K, 1)
        us = (e or {}).get("us") or {}
        t = us.get(DENSE_KERNEL[f]) if f in DENSE_KERNEL else (min(us.values()) if us else None)
        if t is None:
            return None
        total += times * t / 1e6
    return 1000 * total


def checkpoint_id(folder: Path) -> str:
    """A checkpoint's identity for quality records: its folder, and the size and time of its weights."""
    f = Path(folder) / "model.safetensors"
    try:
        st = f.stat()
        raw = f"{f.resolve()}|{st.st_size}|{int(st.st_mtime)}"
    except OSError:
        raw = str(Path(folder).resolve())
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def quality_path(folder: Path) -> Path:
    return kernels.cache_root() / "quality" / f"{checkpoint_id(folder)}.json"


def record_quality(folder: Path, mode: str, report: dict) -> None:
    """Remember a mode's teacher-forced quality for this checkpoint (read by `pick`)."""
    p = quality_path(folder)
    data = read_quality(folder)
    data[mode] = report
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    except OSError as e:
        log.info("quality record not saved to %s: %s", p, e)


def read_quality(folder: Path | None) -> dict:
    if folder is None:
        return {}
    try:
        return json.loads(quality_path(folder).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def pick(dense: torch.dtype, talker_cfg=None, folder: Path | None = None,
         table: kernels.KernelTable | None = None) -> tuple[str | None, str]:
    """(mode, why): the fastest of the dense engine (`dense` dtype) and the lossy modes whose quality is
    acceptable for this checkpoint (recorded for `folder`, else BUILTIN_QUALITY). `why` is one line for the app's
    footer and the logs."""
    table = table or kernels.kernel_table()
    talker_cfg = talker_cfg or default_talker_config()
    timed_before, t0 = table.measured_now, time.perf_counter()
    dense_name = "bf16" if dense == torch.bfloat16 else "fp32"
    records = read_quality(folder)
    speed, rejected = {}, []
    for mode in (None,) + available_modes():
        if mode is not None:
            rep = records.get(mode) or BUILTIN_QUALITY.get(mode)
            if rep is None or not acceptable(rep):
                rejected.append(mode)
                continue
        ms = estimate_frame_ms(mode, dense_name, talker_cfg, table)
        if ms is not None:
            speed[mode] = ms
    if not speed:
        why = "no kernel timings (TTS_KERNEL_TUNE=0?): the checkpoint's own weights"
        measured.note(NAME, dense_name, measured.DEFAULT, why)
        return None, why
    best = min(speed, key=speed.get)
    ranked = ", ".join(f"{m or dense_name} {ms:.0f} ms" for m, ms in sorted(speed.items(), key=lambda kv: kv[1]))
    why = f"fastest measured here (matmul time per frame: {ranked})"
    if rejected:
        why += f"; {', '.join(rejected)} left out: quality against fp32 below cosine {min(MIN_COS.values())}"
    timed = table.measured_now - timed_before
    how = f"measured now: {timed} kernel shapes in {time.perf_counter() - t0:.1f} s" if timed else "remembered"
    why += f" ({how})"
    measured.note(NAME, best or dense_name, measured.MEASURED if timed else measured.REMEMBERED, why)
    log.info("tts_engine: quantize=auto -> %s: %s", best or dense_name, why)
    return best, why
