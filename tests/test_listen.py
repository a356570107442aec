"""serving/listen.py without the app: the statistics against known values (exact binomial p-values, Wilson and
Student-t intervals), loudness matching within 0.5 LU (ITU-R BS.1770, measured again with pyloudnorm), the anchor,
the plan (seeded per-trial shuffles, recorded and reproduced from an exported definition), the checks of
configurations and answers, the results and exports, and the pool of extra engines."""
from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pyloudnorm
import pytest

from serving import listen as ls
from tts_engine import TTSError

SR = 24000


# --- statistics -------------------------------------------------------------------------------------------

def test_binomial_p_values_are_exact():
    assert ls.abx_p_value(10, 10) == 1 / 1024
    assert ls.abx_p_value(9, 10) == 11 / 1024                 # C(10,9) + C(10,10) = 11
    assert ls.abx_p_value(8, 10) == 56 / 1024                 # 45 + 10 + 1
    assert ls.abx_p_value(5, 10) == 638 / 1024
    assert ls.abx_p_value(0, 10) == 1.0 and ls.abx_p_value(0, 0) == 1.0
    assert ls.abx_p_value(12, 16) == pytest.approx(0.0384063720703125)   # the classic 12 of 16 < 0.05
    assert ls.abx_p_value(11, 16) > 0.05
    assert ls.sign_test_p(8, 2) == 2 * 56 / 1024 and ls.sign_test_p(2, 8) == ls.sign_test_p(8, 2)
    assert ls.sign_test_p(5, 5) == 1.0 and ls.sign_test_p(0, 0) == 1.0
    assert ls.binom_sf(2, 3, 0.25) == pytest.approx(3 * 0.25**2 * 0.75 + 0.25**3)


def test_intervals_against_known_values():
    mean, lo, hi = ls.t_interval([1, 2, 3, 4, 5])
    half = 2.7764451051977987 * math.sqrt(2.5) / math.sqrt(5)          # t(0.975, 4) * s / sqrt(n)
    assert mean == 3 and lo == pytest.approx(3 - half, abs=1e-9) and hi == pytest.approx(3 + half, abs=1e-9)
    mean, lo, hi = ls.t_interval([70, 80])
    assert mean == 75 and hi - 75 == pytest.approx(12.706204736174707 * math.sqrt(50) / math.sqrt(2))
    mean, lo, hi = ls.t_interval([60])
    assert mean == 60 and math.isnan(lo) and math.isnan(hi)
    mean, lo, hi = ls.t_interval([40, 40, 40])
    assert (mean, lo, hi) == (40, 40, 40)
    lo, hi = ls.wilson_interval(8, 10)
    assert lo == pytest.approx(0.4901625, abs=1e-6) and hi == pytest.approx(0.9433178, abs=1e-6)
    assert ls.wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = ls.wilson_interval(10, 10)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(0.7224672, abs=1e-6)


# --- loudness ---------------------------------------------------------------------------------------------

def _tone(freq, amp, seconds, noise=0.0, seed=0):
    t = np.arange(int(seconds * SR)) / SR
    rng = np.random.default_rng(seed)
    return (amp * np.sin(2 * np.pi * freq * t) + noise * rng.standard_normal(t.size)).astype(np.float32)


def test_integrated_loudness_of_a_full_scale_sine_is_minus_3_lufs():
    # ITU-R BS.1770: a 997 Hz sine at 0 dBFS reads -3.01 LKFS (±0.1 LU, the tolerance of the EBU Tech 3341
    # compliance signals; at 24 kHz the K-weighting filter is that of 48 kHz redesigned for the rate)
    assert ls.integrated_loudness(_tone(997, 1.0, 3.0)) == pytest.approx(-3.01, abs=0.1)
    assert ls.integrated_loudness(np.zeros(SR, np.float32)) == float("-inf")
    # a clip shorter than one 400 ms gating block is measured, not silent
    short = ls.integrated_loudness(_tone(997, 0.5, 0.2))
    assert short == pytest.approx(-3.01 - 6.02, abs=0.15)


