"""The Listen tab: blind A/B, ABX and MUSHRA-style listening tests of configurations rendered on the spot
(serving/listen.py holds the test, the plan, the rendering, loudness matching and the statistics).

`AppSource` tells serving/listen.py what this app offers (voices, models, precisions the device holds) and resolves a
configuration into an engine and a voice, loading an extra engine from the test's pool where the app's own do not run
that model or precision. `ListenHandlers` are the functions behind /listen_start, /listen_load, /listen_stimulus,
/listen_answer and /listen_report. `build` makes the tab's components (into `c`), `wire` connects them; the page's
player for a trial (hidden labels, switching at the same position, a loop) is the script `JS`, run once per page."""
from __future__ import annotations

import html
import json
import math
import re
import uuid
from pathlib import Path

import gradio as gr

from serving import listen as ls
from serving import voice_store
from tts_engine import TTSError, expected_precision
from tts_engine.voices import blend as blendlib

from ui.config import DEFAULT_SAMPLING, ROLE_LABEL
from ui.handlers import guard
from ui.session import UPLOADED

# an official checkpoint id and its sibling of the other size (0.6B <-> 1.7B), offered as another model
OFFICIAL = re.compile(r"^(Qwen/Qwen3-TTS-12Hz-)(0\.6B|1\.7B)(-(?:CustomVoice|Base))$")
SIZES = {"0.6B": 0.6e9, "1.7B": 1.7e9}
# bytes per parameter of each precision (weights, with what stays 16/32-bit around the quantised matmuls)
BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.2, "w8a8": 1.2, "int4": 0.8, "w4a8": 0.8}
FACTOR_CHOICES = [("Voice", "voice"), ("Model (checkpoint)", "model"), ("Precision", "precision"), ("Seed", "seed"),
                  ("Speed", "speed"), ("Temperature", "temperature"), ("Blend ratio (% of the second voice)", "blend")]
EXAMPLE_VALUES = {"voice": "ryan, vivian", "model": "", "precision": "fp32, int8", "seed": "1, 2",
                  "speed": "1.0, 1.15", "temperature": "0.6, 0.9", "blend": "0, 50, 100"}


# --- what the app offers -----------------------------------------------------------------------------------

