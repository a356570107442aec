"""The fused GPU frame (tts_engine/gpu/frame.py) and its installation (tts_engine/gpu/backend.py), on tiny random
checkpoints (tts_engine.tiny.make_tiny), with the Triton kernels run by Triton's interpreter on CPU tensors.

- The fused frame (talker step + 15 predictor steps + sampling from the Triton kernels) gives the eager frame's
  codes, done flags and state (pos, step, seen, c0 exact; hidden and KV caches within 1e-5) in fp32 over several
  frames: greedy at batch 1 and 4, seeded sampling with top-k/top-p, rows that are not 0..B-1, the 1.7B layout
  (a projection between the talker's and the predictor's widths), and the padded batch of a captured graph bucket
  (`cuda_graphs.EagerBuckets`: free rows, the graphs' sampler facts).
- The same structure on the eager references (no interpreter) is the eager frame exactly.
- attach: on a CPU without forcing it says why eager serves; with the interpreter it installs the fused frame
  after its checks; a kernel that disagrees leaves eager serving with one log line; a frame that raises later is
  served eagerly and the fused frame is dropped, with one log line.
- attach's remembered verdict (each such test in a fresh cache folder): an agreement remembered skips the checks and
  the trial; a changed key (the sources' hash, the dtype) runs them again; a disagreement remembered serves eager
  without running them (TTS_GPU_FRAME=check runs them again); a failure that may not repeat is not remembered.

TRITON_INTERPRET=1 is set for this module's tests only, the kernels re-imported under it (tests/test_gpu_kernels.py).
About 40-60 s of CPU here: the interpreter runs a batch-4 frame of the tiny model in ~5 s."""
from __future__ import annotations

import logging
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable: the fused GPU frame cannot be run or tested here")

from tts_engine.cpu import measured  # noqa: E402
from tts_engine.gpu import backend, ops  # noqa: E402
from tts_engine.gpu.frame import FusedFrame  # noqa: E402
from tts_engine.model.sampling import SamplingParams  # noqa: E402

from test_gpu_kernels import interpreted_kernels  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    """TRITON_INTERPRET=1 for this module only (see tests/test_gpu_kernels.py); the fused frame runs the kernels only
    where a test forces it (ops.force_interpreter, or attach(force_interpreter=True))."""
    with interpreted_kernels(), ops.force_interpreter(False):
        yield


@pytest.fixture(scope="module")
def ckpt_1b7(tmp_path_factory):
    from tts_engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("gpu_frame_17") / "cv17", kind="custom_voice", size="1b7", seed=0)


def make_runner(folder, rows: int = 6, max_len: int = 64, dtype=torch.float32):
    """A ModelRunner (fp32 unless told) over the talker of a tiny checkpoint, loaded as the engine loads it
    (load_module, the frame table), without the rest of the model (tokenizer, codec)."""
    from tts_engine.checkpoint import SafetensorsFile, build_on_meta, load_module, read_json
    from tts_engine.config import ModelConfig
    from tts_engine.engine.model_runner import ModelRunner
    from tts_engine.model.talker import Talker

    cfg = ModelConfig.from_dict(read_json(folder / "config.json")).talker
    talker = load_module(build_on_meta(lambda: Talker(cfg)), SafetensorsFile(folder / "model.safetensors"), "talker.",
                         torch.device("cpu"), dtype)
    talker.build_frame_table()
    g = torch.Generator().manual_seed(123)
    return ModelRunner(talker, torch.randn(cfg.hidden_size, generator=g), rows=rows, max_len=max_len,
                       eos_id=cfg.codec_eos_token_id)


from bench.gpu_frame import STATE  # noqa: E402


