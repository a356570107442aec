"""The per-frame OpenMP thread choice (`tts_engine/cpu/threads.py`): the governor follows measured frame times (and
explores the options it does not use, backing off while they keep losing), the "matmul" option runs only the linear
layers with several threads, and an engine with the governor on gives the same codes as one without it."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from tts_engine import TTSEngine
from tts_engine.cpu.threads import MATMUL, PREDICTOR, TALKER, ThreadGovernor, serial_between_matmuls, situation
from tts_engine.tiny import make_tiny


def _drive(g, key, cost, frames):
    """Run `frames` frames where option o takes cost[o] seconds; -> the options chosen, in order."""
    chosen = []
    for _ in range(frames):
        o = g.choose(key)
        chosen.append(o)
        g.record(key, o, cost[o])
    return chosen


def test_governor_picks_the_faster_option_and_follows_a_change():
    g = ThreadGovernor(threads=2, matmul_option=True, explore_every=4, max_interval=32, warm_frames=2)
    assert g.options == [1, 2, MATMUL]
    key = (1, False)
    busy = {1: 0.27, 2: 0.57, MATMUL: 0.45}          # another process keeps a core busy: one thread wins
    chosen = _drive(g, key, busy, 200)
    assert set(chosen[:6]) == {1, 2, MATMUL}          # each option measured first
    assert g.best(key) == 1
    tail = chosen[-100:]
    assert tail.count(1) >= 90                        # explorations back off while they keep losing
    assert 2 in tail or MATMUL in tail                # ... but never stop
    quiet = {1: 0.27, 2: 0.20, MATMUL: 0.21}          # the load goes away: 2 threads win again
    chosen = _drive(g, key, quiet, 300)
    assert g.best(key) == 2 and chosen[-50:].count(2) >= 40


def test_situations_are_measured_apart():
    g = ThreadGovernor(threads=2, explore_every=4, warm_frames=1)
    _drive(g, (4, False), {1: 0.5, 2: 0.3}, 40)
    _drive(g, (4, True), {1: 0.3, 2: 0.6}, 40)
    assert g.best((4, False)) == 2 and g.best((4, True)) == 1
    assert set(g.snapshot()) == {(4, False), (4, True)}


def test_one_thread_machine_has_nothing_to_choose():
    g = ThreadGovernor(threads=1, matmul_option=True)
    assert not g.enabled and g.options == [1] and g.choose((1, False)) == 1


def test_matmul_option_threads_only_the_linear_layers():
    seen = {}

    class Probe(nn.Module):
        def forward(self, x):
            seen["outside"] = torch.get_num_threads()
            return x

    class ProbeLinear(nn.Linear):
        def forward(self, x):
            seen["inside"] = torch.get_num_threads()
            return super().forward(x)

    model = nn.Sequential(ProbeLinear(4, 4), Probe())
    switch = serial_between_matmuls(model, 2)
    serial_between_matmuls(model, 2)                  # idempotent: not wrapped twice
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        switch.set(True)
        model(torch.ones(1, 4))
        assert seen == {"inside": 2, "outside": 1} and torch.get_num_threads() == 1
        other = {}
        t = threading.Thread(target=lambda: other.setdefault("serial", switch.serial))
        t.start()
        t.join()
        assert other["serial"] is False               # the switch is per thread
        switch.set(False)
        model(torch.ones(1, 4))
        assert seen["inside"] == 1                    # off: the layer runs with the thread's own count
    finally:
        switch.set(False)
        torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("gov") / "cv", kind="custom_voice", size="0b6", seed=0)


def test_governed_engine_gives_the_same_codes(folder):
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plain = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="bf16", max_batch=2, govern_threads=False)
        gov = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="bf16", max_batch=2, govern_threads=True)
        assert plain.worker.governor is None and gov.worker.governor is not None
        assert gov.worker.governor.options == [1, 2, MATMUL]
        for kw in (dict(seed=3), dict(seed=4, greedy=True)):
            a = plain.stream("Hello there, a governed test.", voice="ryan", max_new_tokens=24, **kw)
            b = gov.stream("Hello there, a governed test.", voice="ryan", max_new_tokens=24, **kw)
            list(a), list(b)
            assert len(b.codes) > 4 and torch.equal(a.codes, b.codes)
        counts = {o: n for opts in gov.thread_choice.values() for o, (_, n) in opts.items()}
        assert set(counts) == {1, 2, MATMUL}          # every option ran frames and was timed
        assert torch.get_num_threads() == 2           # the process default is untouched
        # two bf16 engines switched oneDNN off around their frames at once: it is back as it was
        assert torch._C._get_mkldnn_enabled() == torch.backends.mkldnn.is_available()
        fp32 = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="fp32", max_batch=1)
        assert fp32.worker.governor is None           # fp32 keeps the process's threads (bit-for-bit parity)
        for e in (plain, gov, fp32):
            e.close()
    finally:
        torch.set_num_threads(prev)


class _ByPart(ThreadGovernor):
    """A governor that answers by the situation's part (predictor half: 1 thread; talker half: 2; whole frame: 2)."""

    def choose(self, key):
        super().choose(key)
        return 1 if key[-1] == PREDICTOR else 2


def test_split_frame_halves_are_chosen_and_timed_apart(folder):
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = TTSEngine.from_pretrained(str(folder), device="cpu", dtype="bf16", max_batch=2, govern_threads=True)
        w, r = engine.worker, engine.runner
        assert w.split_frames
        w.governor = _ByPart(2, matmul_option=True)
        seen = {"predictor": [], "talker": []}
        pred, adv = r._predict_residuals, r._advance

        def predict(*a, **k):
            seen["predictor"].append(torch.get_num_threads())
            return pred(*a, **k)

        def advance(*a, **k):
            seen["talker"].append(torch.get_num_threads())
            return adv(*a, **k)

        r._predict_residuals, r._advance = predict, advance
        s = engine.stream("Hello there, a governed test.", voice="ryan", max_new_tokens=12, seed=1,
                          sampling={"ignore_eos": True})
        list(s)
        frames = len(s.codes)
        assert frames >= 10
        assert seen["predictor"] == [1] * frames          # each half ran with its own part's choice
        assert seen["talker"] == [2] * frames
        snap = engine.thread_choice
        parts = {k[2] for k in snap}
        assert parts == {PREDICTOR, TALKER}               # no whole-frame keys for split frames
        per_part = {p: sum(n for k, opts in snap.items() if k[2] == p for _, n in opts.values()) for p in parts}
        assert per_part[PREDICTOR] == per_part[TALKER] == frames   # every frame's two halves timed
        assert torch.get_num_threads() == 2
        engine.close()
    finally:
        torch.set_num_threads(prev)


def test_situation_keys():
    assert situation(1, False) == (1, False) and situation(3, True) == (4, True)
    assert situation(2, True, TALKER) == (1, True, TALKER)