def _device(app) -> str:
    if app.cfg.device:
        return str(app.cfg.device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _free_bytes(device: str) -> int | None:
    """Memory free for another engine on `device` (None where unknown)."""
    if device.startswith("cuda"):
        import torch

        try:
            return int(torch.cuda.mem_get_info()[0])
        except Exception:
            return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class AppSource(ls.Source):
    """serving/listen.py's view of this app: its voices (`Voices`), its role engines (`Models`), the official
    sibling checkpoints and the device."""

    def __init__(self, app):
        self.app = app

    def defaults(self) -> dict:
        speakers = self.app.models.speakers()
        choices = [v for _, v in self.app.voices.choices(None)]
        voice = "ryan" if "ryan" in speakers else (choices[0] if choices else "")
        return {"voice": voice, "language": "auto", "temperature": DEFAULT_SAMPLING["temperature"], "speed": 1.0}

    # --- models
    def models(self) -> dict[str, tuple[str, str, bool]]:
        """Model name -> (role, checkpoint or folder, the app's own engine?): each role by its name and checkpoint,
        and an official checkpoint's sibling of the other size."""
        out = {}
        for role, info in self.app.models.roles.items():
            if role == "voice_design":
                continue
            own = (role, str(info.folder), True)
            out[role] = own
            if info.checkpoint not in out:     # (`--tiny` names every role's checkpoint "tiny": the role names it)
                out[info.checkpoint] = own
            m = OFFICIAL.match(info.checkpoint)
            if m and not info.random:
                other = "1.7B" if m.group(2) == "0.6B" else "0.6B"
                sib = f"{m.group(1)}{other}{m.group(3)}"
                out.setdefault(sib, (role, sib, False))
        return out

    def role_of(self, cfg: dict, session: dict | None = None) -> str:
        key = cfg.get("voice") or ""
        role = self.app.voices.role_of_key(key, session)
        if role is None or role not in self.app.models.roles:
            known = [v for _, v in self.app.voices.choices(session)]
            raise TTSError(f"unknown voice {key!r}; choose one of: {', '.join(known) or '(none)'}")
        if key.startswith("preset:"):
            self.app.voices.presets.get(key.split(":", 1)[1])
        return role

    def model_of(self, cfg: dict, role: str) -> tuple[str, str, bool]:
        name = cfg.get("model")
        if not name:
            info = self.app.models.roles[role]
            return role, str(info.folder), True
        models = self.models()
        if name not in models:
            raise TTSError(f"unknown model {name!r}; this server offers: {', '.join(sorted(models))}")
        m = models[name]
        if m[0] != role:
            raise TTSError(f"model {name!r} is a {ROLE_LABEL[m[0]]} model, but voice {cfg.get('voice')!r} needs a "
                           f"{ROLE_LABEL[role]} model")
        return m

    def check_precision(self, precision: str, folder: str) -> None:
        """TTSError where this device cannot run `precision` or has too little memory left for it."""
        device = _device(self.app)
        gpu = device.startswith("cuda")
        if precision in ls.QUANTISED and gpu:
            raise TTSError(f"precision {precision} runs on a CPU only (its kernels are CPU kernels); on this GPU "
                           "use bf16, fp16 or fp32")
        if precision == "fp16" and not gpu:
            raise TTSError("precision fp16 needs a GPU; on this CPU use bf16, fp32 or a quantised mode")
        weights = Path(folder) / "model.safetensors"
        if weights.is_file():
            params = weights.stat().st_size / 2          # the checkpoints are stored in 16-bit
        else:
            m = OFFICIAL.match(folder)
            params = SIZES[m.group(2)] if m else None
        free = _free_bytes(device)
        if params and free is not None:
            need = params * BYTES_PER_PARAM[precision] * 1.3     # weights + caches and workspace
            if need > 0.8 * free:
                raise TTSError(f"this device cannot hold another engine in {precision}: it needs about "
                               f"{need / 2**30:.1f} GiB and {free / 2**30:.1f} GiB are free")

    def check_factor(self, factor: str) -> None:
        if self.app.zerogpu:
            raise TTSError("on ZeroGPU a test cannot be rendered (GPU time is granted to one click at a time, not to "
                           "a test rendered in the background); compare takes of your session instead, or run the "
                           "app on a CPU or a dedicated GPU")
        if self.app.cfg.backend and factor in ("model", "precision", "temperature"):
            raise TTSError(f"the remote speech server generates the audio: its {factor} is its own and cannot be "
                           "varied from here")

    def check(self, cfg: dict, ctx=None) -> None:
        if self.app.cfg.backend and (cfg.get("model") or cfg.get("precision")):
            raise TTSError("the remote speech server generates the audio: its models and precision are its own")
        role = self.role_of(cfg, ctx)
        if cfg.get("blend_with"):
            other = self.role_of({"voice": cfg["blend_with"]}, ctx)
            if other != role:
                raise TTSError(f"{cfg['voice']} ({ROLE_LABEL[role]}) and {cfg['blend_with']} ({ROLE_LABEL[other]}) "
                               "belong to different checkpoints and cannot be blended")
        _role, folder, own = self.model_of(cfg, role)
        if cfg.get("precision"):
            self.check_precision(cfg["precision"], folder)
        elif not own:   # another model at the app's precision (fp32 assumed on a CPU: the larger)
            gpu = _device(self.app).startswith("cuda")
            dtype = str(self.app.cfg.dtype or ("bf16" if gpu else "fp32")).replace("float32", "fp32")
            self.check_precision(dtype if dtype in ls.PRECISIONS else "fp32", folder)

    # --- resolving
    def _engine(self, cfg: dict, pool: ls.EnginePool, owner: str, session):
        role = self.role_of(cfg, session)
        _role, folder, own = self.model_of(cfg, role)
        p = cfg.get("precision")
        dtype, quantize = (None, p) if p in ls.QUANTISED else (p, None)
        if own:
            eng = self.app.models.engine(role)
            if p is None or expected_precision(eng.device, dtype, quantize, folder) == eng.precision:
                return role, eng, True
        elif p is None:
            dtype, quantize = self.app.cfg.dtype, self.app.cfg.quantize
        kw = {k: v for k, v in self.app.cfg.engine_kw().items() if k != "quantize"}
        return role, pool.acquire((folder, _device(self.app), dtype, quantize), owner, kw), False

    def _voice(self, key: str, role: str, engine, own: bool, session=None):
        """`key` as `engine.stream` takes it: the app's resolution on its own engines, else made with `engine`."""
        if own:
            return self.app.voices.resolve(key, session)[1]
        if key.startswith("my:") or key in (session or {}):
            v = self.app.voices.resolve(key, session)[1]
            if getattr(v, "hidden_size", None) not in (None, engine.hidden_size):
                raise TTSError(f"voice {key!r} was made for a model of another size; it cannot speak with this one")
            return v
        if key.startswith(UPLOADED):
            v = voice_store.voice_for(self.app.models.registry, key[len(UPLOADED):], engine)
            if v is None:
                raise TTSError(f"there is no uploaded voice {key!r}")
            return v
        if role == "base":
            return self.app.voices.presets.voice(engine, key.split(":", 1)[-1])
        if key.lower() not in [s.lower() for s in engine.speakers]:
            raise TTSError(f"the model has no speaker {key!r}")
        return key.lower()

    @staticmethod
    def _embedding(voice, engine):
        if isinstance(voice, str):
            return engine.preset_embedding(voice).numpy()
        if voice.kind == "preset":
            return engine.preset_embedding(voice.speaker).numpy()
        return voice.embedding.float().numpy()

    def open(self, cfg: dict, pool: ls.EnginePool, owner: str, ctx=None) -> ls.Target:
        role, engine, own = self._engine(cfg, pool, owner, ctx)
        voice = self._voice(cfg["voice"], role, engine, own, ctx)
        if cfg.get("blend_with"):
            other = self._voice(cfg["blend_with"], role, engine, own, ctx)
            t = float(cfg.get("blend", 0)) / 100.0
            vec = blendlib.blend([self._embedding(voice, engine), self._embedding(other, engine)], [1 - t, t])
            voice = engine.voice_from_embedding(vec, name=f"{cfg['voice']} + {t:.0%} {cfg['blend_with']}")
        sampling = {**DEFAULT_SAMPLING, "temperature": float(cfg.get("temperature", DEFAULT_SAMPLING["temperature"]))}
        return ls.Target(engine=engine, voice=voice, language=cfg.get("language") or "auto", seed=int(cfg["seed"]),
                         sampling=sampling, speed=float(cfg.get("speed", 1.0)))


# --- the handlers ------------------------------------------------------------------------------------------

class ListenHandlers:
    """The functions behind the Listen tab's API names (their signatures and docstrings are the API)."""

    def __init__(self, app):
        self.app = app
        self.service = ls.Listening(AppSource(app), save_wav=app.files.save_wav, save_text=self._save_text,
                                    max_text_chars=app.limits.max_text_chars,
                                    max_new_tokens=app.limits.max_new_tokens, ttl_seconds=app.limits.file_ttl_seconds)

    def _save_text(self, text: str, name: str, ext: str) -> str:
        """A download in the app's private file folder, in its own random subfolder (expires like the others)."""
        self.app.files.prune()
        d = Path(self.app.files.dir) / uuid.uuid4().hex
        d.mkdir(parents=True)
        p = d / f"{name}.{ext}"
        p.write_text(text, encoding="utf-8")
        return str(p)

    def listen_start(self, kind: str, text: str, configs: str, trials: float, session: dict | None = None):
        """Start a blind listening test of configurations rendered on the spot: the same text and seed, one factor
        varied between them; every stimulus loudness-matched (ITU-R BS.1770), the order shuffled per trial.

        Parameters:
            kind: "ab" (preference: A, B or none), "abx" (is X A or B?) or "mushra" (rate each stimulus 0-100; with a reference: hidden reference and 3.5 kHz low-pass anchor added)
            text: the sentences, one per trial in turn (empty: a built-in list in the configurations' language)
            configs: JSON list of 2-6 objects with any of voice, model, precision (fp32, bf16, fp16, int8, int4, w8a8, w4a8), seed, speed, temperature, blend_with + blend (percent), language, reference (true on one, MUSHRA); e.g. [{"precision": "bf16", "reference": true}, {"precision": "w8a8"}]
            trials: number of trials, 1-20
        Returns:
            the test id, the plan: a JSON list of each trial's stimulus labels in play order
        """
        test = self.service.start(kind, text, configs, trials, ctx=session)
        return test.id, test.plan_json()

    def listen_takes(self, kind: str, takes: str, trials: float, reference: bool = False,
                     history: list | None = None):
        """Start a blind test of takes of this session (their recorded audio, loudness-matched; every trial plays
        the same takes in a new order).

        Parameters:
            kind: "ab", "abx" or "mushra"
            takes: the take numbers, e.g. "1, 3" (2-6; the first is the reference of a MUSHRA test with one)
            trials: number of trials, 1-20
            reference: MUSHRA: the first take is the reference (adds the hidden reference and the low-pass anchor)
        Returns:
            the test id, the plan: a JSON list of each trial's stimulus labels in play order
        """
        import soundfile as sf

        try:
            numbers = [int(x) for x in re.split(r"[,\s]+", str(takes or "").strip()) if x]
        except ValueError:
            raise TTSError("list the takes by number, e.g. 1, 3") from None
        if len(set(numbers)) != len(numbers):
            raise TTSError("each take can be listed once")
        by_n = {int(t["n"]): t for t in history or []}
        missing = [n for n in numbers if n not in by_n]
        if missing:
            raise TTSError(f"this session has no take #{missing[0]} (it has "
                           f"{', '.join(f'#{n}' for n in sorted(by_n)) or 'none yet'})")
        described, audio = [], []
        for i, n in enumerate(numbers):
            t = by_n[n]
            try:
                wav, _sr = sf.read(t["path"], dtype="float32")
            except Exception:
                raise TTSError(f"the audio of take #{n} is gone (takes' files expire): make it again") from None
            described.append({"name": f"take #{n} ({t.get('voice', '')}, seed {t.get('seed')})", "take": n,
                              "kind": t.get("kind"), "text": t.get("text", ""), "voice": t.get("voice", ""),
                              "seed": t.get("seed"), **({"reference": True} if reference and i == 0 else {})})
            audio.append(wav if wav.ndim == 1 else wav.mean(axis=1))
        test = self.service.start_takes(kind, described, audio, trials)
        return test.id, test.plan_json()

    def listen_load(self, definition):
        """Start a test exactly as an exported one (its JSON file): same texts, seeds, configurations and shuffles.

        Parameters:
            definition: the JSON file that /listen_report exported (or its text)
        Returns:
            the test id, the plan: a JSON list of each trial's stimulus labels in play order
        """
        if not definition:
            raise TTSError("choose an exported test (its .json file) first")
        text = definition
        try:
            path = Path(str(definition))
            if len(str(definition)) < 4096 and path.is_file():
                if path.stat().st_size > ls.MAX_DEFINITION_CHARS * 4:
                    raise TTSError("the test definition is too large")
                text = path.read_bytes()
        except OSError:
            raise TTSError("the test definition cannot be read; choose the exported .json file") from None
        test = self.service.load(text)
        return test.id, test.plan_json()

    def listen_stimulus(self, test_id: str, trial: float, label: str):
        """One stimulus of a trial, loudness-matched, as a 16-bit WAV (waits while the trial is rendered).

        Parameters:
            test_id: the id /listen_start returned
            trial: the trial, 1 to the number of trials
            label: a label of that trial (e.g. "A", "B", "X"; "R" is the open reference of a MUSHRA test)
        Returns:
            the WAV
        """
        return self.service.stimulus(test_id, trial, label)

    def listen_answer(self, test_id: str, trial: float, answer: str):
        """Answer a trial. Refused (and nothing changes) for an unknown or finished test or a trial answered already.

        Parameters:
            test_id: the id /listen_start returned
            trial: the trial, 1 to the number of trials
            answer: A/B: "A", "B" or "none"; ABX: "A" or "B" (what X is); MUSHRA: a JSON object label -> score 0-100 for every rated label, e.g. {"A": 90, "B": 40, "C": 20}
        Returns:
            the progress line
        """
        return self.service.answer(test_id, trial, answer)

    def listen_report(self, test_id: str):
        """The results so far: per stimulus the preference share, ABX correct count with its binomial p-value, or
        MUSHRA mean with its 95 % interval; a CSV of every answer and a JSON of the whole test (definition,
        shuffles, answers), which /listen_load runs again.

        Parameters:
            test_id: the id /listen_start returned
        Returns:
            the summary (Markdown), the CSV (one row per answered trial; ABX: a p_value column), the JSON
        """
        return self.service.report(test_id)

    def close(self) -> None:
        self.service.close()


# --- the page ---------------------------------------------------------------------------------------------

def configs_from_form(factor: str, values: str, voice: str, language: str, reference: bool, blend_with: str) -> str:
    """The configurations JSON of the simple form: one stimulus per comma-separated value of the varied factor."""
    vals = [v.strip() for v in str(values or "").split(",") if v.strip()]
    out = []
    for i, v in enumerate(vals):
        cfg: dict = {"language": language or "auto"}
        if factor != "voice" and voice:
            cfg["voice"] = voice
        if factor in ("seed", "speed", "temperature", "blend"):
            try:
                num = float(v)
                cfg[factor] = int(num) if factor == "seed" and num == int(num) else num
            except ValueError:
                cfg[factor] = v
            if factor == "blend":
                cfg["blend_with"] = blend_with or ""
        else:
            cfg[factor] = v
        if reference and i == 0:
            cfg["reference"] = True
        out.append(cfg)
    return json.dumps(out, ensure_ascii=False)


def factor_hint(app, factor: str) -> str:
    """What the values of `factor` may be on this server."""
    src = AppSource(app)
    if factor == "model":
        models = [m for m in src.models() if m not in ("custom_voice", "base")]
        return "Models offered here: " + ", ".join(f"`{m}`" for m in models) + " (another model of the voice's kind " \
               "loads for the test and is let go once the test is rendered)."
    if factor == "precision":
        gpu = _device(app).startswith("cuda")
        modes = "fp32, bf16, fp16" if gpu else "fp32, bf16, int8, int4, w8a8, w4a8 (where our kernels run)"
        return (f"Precisions this device runs: {modes}. The app's own engines run "
                f"{app.models.expected_precision() or 'remotely'}; any other loads as an extra engine for the test.")
    if factor == "voice":
        return "Voices: CustomVoice speakers (e.g. `ryan`), `preset:<id>` (Base preset clips), `uploaded:<name>`."
    if factor == "blend":
        return "Blend: the share (0-100 %) of the second voice mixed into the voice above (one checkpoint's voices)."
    ranges = {"seed": "whole numbers 0 to 2147483647", "speed": f"{ls.SPEED_MIN}-{ls.SPEED_MAX} (pitch kept)",
              "temperature": "0.05-2.0"}
    return f"{factor.title()}: {ranges[factor]}."


def example_values(app, factor: str) -> str:
    if factor != "model":
        return EXAMPLE_VALUES.get(factor, "")
    return ", ".join(m for m in AppSource(app).models() if m not in ("custom_voice", "base"))


def trial_html(test: ls.ListenTest, trial: int, files: dict[str, str]) -> str:
    """One trial: its sentence, a button per (hidden) label with its audio, the loop, and the answer controls."""
    d = test.definition
    plan = test.plan[trial - 1]
    buttons, audios = [], []
    for lab in plan.labels:
        url = "gradio_api/file=" + html.escape(files[lab], quote=True)
        title = "the open reference" if lab == "R" else f"stimulus {lab}"
        buttons.append(f'<button class="ls-stim" data-label="{lab}" id="ls-play-{lab}" title="Play {title}">'
                       f'▶ {lab}</button>')
        audios.append(f'<audio id="ls-audio-{lab}" class="ls-audio" preload="auto" src="{url}"></audio>')
    if d.kind == "ab":
        ask = ("Which do you prefer?" + "".join(
            f'<label class="ls-choice"><input type="radio" name="ls-choice" value="{v}"> {t}</label>'
            for v, t in (("A", "A"), ("B", "B"), ("none", "no preference"))))
    elif d.kind == "abx":
        ask = ("Is X the same as A or as B?" + "".join(
            f'<label class="ls-choice"><input type="radio" name="ls-choice" value="{v}"> X = {v}</label>'
            for v in ("A", "B")))
    else:
        ask = "Rate each stimulus (100 = as good as the reference)." if d.reference is not None else \
            "Rate each stimulus from 0 (bad) to 100 (excellent)."
        ask += "".join(f'<div class="ls-rate"><span>{lab}</span><input type="range" min="0" max="100" step="1" '
                       f'value="50" class="ls-score" data-label="{lab}" id="ls-score-{lab}">'
                       f'<output id="ls-score-{lab}-v">50</output></div>' for lab in plan.rated)
    return (f'<style>{CSS}</style><div id="ls-trial" data-test="{test.id}" data-trial="{trial}" data-kind="{d.kind}">'
            f'<div class="ls-head">Trial <b>{trial}</b> of {d.trials} · “{html.escape(d.texts[trial - 1])}”</div>'
            f'<div class="ls-buttons">{"".join(buttons)}<button id="ls-pause" class="ls-ctl">❚❚ Pause</button></div>'
            f'{"".join(audios)}'
            '<div class="ls-loop"><label><input type="checkbox" id="ls-loop-on"> Loop</label> from '
            '<input type="number" id="ls-loop-a" min="0" step="0.1" value="0"> to '
            '<input type="number" id="ls-loop-b" min="0" step="0.1" value="0"> s '
            '<button id="ls-loop-set-a" class="ls-ctl">⇤ here</button> <button id="ls-loop-set-b" class="ls-ctl">'
            '⇥ here</button> <span id="ls-pos">0.0 s</span></div>'
            f'<div class="ls-ask">{ask}</div></div>')


def plot_svg(r: dict) -> str:
    """The results as bars with their intervals (A/B: preference share, Wilson 95 %; ABX: share correct per pair
    with the chance line; MUSHRA: mean with its 95 % t-interval)."""
    kind = r["kind"]
    if kind == "abx":
        rows = [(p["pair"], p["correct"] / p["n"] * 100, p["low"] * 100, p["high"] * 100) for p in r.get("pairs", [])]
        axis = "% correct"
    elif kind == "ab":
        rows = [(s["stimulus"], s["share"] * 100, s["low"] * 100, s["high"] * 100) for s in r.get("stimuli", [])]
        axis = "% preferred"
    else:
        rows = [(s["stimulus"], s["mean"], s["low"], s["high"]) for s in r.get("stimuli", [])]
        axis = "score"
    if not rows:
        return ""
    slot, bar, left, top, h = 150, 56, 40, 22, 200
    width = left + len(rows) * slot + 10

    def y(v: float) -> float:
        return top + h - max(0.0, min(100.0, v)) / 100 * h

    parts = [f'<svg id="ls-plot-svg" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + h + 30}" '
             f'role="img" aria-label="results" font-family="sans-serif"><text x="2" y="11" font-size="11">{axis}'
             '</text>']
    for v in (0, 25, 50, 75, 100):
        parts.append(f'<line x1="{left - 4}" x2="{width}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e5e7eb"/>'
                     f'<text x="{left - 6}" y="{y(v) + 4:.1f}" font-size="10" text-anchor="end">{v}</text>')
    if kind == "abx":   # guessing
        parts.append(f'<line x1="{left}" x2="{width}" y1="{y(50):.1f}" y2="{y(50):.1f}" stroke="#ef4444" '
                     'stroke-dasharray="4 3"><title>chance (guessing)</title></line>')
    for k, (name, v, lo, hi) in enumerate(rows):
        cx = left + slot / 2 + k * slot
        x = cx - bar / 2
        parts.append(f'<rect class="ls-bar" x="{x:.1f}" y="{y(v):.1f}" width="{bar}" height="{top + h - y(v):.1f}" '
                     f'fill="#6366f1"><title>{html.escape(name)}: {v:.1f}</title></rect>')
        parts.append(f'<text x="{cx:.1f}" y="{top + h - 5}" font-size="11" fill="white" text-anchor="middle">'
                     f'{v:.0f}</text>')
        if not (math.isnan(lo) or math.isnan(hi)):
            parts.append(f'<path class="ls-interval" d="M{cx} {y(hi):.1f}V{y(lo):.1f}M{cx - 8} {y(hi):.1f}'
                         f'h16M{cx - 8} {y(lo):.1f}h16" stroke="#111827" stroke-width="1.5" fill="none">'
                         f'<title>95 % interval {lo:.1f} – {hi:.1f}</title></path>')
        label = html.escape(name if len(name) <= 24 else name[:23] + "…")
        parts.append(f'<text x="{cx:.1f}" y="{top + h + 16}" font-size="10" text-anchor="middle">{label}'
                     f'<title>{html.escape(name)}</title></text>')
    parts.append("</svg>")
    return "".join(parts)


JS = (Path(__file__).resolve().parent.parent / "assets" / "listen.js")

CSS = """
#ls-trial .ls-head {margin-bottom: 6px;} .ls-buttons {display: flex; gap: 8px; flex-wrap: wrap;}
.ls-stim, .ls-ctl {border: 1px solid #c7d2fe; border-radius: 6px; padding: 6px 14px; background: #eef2ff;}
.ls-stim.playing {background: #6366f1; color: white;} .ls-loop {margin: 8px 0; font-size: 0.9em;}
.ls-loop input[type=number] {width: 5em;} .ls-rate {display: flex; align-items: center; gap: 8px;}
.ls-rate input {flex: 1;} .ls-choice {margin-left: 12px;}
#ls-trial input[type=radio], #ls-trial input[type=checkbox] {appearance: auto; -webkit-appearance: auto;
  width: 1em; height: 1em; margin-right: 4px; vertical-align: middle;}
#ls-trial input[type=range] {appearance: auto; -webkit-appearance: auto;}
"""


def build(app, c, langs) -> None:
    app.listen = ListenHandlers(app)
    choices = app.voices.choices(None)
    default_voice = AppSource(app).defaults()["voice"]
    with gr.Tab("Listen", id="tab-listen"):
        gr.Markdown("Blind listening tests: the same sentence and seed rendered with one thing changed (voice, "
                    "model, precision, seed, speed, temperature or blend ratio). Labels are hidden and shuffled "
                    "per trial, every stimulus is loudness-matched (ITU-R BS.1770); switching keeps the position. "
                    "Export the test (JSON) to let someone else run exactly the same one.")
        with gr.Row():
            c.ls_kind = gr.Radio([("A/B preference", "ab"), ("ABX", "abx"), ("MUSHRA-style rating", "mushra")],
                                 value="abx", label="Kind of test", elem_id="ls-kind")
            # (a Number without bounds: the handler's own check answers 0 or 21 with its message)
            c.ls_trials = gr.Number(5, precision=0, label=f"Trials ({ls.MIN_TRIALS}-{ls.MAX_TRIALS}, one sentence "
                                                          "each)", elem_id="ls-trials")
        with gr.Row():
            c.ls_factor = gr.Dropdown(FACTOR_CHOICES, value="voice", label="What varies", elem_id="ls-factor")
            c.ls_values = gr.Textbox(EXAMPLE_VALUES["voice"], label="Values, one per stimulus (comma-separated, 2-6)",
                                     elem_id="ls-values")
        with gr.Row():
            c.ls_voice = gr.Dropdown(choices, value=default_voice, label="Voice (when it does not vary)",
                                     allow_custom_value=True, elem_id="ls-voice")
            c.ls_blend_with = gr.Dropdown(choices, value=None, label="Second voice of a blend", visible=False,
                                          allow_custom_value=True, elem_id="ls-blend-with")
            c.ls_lang = gr.Dropdown(langs, value="auto", label="Language")
        c.ls_hint = gr.Markdown(factor_hint(app, "voice"), elem_id="ls-hint")
        c.ls_reference = gr.Checkbox(False, label="The first value is the reference (MUSHRA: adds the hidden "
                                                  "reference and a 3.5 kHz low-pass anchor)")
        c.ls_text = gr.Textbox("", label="Sentences (one per trial, in turn; empty: built-in sentences)", lines=2,
                               elem_id="ls-text")
        with gr.Accordion("Configurations sent (JSON; edit for anything the form does not offer)", open=False):
            c.ls_configs = gr.Code(configs_from_form("voice", EXAMPLE_VALUES["voice"], default_voice, "auto", False,
                                                     ""), language="json", elem_id="ls-configs", interactive=True)
        with gr.Row():
            c.ls_start = gr.Button("▶ Start the test", variant="primary", elem_id="ls-start")
        with gr.Accordion("Or compare takes of this session (their recorded audio)", open=False):
            with gr.Row():
                c.ls_takes = gr.Textbox("", label="Takes (numbers, 2-6; e.g. 1, 3)", elem_id="ls-takes", scale=3)
                c.ls_takes_btn = gr.Button("▶ Start with these takes", elem_id="ls-takes-start", scale=1)
        with gr.Accordion("Run a test someone exported", open=False):
            c.ls_def_file = gr.File(label="Exported test (.json)", file_types=[".json"], elem_id="ls-def-file")
            c.ls_load = gr.Button("Load and start", elem_id="ls-load")
        with gr.Row():
            c.ls_id = gr.Textbox("", label="Test id", interactive=False, elem_id="ls-id", scale=1)
            c.ls_progress = gr.Markdown("", elem_id="ls-progress")
        c.ls_plan = gr.Textbox("", visible=False, elem_id="ls-plan")
        c.ls_trial = gr.Number(0, visible=False, precision=0, elem_id="ls-trial-n")
        c.ls_view = gr.HTML("", elem_id="ls-view")
        c.ls_answer = gr.Textbox("", visible=False, elem_id="ls-answer")
        c.ls_submit = gr.Button("Submit answer", variant="primary", elem_id="ls-submit", visible=False)
        c.ls_label = gr.Textbox("", visible=False)
        c.ls_fetch = gr.Button(visible=False)
        c.ls_wav = gr.Audio(visible=False, type="filepath", format="wav")
        c.ls_report_btn = gr.Button("Results so far", elem_id="ls-report")
        c.ls_summary = gr.Markdown("", elem_id="ls-summary")
        c.ls_plot = gr.HTML("", elem_id="ls-plot")
        with gr.Row():
            c.ls_csv = gr.File(label="Every answer (CSV)", interactive=False, elem_id="ls-csv", height=120)
            c.ls_json = gr.File(label="The whole test (JSON: run it again with “Run a test someone exported”)",
                                interactive=False, elem_id="ls-json", height=120)


# `js=` of Submit: the answer is read from the trial's controls in the page
ANSWER_JS = "(id, trial, a) => [id, trial, window.listenTest ? window.listenTest.answer() : a]"


def _show(app, c, test_id):
    """The next unanswered trial of the test (waiting for it to be rendered), or the results when it is finished."""
    svc = app.listen.service
    test = svc.get(test_id)
    nxt = svc.next_trial(test)
    if nxt is None:
        summary, csv_path, json_path = svc.report(test.id)
        return {c.ls_trial: 0, c.ls_view: "<p id='ls-done'>The test is finished: the results are below.</p>",
                c.ls_submit: gr.update(visible=False), c.ls_progress: svc.progress(test), c.ls_summary: summary,
                c.ls_csv: csv_path, c.ls_json: json_path, c.ls_plot: plot_svg(ls.results(test))}
    files = svc.files_of(test, nxt)
    return {c.ls_trial: nxt, c.ls_view: trial_html(test, nxt, files), c.ls_submit: gr.update(visible=True),
            c.ls_progress: svc.progress(test), c.ls_summary: gr.skip(), c.ls_csv: gr.skip(), c.ls_json: gr.skip(),
            c.ls_plot: gr.skip()}


def load_js() -> str:
    """`js=` of a page load: defines `window.listenTest` (assets/listen.js)."""
    return "() => {" + JS.read_text(encoding="utf-8") + "}"


def wire(app, c, on) -> None:
    """The API events (`on` from layout._wire: guarded, documented) and the page-only ones."""
    h = app.listen
    ui = dict(show_progress="minimal", api_visibility="private")
    show_out = [c.ls_trial, c.ls_view, c.ls_submit, c.ls_progress, c.ls_summary, c.ls_csv, c.ls_json, c.ls_plot]

    def show(test_id):
        return _show(app, c, test_id)

    starts = {"listen_start": on(c.ls_start, h.listen_start, [c.ls_kind, c.ls_text, c.ls_configs, c.ls_trials,
                                                           c.session], [c.ls_id, c.ls_plan], "listen_start"),
              "listen_load": on(c.ls_load, h.listen_load, [c.ls_def_file], [c.ls_id, c.ls_plan], "listen_load"),
              "listen_takes": on(c.ls_takes_btn, h.listen_takes, [c.ls_kind, c.ls_takes, c.ls_trials, c.ls_reference,
                                                                  c.history], [c.ls_id, c.ls_plan], "listen_takes",
                                 api_visibility="undocumented")}
    for name, ev in starts.items():   # a new test: the last results go, its first trial shows once rendered
        ev.success(lambda: ("", None, None, ""), None, [c.ls_summary, c.ls_csv, c.ls_json, c.ls_plot],
                   queue=False, api_name=f"ui_{name}_clear", **ui) \
            .then(guard(show), [c.ls_id], show_out, api_name=f"ui_{name}_show", **ui)
    on(c.ls_fetch, h.listen_stimulus, [c.ls_id, c.ls_trial, c.ls_label], [c.ls_wav], "listen_stimulus")
    on(c.ls_submit, h.listen_answer, [c.ls_id, c.ls_trial, c.ls_answer], [c.ls_progress], "listen_answer",
       js=ANSWER_JS).success(guard(show), [c.ls_id], show_out, api_name="ui_listen_next", **ui)

    def report_plot(test_id):
        return plot_svg(ls.results(app.listen.service.get(test_id)))

    on(c.ls_report_btn, h.listen_report, [c.ls_id], [c.ls_summary, c.ls_csv, c.ls_json], "listen_report") \
        .success(guard(report_plot), [c.ls_id], [c.ls_plot], api_name="ui_listen_plot", **ui)

    form = [c.ls_factor, c.ls_values, c.ls_voice, c.ls_lang, c.ls_reference, c.ls_blend_with]
    for j, comp in enumerate(form):
        comp.change(configs_from_form, form, [c.ls_configs], api_name=f"ui_listen_configs_{j}", queue=False,
                    show_progress="hidden", api_visibility="undocumented")
    c.ls_factor.change(lambda f: (gr.update(value=example_values(app, f)), gr.update(visible=f == "blend"),
                                  factor_hint(app, f)),
                       [c.ls_factor], [c.ls_values, c.ls_blend_with, c.ls_hint], api_name="ui_listen_factor",
                       queue=False, show_progress="hidden", api_visibility="undocumented")
    c.ls_kind.change(lambda k: gr.update(value=k == "mushra"), [c.ls_kind], [c.ls_reference],
                     api_name="ui_listen_kind", queue=False, show_progress="hidden", api_visibility="undocumented")