def prepare(run, rows: list[int], greedy: bool = True, seed: int = 0):
    """Rows mid-generation: random caches up to odd lengths (3, 10, 17, 33, ...), random hidden/c0/seen, a few text
    tokens left on some rows, per-row sampling settings."""
    g = torch.Generator().manual_seed(seed)
    lens = [3, 10, 17, 33, 7, 1]
    D = run.hidden.shape[1]
    for n, i in enumerate(rows):
        p = (SamplingParams(do_sample=False, subtalker_dosample=False) if greedy else
             SamplingParams(seed=7 * i + seed, top_k=[50, 10, 0][n % 3], top_p=[1.0, 0.9, 0.8][n % 3],
                            subtalker_top_k=[50, 3, 20][n % 3], subtalker_top_p=[0.95, 1.0, 0.7][n % 3]))
        run._write_params(i, p)
        L = lens[n % len(lens)]
        run.cache.k[:, i, :, :L] = torch.randn(run.cache.k[:, i, :, :L].shape, generator=g)
        run.cache.v[:, i, :, :L] = torch.randn(run.cache.v[:, i, :, :L].shape, generator=g)
        run.pos[i], run.host_len[i], run.step[i], run.max_new[i] = L, L, 1 + n, 100
        run.hidden[i] = torch.randn(D, generator=g) * 2
        run.c0[i] = int(torch.randint(0, 2048, (1,), generator=g))
        run.seen[i] = torch.rand(run.seen.shape[1], generator=g) < 0.01
        run._set_trailing(i, torch.randn(int(torch.randint(0, 4, (1,), generator=g)), D, generator=g))


from bench.gpu_frame import restore, snapshot  # noqa: E402  (the prepared GPU run's own state copies)


def frames(run, rows: list[int], n: int):
    codes, dones = [], []
    for _ in range(n):
        c, d = run.decode(rows)
        codes.append(c)
        dones.append(d)
    return torch.stack(codes, 1), torch.stack(dones, 1)


def compare(run, rows, n, fused_frame=None, interp=True):
    """n frames of `rows` eagerly, then fused from the same state -> asserts codes, done and state agree."""
    start = snapshot(run)
    want = frames(run, rows, n)
    after_eager = snapshot(run)
    restore(run, start)
    ff = fused_frame or FusedFrame(run)
    calls = []

    def counting(half):
        def call(*a):
            calls.append(half.__name__)
            return half(ff, *a)
        return call

    ff.predict, ff.advance = counting(FusedFrame.predict), counting(FusedFrame.advance)
    backend.install(run, ff, interp=interp)
    try:
        got = frames(run, rows, n)
        assert backend.installed(run)     # never fell back (that uninstalls it)
    finally:
        backend.uninstall(run)
    assert calls == ["predict", "advance"] * n   # the fused frame served both halves of every frame
    after_fused = snapshot(run)
    assert torch.equal(got[0], want[0]), f"codes differ:\n{got[0]}\n{want[0]}"
    assert torch.equal(got[1], want[1])
    for k in ("pos", "step", "seen", "c0", "max_new", "host_len"):
        assert after_fused[k] == after_eager[k] if k == "host_len" else torch.equal(after_fused[k], after_eager[k]), k
    for k in ("hidden", "k", "v"):
        torch.testing.assert_close(after_fused[k], after_eager[k], atol=1e-5, rtol=1e-5)
    return want


@pytest.fixture(scope="module")
def runner(tiny_cv_folder):
    return make_runner(tiny_cv_folder)


@torch.inference_mode()
@pytest.mark.parametrize("rows,n", [([0], 3), ([0, 1, 2, 3], 2)], ids=["batch1", "batch4"])
def test_fused_frame_greedy_codes_equal_eager(runner, rows, n):
    prepare(runner, rows, greedy=True, seed=len(rows))
    want = compare(runner, rows, n)
    assert (want[0][:, :, 1:] != want[0][:, :1, 1:]).any()   # the frames differ from each other (not a constant)