def test_matching_brings_every_clip_within_half_an_lu_and_below_the_ceiling():
    clips = [_tone(220, 0.9, 2.0, noise=0.02), _tone(1800, 0.05, 2.5, noise=0.01, seed=1),
             _tone(500, 0.3, 0.25), 0.5 * np.random.default_rng(3).standard_normal(SR * 2).astype(np.float32)]
    before = [ls.integrated_loudness(c) for c in clips]
    assert max(before) - min(before) > 15                       # very different to start with
    out, gains, common = ls.match_loudness(clips)
    meter = pyloudnorm.Meter(SR)
    after = [meter.integrated_loudness(np.tile(c, 3).astype(np.float64)) for c in out]   # (the short one tiled)
    assert max(after) - min(after) <= 0.5, after
    assert all(abs(a - common) <= 0.5 for a in after)
    assert all(20 * math.log10(np.max(np.abs(c))) <= ls.PEAK_CEILING_DB + 1e-3 for c in out)
    assert common <= ls.TARGET_LUFS
    assert gains == pytest.approx([common - b for b in before])
    # quiet clips reach the target itself
    out, _, common = ls.match_loudness([_tone(440, 0.05, 2.0), _tone(440, 0.1, 2.0)])
    assert common == ls.TARGET_LUFS
    assert all(abs(ls.integrated_loudness(c) - ls.TARGET_LUFS) < 0.5 for c in out)
    # a silent clip is left alone
    out, gains, _ = ls.match_loudness([np.zeros(SR, np.float32), _tone(440, 0.1, 1.0)])
    assert gains[0] == 0.0 and not np.any(out[0])


def test_the_anchor_is_the_reference_low_passed_at_3_5_khz_in_place():
    x = _tone(1000, 0.3, 1.0) + _tone(8000, 0.3, 1.0)
    y = ls.low_pass_anchor(x)
    spec_x, spec_y = np.abs(np.fft.rfft(x)), np.abs(np.fft.rfft(y))
    f = np.fft.rfftfreq(x.size, 1 / SR)
    hi, lo = np.argmin(abs(f - 8000)), np.argmin(abs(f - 1000))
    assert spec_y[hi] < spec_x[hi] * 1e-3                      # 8 kHz gone (< -60 dB)
    assert spec_y[lo] == pytest.approx(spec_x[lo], rel=0.01)   # 1 kHz kept
    assert y.size == x.size and np.argmax(np.correlate(y[:2400], x[:2400], "full")) == 2399   # no delay


# --- definition and plan ----------------------------------------------------------------------------------

def _definition(kind="abx", n_configs=2, trials=8, seed=1234, reference=False):
    cfgs = [{"voice": "ryan", "seed": 7, "speed": 1.0 + 0.1 * i} for i in range(n_configs)]
    if reference:
        cfgs[0]["reference"] = True
    return ls.Definition(kind=kind, texts=[f"Sentence {i}." for i in range(trials)], configs=cfgs, shuffle_seed=seed)


def test_the_plan_is_shuffled_per_trial_from_recorded_seeds_and_reproduced_by_an_export():
    d = _definition("abx", trials=20)
    stimuli = ls.make_stimuli(d, ls.varied_factor(d.configs))
    plan = ls.make_plan(d, stimuli)
    assert [p.labels for p in plan] == [["A", "B", "X"]] * 20
    assert all(p.stimulus["X"] == p.stimulus[p.answer_key] for p in plan)
    assert all(sorted([p.stimulus["A"], p.stimulus["B"]]) == [0, 1] for p in plan)
    assert {p.stimulus["A"] for p in plan} == {0, 1} and {p.answer_key for p in plan} == {"A", "B"}   # shuffled
    assert [p.seed for p in plan] == [ls.trial_seed(1234, t) for t in range(1, 21)]
    again = ls.Definition.from_json(json.dumps(d.to_dict()))
    assert again == d
    plan2 = ls.make_plan(again, ls.make_stimuli(again, ls.varied_factor(again.configs)))
    assert [(p.seed, p.stimulus, p.answer_key) for p in plan2] == [(p.seed, p.stimulus, p.answer_key) for p in plan]
    other = ls.make_plan(_definition("abx", trials=20, seed=99), stimuli)
    assert [p.stimulus for p in other] != [p.stimulus for p in plan]


def test_mushra_with_a_reference_adds_the_hidden_reference_and_the_anchor():
    d = _definition("mushra", n_configs=3, trials=4, reference=True)
    stimuli = ls.make_stimuli(d, "speed")
    assert [s.role for s in stimuli] == ["config"] * 3 + ["hidden reference", "anchor"]
    assert stimuli[3].config == stimuli[4].config == 0
    for p in ls.make_plan(d, stimuli):
        assert p.labels[0] == "R" and p.stimulus["R"] == 0
        assert p.rated == ["A", "B", "C", "D"] and sorted(p.stimulus[x] for x in p.rated) == [1, 2, 3, 4]
    d = _definition("mushra", n_configs=3, trials=2)
    plain = ls.make_plan(d, ls.make_stimuli(d, "speed"))
    assert plain[0].labels == ["A", "B", "C"]


