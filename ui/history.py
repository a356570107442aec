"""The session's takes: the last `MAX_TAKES` generations of this browser tab (what was said, the voice, the seed,
the settings and the audio), to play again, download, restore into the form for another take, and compare two
of them A/B (assets/history.js plays them in the page).

A take is recorded when a generation puts its result into the player (`final.change`), with the values its
handler was called with (`noting` keeps them per browser session when the handler starts) and the seed it used.
The list lives in a `gr.State` (one per tab, never shared) and each take's WAV in the app's private file folder
(`session.Files`: an unguessable folder per file, deleted after the file lifetime); a take that falls off the end
of the list, and every take of a closed session (the State's `delete_callback`), is deleted at once."""
from __future__ import annotations

import functools
import hashlib
import html
import time
from pathlib import Path

import gradio as gr
import numpy as np

from ui.config import ROOT, SR
from ui.speak import session_key

MAX_TAKES = 20
JS_FILE = ROOT / "assets" / "history.js"
# what each generating event's take keeps: names in `c` (a list of components is named `name.i`)
SETTINGS = ["seed", "temperature", "top_k", "top_p", "rep", "max_new", "speed"]
FIELDS = {
    "preset": ["p_text", "p_voice", "p_lang", "p_instruct"],
    "clone": ["c_text", "c_lang", "ref_text", "xvec", "voice_name"],
    "blend": ["b_text", "n_voices", *[f"slot_voice.{i}" for i in range(4)], *[f"slot_weight.{i}" for i in range(4)],
              "ab", "b_lang"],
    "design": ["d_text", "d_desc", "d_lang"],
    "dialogue": ["dlg_script", *[f"dlg_speaker.{i}" for i in range(4)], *[f"dlg_voice.{i}" for i in range(4)],
                 "dlg_pause", "dlg_lang"],
}
TEXT_FIELD = {"preset": "p_text", "clone": "c_text", "blend": "b_text", "design": "d_text", "dialogue": "dlg_script"}
TAB = {"preset": "tab-preset", "clone": "tab-clone", "blend": "tab-blend", "design": "tab-design",
       "dialogue": "tab-dialogue"}
TITLE = {"preset": "Preset", "clone": "Clone", "blend": "Blend", "design": "Design", "dialogue": "Dialogue"}


def component(c, name: str):
    base, _, i = name.partition(".")
    comp = getattr(c, base, None)
    return comp[int(i)] if i and comp is not None else comp


def voice_of(kind: str, v: dict) -> str:
    """A short description of the voice(s) of a take."""
    if kind == "preset":
        return str(v.get("p_voice") or "")
    if kind == "clone":
        return f"clone “{v.get('voice_name') or ''}”"
    if kind == "blend":
        n = int(float(v.get("n_voices") or 2))
        return "blend of " + " + ".join(str(v.get(f"slot_voice.{i}") or "?") for i in range(n))
    if kind == "design":
        return f"designed: {str(v.get('d_desc') or '')[:40]}"
    pairs = [(v.get(f"dlg_speaker.{i}"), v.get(f"dlg_voice.{i}")) for i in range(4)]
    return ", ".join(f"{s} = {vo}" for s, vo in pairs if s)


def _drop_file(path: str | None) -> None:
    if not path:
        return
    p = Path(path)
    try:
        p.unlink(missing_ok=True)
        p.parent.rmdir()
    except OSError:
        pass


def forget(history) -> None:
    """The session ended (the State's delete_callback): its takes' files go now, not at their expiry."""
    for take in history or []:
        _drop_file(take.get("path"))


def record(app, kind: str, history, final, seed, *values) -> list:
    """-> the session's takes with this generation's added (newest first, at most MAX_TAKES). `final`: the
    result WAV as gr.Audio gives it to a function, (rate, samples); nothing is recorded without audio."""
    history = list(history or [])
    if final is None:
        return history
    rate, audio = final
    audio = np.asarray(audio)
    if audio.size == 0:
        return history
    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    if audio.dtype != np.int16:
        audio = (np.clip(audio.astype(np.float32), -1, 1) * 32767).astype(np.int16)
    digest = hashlib.sha1(audio.tobytes()).hexdigest()
    if history and history[0].get("digest") == digest:     # the same result reported again: one take
        return history
    n = (history[0]["n"] + 1) if history else 1
    path = app.files.save_wav(audio, f"take_{n:02d}_{kind}") if int(rate) == SR else None
    if path is None:
        return history
    v = dict(zip(FIELDS[kind] + SETTINGS, values))
    v["seed"] = seed if seed is not None else v.get("seed")
    take = {"n": n, "kind": kind, "when": time.strftime("%H:%M:%S"), "seconds": round(len(audio) / SR, 2),
            "seed": v["seed"], "text": str(v.get(TEXT_FIELD[kind]) or ""), "voice": voice_of(kind, v),
            "values": v, "path": path, "digest": digest}
    history.insert(0, take)
    for old in history[MAX_TAKES:]:
        _drop_file(old.get("path"))
    return history[:MAX_TAKES]