@torch.inference_mode()
def test_a_row_alone_and_in_a_batch_with_key_splits(tiny_cv_folder):
    """Row 0 alone (batch 1) and among four rows (batch 4) from the same state, over ~300 cached positions so the
    talker's decode attention splits its keys (`ops.attention_splits` > 1; the other tests' short caches never do):
    the fused frame gives row 0 the same codes either way and the eager frame's (fp32), with hidden states within
    1e-5. (A batch-1-only path - row indexing, the sampler at B=1, the frame embedding, the split count - would
    part them.)"""
    from bench.gpu_frame import prepare as prepare_long

    run = make_runner(tiny_cv_folder, rows=4, max_len=400)
    prepare_long(run, 4, 300)
    Hkv = run.talker.model.layers[0].self_attn.n_kv
    assert ops.attention_splits(1, Hkv, 301) > 1 and ops.attention_splits(4, Hkv, 310) > 1
    start = snapshot(run)
    eager_rows = frames(run, [0, 1, 2, 3], 2)
    restore(run, start)
    eager_alone = frames(run, [0], 2)
    hidden_alone = run.hidden[0].clone()
    restore(run, start)
    assert torch.equal(eager_alone[0][0], eager_rows[0][0])
    backend.install(run, FusedFrame(run), interp=True)
    try:
        fused_rows = frames(run, [0, 1, 2, 3], 2)
        restore(run, start)
        fused_alone = frames(run, [0], 2)
        assert backend.installed(run)
    finally:
        backend.uninstall(run)
    assert torch.equal(fused_alone[0][0], fused_rows[0][0]) and torch.equal(fused_alone[0][0], eager_alone[0][0])
    assert torch.equal(fused_rows[0], eager_rows[0]) and torch.equal(fused_rows[1], eager_rows[1])
    torch.testing.assert_close(run.hidden[0], hidden_alone, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_fused_frame_seeded_sampling_equal_eager(runner):
    """Per-row seeds, top-k 50/10, top-p 1/0.9 (predictor: 50/3, 0.95/1): the same draws."""
    prepare(runner, [0, 1], greedy=False, seed=5)
    compare(runner, [0, 1], 2)


@torch.inference_mode()
def test_fused_frame_rows_not_dense(runner):
    """Rows 1 and 4 (ModelRunner._frame_rows: an index tensor for the caches and the state)."""
    prepare(runner, [1, 4], greedy=True, seed=9)
    compare(runner, [1, 4], 1)


@torch.inference_mode()
def test_fused_frame_1b7_layout(ckpt_1b7):
    """The 1.7B layout: small_to_mtp_projection (talker width 64 -> predictor width 32) before every predictor step."""
    run = make_runner(ckpt_1b7, rows=2)
    assert FusedFrame(run).proj is not None
    prepare(run, [0], greedy=True, seed=3)
    compare(run, [0], 2)


@torch.inference_mode()
def test_fused_frame_in_a_padded_graph_bucket(runner):
    """The graphs' computation without graphs (cuda_graphs.EagerBuckets): 3 rows run as a batch of 4 (a free row),
    over the length bucket, with the captured sampler facts (any sampling, top-k <= 64, top-p)."""
    from tts_engine.engine.cuda_graphs import EagerBuckets

    for i in range(runner.rows):
        runner.release(i)
    prepare(runner, [0, 1, 2], greedy=True, seed=11)
    runner.graphs = EagerBuckets(runner)
    try:
        compare(runner, [0, 1, 2], 1)
    finally:
        runner.graphs = None


@torch.inference_mode()
def test_the_same_structure_on_the_references_is_the_eager_frame(runner):
    """Without the interpreter every op runs its eager reference: the fused frame's structure (stacked weights, the
    frame table, the sampler's epilogues) then gives the eager frame's numbers."""
    prepare(runner, [0, 1, 2, 3], greedy=False, seed=2)
    with ops.force_interpreter(False):
        assert not ops.use_triton(runner.hidden)
    compare(runner, [0, 1, 2, 3], 3, interp=False)


# --- attach ---------------------------------------------------------------------------------------------------------
def fresh_choices(monkeypatch, tmp_path):
    """A fresh cache folder for remembered choices (after the test's runners are made: their CPU trials stay where
    they are remembered)."""
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))


def count_checks(monkeypatch) -> dict:
    """Count the calls of attach's kernel checks and frame trial (each still runs)."""
    calls = {"check_kernels": 0, "frame_trial": 0}
    for name in calls:
        real = getattr(backend, name)

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)

        monkeypatch.setattr(backend, name, counted)
    return calls


@torch.inference_mode()
def test_attach_without_cuda_leaves_eager(runner, monkeypatch):
    got = backend.attach(runner)
    assert got == {"gpu frame": "eager (no CUDA: the fused frame's Triton kernels run on a GPU)"}
    assert got.path_entries() == {"gpu frame": {"path": "eager", "how": "default",
                                                "why": "no CUDA: the fused frame's Triton kernels run on a GPU"}}
    assert not backend.installed(runner)
    monkeypatch.setenv(backend.ENV, "0")
    got = backend.attach(runner, force_interpreter=True)
    assert got == {"gpu frame": "eager (TTS_GPU_FRAME=0)"}
    assert got.path_entries()["gpu frame"]["how"] == "forced by a variable"
    assert not backend.installed(runner)