def test_ab_with_more_stimuli_goes_through_the_pairs():
    d = _definition("ab", n_configs=3, trials=6)
    plan = ls.make_plan(d, ls.make_stimuli(d, "speed"))
    pairs = [tuple(sorted((p.stimulus["A"], p.stimulus["B"]))) for p in plan]
    assert sorted(pairs[:3]) == [(0, 1), (0, 2), (1, 2)] and pairs[3:] == pairs[:3]


def test_configurations_and_answers_are_checked():
    with pytest.raises(TTSError, match="2 to 6"):
        ls.parse_configs(json.dumps([{"speed": 1 + i / 10} for i in range(7)]))
    with pytest.raises(TTSError, match="2 to 6"):
        ls.parse_configs("[{}]")
    with pytest.raises(TTSError, match="unknown key"):
        ls.parse_configs('[{"volume": 2}, {}]')
    with pytest.raises(TTSError, match="unknown precision"):
        ls.parse_configs('[{"precision": "int3"}, {}]')
    with pytest.raises(TTSError, match="speed must be"):
        ls.parse_configs('[{"speed": 9}, {}]')
    with pytest.raises(TTSError, match="not valid JSON"):
        ls.parse_configs("[{")
    with pytest.raises(TTSError, match="blend_with"):
        ls.parse_configs('[{"blend": 20}, {}]')
    with pytest.raises(TTSError, match="identical"):
        ls.varied_factor([{"voice": "a"}, {"voice": "a"}])
    with pytest.raises(TTSError, match="one factor at a time.*voice, speed"):
        ls.varied_factor([{"voice": "a", "speed": 1.0}, {"voice": "b", "speed": 1.2}])
    with pytest.raises(TTSError, match="same speed"):
        ls.varied_factor([{"speed": 1.0}, {"speed": 1.2}, {"speed": 1.0}])
    assert ls.varied_factor([{"voice": "a", "blend_with": "b", "blend": 0}, {"voice": "a", "blend_with": "b",
                                                                             "blend": 50}]) == "blend"
    for bad in (0, 21, 2.5, "x"):
        with pytest.raises(TTSError, match="1 to 20"):
            ls.check_trials(bad)
    with pytest.raises(TTSError, match="unknown test kind"):
        ls.check_kind("abc")
    plan = ls.TrialPlan(1, 5, ["R", "A", "B"], {"R": 0, "A": 1, "B": 2}, ["A", "B"])
    assert ls.parse_answer("mushra", plan, '{"a": 90, "B": 12.5}') == {"A": 90.0, "B": 12.5}
    with pytest.raises(TTSError, match="missing: B"):
        ls.parse_answer("mushra", plan, '{"A": 90}')
    with pytest.raises(TTSError, match="0 to 100"):
        ls.parse_answer("mushra", plan, '{"A": 190, "B": 1}')
    with pytest.raises(TTSError, match="not in this trial: R"):
        ls.parse_answer("mushra", plan, '{"A": 90, "B": 1, "R": 3}')
    assert ls.parse_answer("ab", plan, "b") == "B" and ls.parse_answer("ab", plan, "no preference") == "none"
    with pytest.raises(TTSError, match="A or B"):
        ls.parse_answer("abx", plan, "none")
    assert ls.trial_texts("", "german", 3, 2000) == ls.SENTENCES["german"][:3]
    assert ls.trial_texts("One. Two!\nThree", "auto", 4, 2000) == ["One.", "Two!", "Three", "One."]
    with pytest.raises(TTSError, match="at most 300"):
        ls.trial_texts("x" * 301, "auto", 1, 2000)


def test_results_and_exports_of_an_abx_test():
    d = _definition("abx", trials=10)
    stimuli = ls.make_stimuli(d, "speed")
    test = ls.ListenTest("t1", d, "speed", stimuli, ls.make_plan(d, stimuli))
    for p in test.plan:   # 9 right, the last one wrong
        right = p.answer_key
        test.answers[p.trial] = ls.Answer(p.trial, right if p.trial < 10 else {"A": "B", "B": "A"}[right], "now")
    r = ls.results(test)
    assert r["pairs"][0]["correct"] == 9 and r["pairs"][0]["p_value"] == 11 / 1024
    rows = list(csv.DictReader(io.StringIO(ls.csv_text(test))))
    assert len(rows) == 10 and float(rows[-1]["p_value"]) == pytest.approx(11 / 1024)
    assert float(rows[0]["p_value"]) == 0.5 and rows[-1]["correct"] == "0"
    whole = ls.export_dict(test)
    assert whole["definition"] == d.to_dict() and len(whole["answers"]) == 10
    assert all("x_is" in p for p in whole["plan"])
    assert "p = " not in ls.summary_markdown(test) and "0.0107" in ls.summary_markdown(test)
    del test.answers[10]    # an unanswered trial does not say what its labels are
    assert "stimuli" not in ls.export_dict(test)["plan"][9] and "x_is" not in ls.export_dict(test)["plan"][9]