def take_html(t: dict) -> str:
    """One take: its label, the native player (replay), download, and its A / B buttons (history.js)."""
    n = int(t["n"])
    url = "gradio_api/file=" + html.escape(t["path"], quote=True)
    text = t["text"].replace("\n", " · ")
    label = (f"<b>#{n}</b> · {html.escape(TITLE[t['kind']])} · {html.escape(t['voice'])} · seed {t['seed']} · "
             f"{t['seconds']:.1f} s · {t['when']}")
    return (f'<div class="take" id="take-{n}" data-take="{n}">'
            f'<div class="take-label">{label}</div>'
            f'<div class="take-text">“{html.escape(text[:140])}{"…" if len(text) > 140 else ""}”</div>'
            f'<div class="take-row"><audio controls preload="metadata" id="take-audio-{n}" src="{url}"></audio>'
            f'<a class="take-dl" href="{url}" download="take-{n}.wav" title="Download the WAV">⬇</a>'
            f'<button class="take-ab" data-slot="A" data-take="{n}" title="Compare: this is A">A</button>'
            f'<button class="take-ab" data-slot="B" data-take="{n}" title="Compare: this is B">B</button></div>'
            "</div>")


AB_HTML = ('<div id="takes-ab"><button id="takes-play-a" class="takes-play" data-slot="A">▶ A '
           '<span class="takes-which">(choose a take)</span></button>'
           '<button id="takes-play-b" class="takes-play" data-slot="B">▶ B '
           '<span class="takes-which">(choose a take)</span></button></div>')

CSS = """
.take {border-top: 1px solid #e5e7eb; padding: 6px 0;}
.take-label {font-size: 0.85em;} .take-text {font-size: 0.85em; color: #6b7280;}
.take-row {display: flex; align-items: center; gap: 6px;} .take-row audio {height: 32px; flex: 1; min-width: 0;}
.take-ab, .takes-play {border: 1px solid #c7d2fe; border-radius: 6px; padding: 2px 8px; background: #eef2ff;}
.take-ab.chosen {background: #6366f1; color: white;}
#takes-ab {display: flex; gap: 8px; margin-bottom: 6px;} .takes-play {flex: 1; padding: 6px;}
.takes-play.playing {background: #6366f1; color: white;}
"""


def head() -> str:
    """The page's A/B player, inlined into <head> (next to the live player's script)."""
    return "<script>\n" + JS_FILE.read_text(encoding="utf-8") + "\n</script>"


def restorable(c) -> list:
    """Every component a take may be restored into (the outputs of the Restore buttons)."""
    names = dict.fromkeys(n for kind in FIELDS for n in FIELDS[kind] + SETTINGS)
    comps = [component(c, n) for n in names]
    return [x for x in comps if x is not None] + [c.randomize, c.tabs, c.status]


def restore(c, take: dict) -> dict:
    """Updates that put a take's text, voice and settings back into its tab (seed fixed: the same take again,
    or change one thing and make another) and show that tab."""
    out = {}
    for name, value in take["values"].items():
        comp = component(c, name)
        if comp is not None:
            out[comp] = value
    out[c.randomize] = False
    out[c.tabs] = gr.Tabs(selected=TAB[take["kind"]])
    out[c.status] = (f"**Restored take #{take['n']}** · {TITLE[take['kind']]} · seed {take['seed']} "
                     "(randomise is off: Generate makes the same take; change a setting for another)")
    return out


def build(app, c) -> None:
    """The Takes panel of the player column: the A/B buttons and the list (re-rendered when a take is added)."""
    c.history = gr.State([], delete_callback=forget)
    _record_when_done(app, c)
    with gr.Accordion(f"Takes of this session (last {MAX_TAKES})", open=True, elem_id="takes"):
        gr.HTML(AB_HTML)

        @gr.render(inputs=[c.history])
        def _takes(history):
            if not history:
                gr.Markdown("Every generation is kept here: play it again, download it, restore its settings, "
                            "or mark two takes A and B to compare them.", elem_id="takes-empty")
                return
            for t in history:
                gr.HTML(take_html(t), padding=False)
                btn = gr.Button(f"↺ Restore take #{t['n']}", size="sm", elem_id=f"take-{t['n']}-restore")
                btn.click(lambda t=t: restore(c, t), None, restorable(c), queue=False, show_progress="hidden",
                          api_visibility="undocumented")


def noting(c, fn, kind: str, inputs: list):
    """`fn` (a generating handler, a generator function) that first notes, for its browser session, which kind of
    generation it is and the values it was called with (by component name), so that the result it puts into the
    player becomes a take with exactly those settings. The signature, docstring and API of `fn` stay as they are."""
    names = {id(component(c, n)): n for k in FIELDS for n in FIELDS[k] + SETTINGS if component(c, n) is not None}
    pending = c.__dict__.setdefault("take_pending", {})

    @functools.wraps(fn)
    def gen(*args, **kwargs):
        request = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, gr.Request)), None)
        if kind in FIELDS and request is not None:
            values = {names[id(comp)]: a for comp, a in zip(inputs, args) if id(comp) in names}
            pending.pop(session_key(request), None)
            pending[session_key(request)] = (kind, values)
            while len(pending) > 1000:            # sessions whose last generation was stopped: oldest first
                pending.pop(next(iter(pending)))
        yield from fn(*args, **kwargs)
    return gen


def _record_when_done(app, c) -> None:
    """A new result in the player (`final`) becomes a take of the generation this session started last."""
    pending = c.__dict__.setdefault("take_pending", {})

    def on_final(history, final, seed, request: gr.Request):
        key = session_key(request)
        noted = pending.pop(key, None) if final is not None else None
        if noted is None:
            return gr.skip()
        kind, v = noted
        new = record(app, kind, history, final, seed, *[v.get(n) for n in FIELDS[kind] + SETTINGS])
        if new == list(history or []):     # the last take's result reported again: still waiting for this one
            pending.setdefault(key, noted)
            return gr.skip()
        return new

    c.final.change(on_final, [c.history, c.final, c.seed], [c.history], show_progress="hidden",
                   api_visibility="undocumented")