@torch.inference_mode()
def test_attach_installs_the_fused_frame_after_its_checks(tiny_cv_folder, caplog, monkeypatch, tmp_path):
    run = make_runner(tiny_cv_folder, rows=3)
    fresh_choices(monkeypatch, tmp_path)
    prepare(run, [0, 1], greedy=True, seed=4)
    start = snapshot(run)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        status = backend.attach(run, force_interpreter=True)
    assert status["gpu frame"] == "fused (Triton kernels, Triton interpreter on CPU tensors)", status
    trial = status["gpu frame trial"]
    assert trial.startswith("greedy: same codes") and "sampled: same codes" in trial, trial
    entry = status.path_entries()["gpu frame"]     # (what a runner that records its backend reports)
    assert entry["path"] == "fused" and entry["how"] == "measured now" and trial in entry["why"]
    assert not caplog.records
    after = snapshot(run)   # the trial put every tensor it touched back
    for k in STATE + ("k", "v"):
        assert torch.equal(after[k], start[k]), k
    assert backend.installed(run)
    got = frames(run, [0, 1], 1)
    backend.uninstall(run)
    restore(run, start)
    want = frames(run, [0, 1], 1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@torch.inference_mode()
def test_attach_in_bf16(tiny_cv_folder, caplog, monkeypatch, tmp_path):
    """bf16: the kernel checks within bf16 tolerances, and the trial's talker step (fed the eager frame's codes) within
    5e-2 of eager's hidden; how many of the trial's codes agree is reported, not required (observed: 16/16 greedy).
    A verdict remembered for the same model in fp32 is not this one's (the dtype is in the key): the checks run, and
    their verdict is remembered for the next bf16 attach."""
    run = make_runner(tiny_cv_folder, rows=1, dtype=torch.bfloat16)
    fp32_key = backend.verdict_key(make_runner(tiny_cv_folder, rows=1), interp=True)
    fresh_choices(monkeypatch, tmp_path)
    key = backend.verdict_key(run, interp=True)
    assert key["dtype"] == "bfloat16" and fp32_key["dtype"] == "float32"
    assert {k for k in key if key[k] != fp32_key[k]} == {"dtype", "shapes"}   # (the shapes' hash holds the dtype)
    measured.remember(measured.path_for(backend.FOLDER, fp32_key), fp32_key, "fused", "fp32's verdict")
    calls = count_checks(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        status = backend.attach(run, force_interpreter=True)
    assert status["gpu frame"].startswith("fused"), status
    assert calls == {"check_kernels": 1, "frame_trial": 1}
    trial = status["gpu frame trial"]
    assert trial.startswith("greedy: ") and "codes equal, talker hidden rel. error" in trial, trial
    assert not caplog.records
    backend.uninstall(run)
    again = backend.attach(run, force_interpreter=True)
    assert calls == {"check_kernels": 1, "frame_trial": 1} and again.entry()["how"] == "remembered", again
    assert trial in again.entry()["why"] and backend.installed(run)
    backend.uninstall(run)


@torch.inference_mode()
def test_a_remembered_agreement_skips_the_checks_and_a_changed_key_runs_them(tiny_cv_folder, monkeypatch, tmp_path,
                                                                             caplog):
    """The first attach checks and remembers; a second runner of the same model (a new worker) attaches at once, its
    `paths()` entry "remembered", and serves the fused frame (the eager frame's codes; a frame that raises later
    still falls back with one log line); a change of the gpu/ or model/ sources (their hash) checks again."""
    first, second = make_runner(tiny_cv_folder, rows=2), make_runner(tiny_cv_folder, rows=2)
    fresh_choices(monkeypatch, tmp_path)
    calls = count_checks(monkeypatch)
    status = backend.attach(first, force_interpreter=True)
    assert status.entry()["how"] == "measured now" and calls == {"check_kernels": 1, "frame_trial": 1}, status
    backend.uninstall(first)
    assert len(list((tmp_path / backend.FOLDER).glob("*.json"))) == 1

    prepare(second, [0, 1], greedy=True, seed=8)
    start = snapshot(second)
    want = frames(second, [0, 1], 2)
    restore(second, start)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        got_status = backend.attach(second, force_interpreter=True)
    assert calls == {"check_kernels": 1, "frame_trial": 1}              # neither ran again
    entry = got_status.entry()
    assert entry["path"] == "fused" and entry["how"] == "remembered", entry
    assert status["gpu frame trial"] in entry["why"] and backend.installed(second)
    got = frames(second, [0, 1], 2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not caplog.records

    real = ops.silu_mul

    def boom(gu, impl=None):
        if impl != "eager" and ops.use_triton(gu, impl):
            raise RuntimeError("no kernel image for this device")
        return real(gu, impl)

    monkeypatch.setattr(ops, "silu_mul", boom)
    restore(second, start)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        got = frames(second, [0, 1], 1)
    assert torch.equal(got[0], want[0][:, :1])
    assert len(caplog.records) == 1 and "no kernel image" in caplog.records[0].getMessage()
    assert not backend.installed(second) and got_status.entry()["how"] == "fell back"

    monkeypatch.setattr(ops, "silu_mul", real)
    monkeypatch.setattr(backend, "_sources_hash", "another version")
    status = backend.attach(first, force_interpreter=True)
    assert calls == {"check_kernels": 2, "frame_trial": 2} and status.entry()["how"] == "measured now", status
    backend.uninstall(first)


def disagreeing_silu_mul(monkeypatch):
    """ops.silu_mul's Triton kernel made 1 % off its eager reference (the eager path untouched) -> the real one."""
    real = ops.silu_mul

    def wrong(gu, impl=None):
        out = real(gu, impl)
        return out if impl == "eager" or not ops.use_triton(gu, impl) else out * 1.01

    monkeypatch.setattr(ops, "silu_mul", wrong)
    return real


@torch.inference_mode()
def test_a_remembered_disagreement_serves_eager_without_checking(runner, monkeypatch, tmp_path, caplog):
    """A kernel that disagrees: eager, remembered; the next attach serves eager at once (no checks, no log line), its
    entry "remembered" with the first reason; TTS_GPU_FRAME=check runs the checks again (now they pass: fused,
    remembered in its place)."""
    fresh_choices(monkeypatch, tmp_path)
    real = disagreeing_silu_mul(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        status = backend.attach(runner, force_interpreter=True)
    assert status.entry()["how"] == "fell back" and len(caplog.records) == 1
    monkeypatch.setattr(ops, "silu_mul", real)
    calls = count_checks(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        again = backend.attach(runner, force_interpreter=True)
    assert calls == {"check_kernels": 0, "frame_trial": 0} and not caplog.records
    entry = again.entry()
    assert entry["path"] == "eager" and entry["how"] == "remembered", entry
    assert "silu_mul (talker) disagrees with eager" in entry["why"] and not backend.installed(runner)
    monkeypatch.setenv(backend.ENV, "check")
    checked = backend.attach(runner, force_interpreter=True)
    assert calls == {"check_kernels": 1, "frame_trial": 1} and checked.entry()["how"] == "measured now", checked
    backend.uninstall(runner)
    monkeypatch.delenv(backend.ENV)
    last = backend.attach(runner, force_interpreter=True)
    assert calls["check_kernels"] == 1 and last.entry() == {**checked.entry(), "how": "remembered"}
    backend.uninstall(runner)


@torch.inference_mode()
def test_a_failure_that_may_not_repeat_is_not_remembered(runner, monkeypatch, tmp_path, caplog):
    """Out of memory (or a CUDA error of the moment) during the checks: eager with one log line, nothing remembered,
    so the next attach checks again."""
    fresh_choices(monkeypatch, tmp_path)
    tries = []

    def oom(*a):
        tries.append(1)
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(backend, "check_kernels", oom)
    for n in (1, 2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tts_engine"):
            status = backend.attach(runner, force_interpreter=True)
        assert status.entry()["how"] == "fell back" and "out of memory" in status.entry()["why"]
        assert len(tries) == n and len(caplog.records) == 1
    assert not list(tmp_path.glob("**/*.json")) and not backend.installed(runner)


@torch.inference_mode()
def test_attach_falls_back_on_a_kernel_that_disagrees(runner, monkeypatch, caplog, tmp_path):
    fresh_choices(monkeypatch, tmp_path)
    disagreeing_silu_mul(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        status = backend.attach(runner, force_interpreter=True)
    assert status["gpu frame"].startswith("eager (AssertionError: silu_mul (talker) disagrees with eager"), status
    assert status.path_entries()["gpu frame"]["how"] == "fell back"
    assert len(caplog.records) == 1 and "the eager frame serves" in caplog.records[0].getMessage()
    assert not backend.installed(runner)


@torch.inference_mode()
def test_a_frame_that_raises_is_served_eagerly_and_the_fused_frame_dropped(runner, caplog):
    prepare(runner, [0], greedy=True, seed=6)
    start = snapshot(runner)
    want = frames(runner, [0], 1)
    restore(runner, start)
    ff = FusedFrame(runner)

    def boom(*a, **k):
        raise RuntimeError("no kernel image for this device")

    ff.predict = boom
    backend.install(runner, ff)
    with caplog.at_level(logging.WARNING, logger="tts_engine"):
        got = frames(runner, [0], 1)
    assert torch.equal(got[0], want[0])
    assert len(caplog.records) == 1 and "no kernel image" in caplog.records[0].getMessage()
    assert not backend.installed(runner) and runner.gpu_frame is None


@torch.inference_mode()
def test_launches_per_frame(runner):
    """The fused frame's launch count (`python -m bench gpu_frame` reports it on a GPU): per decoder layer 5
    Triton kernels (add+RMSNorm x2, q/k norm+RoPE+KV write, attention, SiLU*up) and 4 GEMMs; per predictor step one
    more norm, one head GEMM and one sampler; the talker step adds the frame embedding, its first norm, the codec head
    and its sampler; a few aten ops per frame prepare the predictor's input. The eager frame (fp32, CPU) is counted
    beside it."""
    from bench.gpu_frame import count_launches

    prepare(runner, [0], greedy=True, seed=1)
    eager = count_launches(runner, 1)
    install_ff = FusedFrame(runner)
    backend.install(runner, install_ff, interp=True)
    try:
        count_launches(runner, 1)            # (the first frame also builds the predictor's 15 position sets)
        fused = count_launches(runner, 1)
    finally:
        backend.uninstall(runner)
    Lt, Lc = len(runner.talker.model.layers), len(runner.talker.code_predictor.model.layers)
    steps = runner.n_books - 1
    assert fused["triton"] == steps * (1 + 5 * Lc + 1) + (3 + 5 * Lt), fused
    gemms = steps * (4 * Lc + 1) + 4 * Lt + 1
    assert gemms <= fused["aten"] <= gemms + 8, fused
    assert eager["aten"] > 4 * fused["total"], (eager, fused)


def test_a_space_with_persistent_storage_keeps_tritons_kernels_there(monkeypatch, tmp_path):
    """On a Space with /data, Triton's compiled kernels go to <data>/triton (with the remembered verdicts), so a
    restarted Space finds both; TRITON_CACHE_DIR set by the owner wins; elsewhere Triton's default stays."""
    import triton

    from tts_engine import cache_paths

    monkeypatch.setenv("TRITON_CACHE_DIR", "unused")   # (so that monkeypatch puts the variable back as it was)
    monkeypatch.delenv("TRITON_CACHE_DIR")
    default = triton.knobs.cache.dir
    monkeypatch.setattr(cache_paths, "persistent_root", lambda: None)
    backend.keep_triton_cache()
    assert triton.knobs.cache.dir == default and "TRITON_CACHE_DIR" not in os.environ
    monkeypatch.setattr(cache_paths, "persistent_root", lambda: tmp_path / "qwen3-tts-live")
    backend.keep_triton_cache()
    assert triton.knobs.cache.dir == str(tmp_path / "qwen3-tts-live" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "own"))
    backend.keep_triton_cache()
    assert triton.knobs.cache.dir == str(tmp_path / "own")