class _Closable:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def test_the_pool_shares_extra_engines_and_lets_them_go():
    loaded = []

    def load(folder, device, dtype, quantize, kw):
        loaded.append((folder, quantize))
        return _Closable()

    pool = ls.EnginePool(max_engines=2, load=load)
    a = pool.acquire(("f", "cpu", None, "int8"), "t1")
    assert pool.acquire(("f", "cpu", None, "int8"), "t2") is a and len(loaded) == 1
    b = pool.acquire(("f", "cpu", None, "int4"), "t2")
    with pytest.raises(TTSError, match="2 extra models"):
        pool.acquire(("f", "cpu", "bf16", None), "t3")
    pool.release("t1")
    assert not a.closed and pool.count() == 2
    pool.release("t2")
    assert a.closed and b.closed and pool.count() == 0


def test_a_test_of_recorded_takes(tmp_path):
    """Takes (fixed audio) instead of rendered configurations: every trial plays the same clips in a new order,
    loudness-matched; a MUSHRA reference gets its hidden copy and its anchor; the export cannot be run again."""
    import soundfile as sf

    n = iter(range(10**6))

    def save_wav(pcm, name):
        p = tmp_path / f"{next(n)}_{name}.wav"
        sf.write(p, pcm, SR, subtype="PCM_16")
        return str(p)

    def save_text(text, name, ext):
        p = tmp_path / f"{next(n)}_{name}.{ext}"
        p.write_text(text)
        return str(p)

    svc = ls.Listening(ls.Source(), save_wav, save_text)
    takes = [{"name": f"take #{i}", "text": "Hello.", **({"reference": True} if i == 1 else {})} for i in (1, 2, 3)]
    audio = [_tone(300, 0.8, 1.5, noise=0.05), _tone(300, 0.1, 1.5, noise=0.01, seed=1), _tone(600, 0.3, 1.2)]
    with pytest.raises(TTSError, match="2 to 6 takes"):
        svc.start_takes("mushra", takes[:1], audio[:1], 2)
    test = svc.start_takes("mushra", takes, audio, 3)
    assert json.loads(test.plan_json()) == [["R", "A", "B", "C", "D"]] * 3
    assert [s.name for s in test.stimuli] == ["take #1", "take #2", "take #3", "hidden reference (take #1)",
                                              "anchor (low-pass 3.5 kHz)"]
    for t in (1, 2, 3):
        files = svc.files_of(test, t, timeout=60)
        clips = {lab: sf.read(p, dtype="float32")[0] for lab, p in files.items()}
        levels = [ls.integrated_loudness(x) for x in clips.values()]
        assert max(levels) - min(levels) <= 0.5
        plan = test.plan[t - 1]
        hidden = next(lab for lab in plan.rated if test.stimuli[plan.stimulus[lab]].role == "hidden reference")
        assert np.array_equal(clips[hidden], clips["R"])
        svc.answer(test.id, t, json.dumps({lab: 50 for lab in plan.rated}))
    summary, _csv, json_path = svc.report(test.id)
    assert "compared: takes of a session" in summary
    with pytest.raises(TTSError, match="cannot be run again"):
        svc.load(open(json_path).read())
    with pytest.raises(TTSError, match="is finished"):
        svc.answer(test.id, 1, "{}")


def test_stimuli_that_come_out_identical_are_reported(tmp_path):
    """Two configurations that render the same samples (e.g. a precision that changes no code) are named in the
    summary and the export: the listener could not have heard a difference there."""
    import soundfile as sf

    def save_wav(pcm, name):
        p = tmp_path / f"{len(list(tmp_path.iterdir()))}_{name}.wav"
        sf.write(p, pcm, SR, subtype="PCM_16")
        return str(p)

    svc = ls.Listening(ls.Source(), save_wav, lambda text, name, ext: "")
    clip = _tone(300, 0.3, 1.0, noise=0.02)
    test = svc.start_takes("ab", [{"name": "one"}, {"name": "two"}, {"name": "three"}],
                           [clip, clip.copy(), _tone(500, 0.3, 1.0)], 1)
    svc.files_of(test, 1, timeout=60)
    assert test.identical == {1: ["one = two"]}
    svc.answer(test.id, 1, "A")
    assert "Sample for sample the same in some trials (nothing to hear there): one = two" in ls.summary_markdown(test)
    assert ls.export_dict(test)["identical"] == [{"trial": 1, "same": ["one = two"]}]
