"""The page: `build(app)` makes the gr.Blocks (banner, tabs Preset / Clone / Blend / Voice design, the player
column, footer) and wires every event to its handler with its stable `api_name`, `cancels=` for Stop and the
shared "tts" concurrency group. Also the small UI-only callbacks (slot visibility, blend shares), the
examples and the CSS. Components are kept by name in `app.c`, which the handlers use as output keys."""
from __future__ import annotations

import html
import json
import logging
from pathlib import Path

import gradio as gr

from tts_engine.voices import blend as blendlib

from ui.config import DEFAULT_SAMPLING, FILE_CHOICE, ROLE_LABEL
from ui import dialogue_tab, history, longform_tab
from ui import listen_tab
from ui import live_player as lp
from ui import model_loader
from ui import transcribe
from ui.handlers import api_doc, guard
from ui.roles import MEASURING

log = logging.getLogger("qwen3_tts_live")

CSS = """
#random-weights-banner {border: 2px solid #f59e0b; background: #fffbeb; color: #78350f; border-radius: 8px;
  padding: 10px 14px;}
#random-weights-banner * {color: #78350f !important;}
#status {min-height: 2.2em; font-variant-numeric: tabular-nums;}
.share {text-align: center; font-weight: 600; padding-top: 1.6em;}
.sweep-row .block {min-width: 150px;}
""" + history.CSS


def load_examples(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        log.warning("no examples (%s)", e)
        return {}


def build(app) -> gr.Blocks:
    """The whole page for `app` (a ui.app.TTSApp); fills `app.c`."""
    c = app.c
    models, voices, limits = app.models, app.voices, app.limits
    langs = [("Auto", "auto")] + [(lang.title(), lang) for lang in models.languages()[1:]]
    max_frames = limits.max_new_tokens
    default_frames = min(max_frames, 100) if models.random_roles else max_frames
    choices = voices.choices(None)
    default_voice = "ryan" if "ryan" in models.speakers() else (choices[0][1] if choices else None)
    examples = load_examples(app.cfg.examples_file)
    with gr.Blocks(title="Qwen3-TTS Live", delete_cache=(600, limits.file_ttl_seconds)) as demo:
        c.session = gr.State({})
        c.banner = gr.Markdown(models.banner_text(), visible=bool(models.random_roles), elem_id="random-weights-banner")
        gr.Markdown("# 🗣️ Qwen3-TTS Live\nStreaming text-to-speech with the Qwen3-TTS 12 Hz models: speech starts "
                    "playing while the rest is being generated. Pick a preset voice, clone your own from a few "
                    "seconds of audio, or blend voices. Every generation ends with a lossless WAV.")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                with gr.Tabs() as c.tabs:
                    _preset_tab(app, c, choices, default_voice, langs, examples)
                    _clone_tab(app, c, langs)
                    _blend_tab(c, voices.choices(None, blend=True), langs)
                    dialogue_tab.build(app, c, langs)
                    longform_tab.build(app, c, langs)
                    if models.has("voice_design"):
                        _design_tab(c, langs, examples)
                    listen_tab.build(app, c, langs)
            with gr.Column(scale=2, min_width=320):
                _player_column(app, c, max_frames, default_frames)
        footer = gr.Markdown(_footer(models))
        _wire(app, c)
        demo.load(None, None, None, js=listen_tab.load_js())   # the Listen tab's trial player (assets/listen.js)
        # voices uploaded through the API since the page was built appear when it is (re)loaded
        demo.load(lambda s: app._dropdowns(s), [c.session], [c.p_voice, *c.slot_voice], api_name="ui_voices",
                  queue=False, show_progress="hidden", api_visibility="undocumented")
        # what the engines chose (measured while they loaded, after the page was first served) on each page load
        demo.load(lambda: _footer(models), None, footer, api_name="ui_footer", queue=False, show_progress="hidden",
                  api_visibility="undocumented")
    return demo


def _player_column(app, c, max_frames, default_frames):
    # The page plays through its own player (assets/live_player.js, fed by ui/live_player.py), so the `live`
    # output is hidden here; it keeps its place in the API: where ffmpeg exists Gradio streams AAC into it for
    # gradio_client callers, without ffmpeg it stays empty.
    if app.cfg.gradio_live_audio:
        c.live = gr.Audio(label="Live (streaming)", streaming=True, autoplay=False, interactive=False,
                          visible=False, elem_id="live-audio", buttons=[])
    else:
        c.live = gr.Audio(label="Live", interactive=False, visible=False, elem_id="live-audio", buttons=[])
    c.live_token = gr.Textbox("", visible=False, elem_id="live-token")   # set by the page's player (js=)
    c.status = gr.Markdown("Ready.", elem_id="status")
    gr.HTML(model_loader.STATE_HTML + lp.STATUS_HTML, elem_id="live-player")   # "playing · click → sound N ms", written by the player
    c.stop_btn = gr.Button("■ Stop", variant="stop", elem_id="stop-btn", elem_classes=[lp.STOP_CLASS])
    c.final = gr.Audio(label="Full result (lossless WAV)", format="wav", interactive=False, elem_id="final-audio",
                       buttons=["download"])
    c.subs = gr.File(label="Subtitles of this result (SRT, WebVTT: one cue per sentence group)", interactive=False,
                     file_count="multiple", height=90, elem_id="take-subtitles")
    c.words_btn = gr.Button("Word timings (estimated by speech recognition)", size="sm", elem_id="take-words")
    with gr.Row():
        c.seed = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="seed", scale=2)
        c.randomize = gr.Checkbox(value=True, label="Randomise seed", scale=1)
    c.speed = gr.Slider(0.25, 4.0, value=1.0, step=0.05, label="Speed (pitch kept)", elem_id="speed")
    with gr.Accordion("Advanced: sampling", open=False):
        c.temperature = gr.Slider(0.1, 1.5, value=DEFAULT_SAMPLING["temperature"], step=0.05, label="Temperature")
        c.top_k = gr.Slider(0, 200, value=DEFAULT_SAMPLING["top_k"], step=1, label="Top-k (0 = off)")
        c.top_p = gr.Slider(0.05, 1.0, value=DEFAULT_SAMPLING["top_p"], step=0.05, label="Top-p")
        c.rep = gr.Slider(1.0, 1.5, value=DEFAULT_SAMPLING["repetition_penalty"], step=0.01,
                          label="Repetition penalty")
        c.max_new = gr.Slider(1, max_frames, value=default_frames, step=1,
                              label="Max length per sentence group (frames of 80 ms)")
        gr.Markdown("Long text is split at sentence boundaries and streamed in order, with the same voice and "
                    "seed for every part.")
    _text_takes_box(c)
    history.build(app, c)


def _text_takes_box(c):
    """Pause tags, the session's pronunciation dictionary, numbers read out, the take guard (docs/text-and-takes.md)."""
    with gr.Accordion("Text and takes: pauses, pronunciation, take checks", open=False):
        gr.Markdown("Write `[pause 0.5s]` or `[pause 500ms]` in any text for exactly that silence. The dictionary "
                    "respells whole words or phrases for this session (a word with a capital letter matches only "
                    "that spelling).")
        c.lexicon = gr.Dataframe(headers=["word or phrase", "say it as"], column_count=2, column_limits=(2, 2), row_count=3,
                                 datatype=["str", "str"], type="array", interactive=True, label="Pronunciation dictionary",
                                 elem_id="lexicon")
        c.read_out = gr.Checkbox(True, label="Read numbers, dates, times, currencies and abbreviations as words")
        with gr.Row():
            c.take_mode = gr.Radio([("Off", "off"), ("Redo failed takes", "redo"), ("Best of N", "best")],
                                   value="redo", label="Take check", scale=3)
            c.takes = gr.Slider(0, 5, value=2, step=1, label="Redos / N", scale=2)
        c.text_settings_note = gr.Markdown("", elem_id="text-settings")
        c.preview = gr.Textbox("", label="What the model will read (last edited text)", lines=2, interactive=False,
                               elem_id="text-preview")


def _footer(models) -> str:
    """One line for visitors (the models, their precision, lossy or not) and a closed "Details" fold with what
    `--quantize auto` chose and what serves each part of a frame (`engine.paths()` of each loaded engine)."""
    rows = [f"{ROLE_LABEL[r]}: `{i.checkpoint}`" + (" (random tiny weights)" if i.random else "")
            for r, i in models.roles.items()]
    details = []
    precision = models.expected_precision()
    if precision:
        lossy = "weights" in precision   # a quantised label names the weights' format
        rows.append(f"precision: **{precision}**" + (" (lossy: quantised weights; `--quantize none` for the "
                                                     "checkpoint's own)" if lossy else "" if precision == MEASURING
                                                     else " (not lossy: the checkpoint's own weights)"))
        why = models.expected_choice()[1]
        if why:
            details.append(f"chosen by `--quantize auto`: {why}")
    if models.cfg.backend:
        details.append(f"The speech server at `{models.cfg.backend}` generates the audio: the `X-TTS-Paths` header "
                       "of its answers says what serves each part of a frame there.")
    else:
        details.append(_paths_html(models.paths()))
    return ("<small>Models: " + " · ".join(rows) + ". Preset clips: see `presets/README.md` (source and licence "
            "per voice). Use the microphone over HTTPS (or on localhost). API: “Use via API” below; programs that "
            "want audio as it is generated: `POST /v1/audio/speech` with `stream=true`.</small>\n\n"
            "<details id=\"engine-details\"><summary><small>Details: what serves each part of a frame</small>"
            "</summary>\n\n" + "\n\n".join(details) + "\n\n</details>")


def _paths_html(paths: dict[str, dict[str, dict[str, str]]]) -> str:
    """`engine.paths()` of each loaded role as a list (one list when every role's is the same)."""
    if not paths:
        return "Shown once a model has loaded (reload the page)."

    def item(part: str, e: dict) -> str:
        how, why = e.get("how", ""), e.get("why", "")
        note = f"{how}: {why}" if why and why != how else how
        return f"<li>{html.escape(part)}: <b>{html.escape(e.get('path', ''))}</b> ({html.escape(note)})</li>"

    def items(p: dict) -> str:
        return "".join(item(part, e) for part, e in p.items())

    groups = list(paths.items())
    if all(p == groups[0][1] for _, p in groups):
        return f"<ul>{items(groups[0][1])}</ul>"
    return "".join(f"<p>{html.escape(ROLE_LABEL[r])}:</p><ul>{items(p)}</ul>" for r, p in groups)


def _preset_examples(voices, examples: dict) -> list[list]:
    valid = {v for _, v in voices.choices(None)}
    return [[ex["text"], ex["voice"], ex.get("language", "auto"), ex.get("instruct", "")]
            for ex in examples.get("preset", []) if ex.get("voice") in valid]


def _preset_tab(app, c, choices, default_voice, langs, examples):
    with gr.Tab("Preset voices", id="tab-preset"):
        with gr.Row():
            c.p_voice = gr.Dropdown(choices, value=default_voice, label="Voice", allow_custom_value=True, scale=3,
                                    info="CustomVoice speakers (native language shown; each speaks every "
                                         "language), our preset clips (Base model), your voices of this session")
            c.p_lang = gr.Dropdown(langs, value="auto", label="Language", scale=1)
        c.p_instruct = gr.Textbox("", label="Instruction (speaking style)",
                                  visible=app.voices.supports_instruct(default_voice),
                                  placeholder="e.g. Speak with excitement, a little faster")
        c.p_text = gr.Textbox(label="Text", lines=4, elem_id="preset-text",
                              value="Hello! This is Qwen3-TTS Live, speaking while it thinks.")
        c.p_btn = gr.Button("▶ Generate", variant="primary", elem_id="preset-generate",
                            elem_classes=[lp.GENERATE_CLASS])
        ex = _preset_examples(app.voices, examples)
        if ex:
            cv = app.models.roles.get("custom_voice")
            instruct = bool(cv and cv.supports_instruct)
            gr.Examples(ex if instruct else [e[:3] for e in ex],
                        [c.p_text, c.p_voice, c.p_lang] + ([c.p_instruct] if instruct else []), label="Examples")


def _clone_tab(app, c, langs):
    with gr.Tab("Clone", id="tab-clone", visible=app.models.has("base")):
        gr.Markdown("Upload or record 3-10 s of clean speech. With its transcript the clone is closest "
                    "(in-context); without one, only the speaker embedding is used (x-vector only), which is "
                    "also what blending uses.")
        with gr.Row():
            c.ref_audio = gr.Audio(sources=["upload", "microphone"], type="filepath", label="Reference clip",
                                   elem_id="ref-audio")
            with gr.Column():
                c.ref_text = gr.Textbox("", label="Transcript of the clip", lines=3,
                                        placeholder="Exactly what is said in the clip")
                transcribe.add_button(c)
                c.xvec = gr.Checkbox(False, label="x-vector only (no transcript; lower similarity)")
                c.voice_name = gr.Textbox("My voice", label="Name this voice", max_lines=1)
        with gr.Row():
            c.c_lang = gr.Dropdown(langs, value="auto", label="Language")
            c.file_format = gr.Radio(["safetensors", "json"], value="safetensors", label="Voice file format")
        c.c_text = gr.Textbox(label="Text", lines=3, value="This is my cloned voice, streaming as it speaks.")
        c.clone_btn = gr.Button("▶ Clone and speak", variant="primary", elem_id="clone-generate",
                                elem_classes=[lp.GENERATE_CLASS])
        c.voice_file = gr.File(label="Your voice file (reusable: load it here later, or in the Blend tab)",
                               interactive=False, height=120)
        with gr.Accordion("Load a voice file", open=False):
            c.load_file = gr.File(label="Voice file (.safetensors or .json)", file_types=[".safetensors", ".json"])
            c.load_name = gr.Textbox("", label="Name (optional)", max_lines=1)
            c.load_btn = gr.Button("Load into this session")
        clips = [[str(p.clip), p.transcript, p.name] for p in app.voices.presets]
        if clips:
            gr.Examples(clips, [c.ref_audio, c.ref_text, c.voice_name], label="Example reference clips")


def _blend_tab(c, blend_choices, langs):
    with gr.Tab("Blend", id="tab-blend"):
        gr.Markdown("Mix 2-4 voices of **one** checkpoint (CustomVoice speakers with each other, cloned voices "
                    "with each other). Two voices: spherical interpolation; more: normalised direction with the "
                    "norm restored. Blends use speaker embeddings only (x-vector mode).")
        c.n_voices = gr.Radio([2, 3, 4], value=2, label="Number of voices")
        plain = [v for _, v in blend_choices if v != FILE_CHOICE]
        preferred = [v for v in ("ryan", "vivian", "serena", "aiden") if v in plain]
        plain = preferred + [v for v in plain if v not in preferred]
        defaults = [plain[i % len(plain)] for i in range(4)] if plain else [None] * 4
        c.slot_group, c.slot_voice, c.slot_file, c.slot_weight, c.slot_share = [], [], [], [], []
        for i in range(4):
            with gr.Group(visible=i < 2) as g:
                with gr.Row(equal_height=True):
                    dd = gr.Dropdown(blend_choices, value=defaults[i], label=f"Voice {'ABCD'[i]}", scale=4,
                                     allow_custom_value=True)
                    w = gr.Slider(0, 100, value=50, step=1, label="Weight", scale=3, visible=False)
                    sh = gr.Markdown("25 %", elem_classes="share", visible=False)
                f = gr.File(label=f"Voice file for {'ABCD'[i]}", file_types=[".safetensors", ".json"], visible=False)
            c.slot_group.append(g)
            c.slot_voice.append(dd)
            c.slot_file.append(f)
            c.slot_weight.append(w)
            c.slot_share.append(sh)
        with gr.Row(visible=True) as c.ab_row:
            c.ab = gr.Slider(0, 100, value=50, step=5, label="A ◀── mix ──▶ B (% of B)", scale=4)
            c.ab_share = gr.Markdown("A 50 % · B 50 %", elem_classes="share")
        with gr.Row():
            c.b_lang = gr.Dropdown(langs, value="auto", label="Language")
        c.b_text = gr.Textbox(label="Text", lines=2, value="The quick brown fox jumps over the lazy dog.")
        with gr.Row():
            c.blend_btn = gr.Button("▶ Speak with the blend", variant="primary", elem_id="blend-generate",
                                    elem_classes=[lp.GENERATE_CLASS])
            c.sweep_btn = gr.Button("Sweep A → B (0/25/50/75/100 %)", elem_id="blend-sweep")
        with gr.Row(elem_classes="sweep-row") as c.sweep_row:
            c.sweep = [gr.Audio(label=lab, interactive=False, format="wav", buttons=["download"],
                                elem_id=f"sweep-{int(t * 100)}", min_width=90)
                       for t, lab in zip(blendlib.SWEEP, ["0 % (A)", "25 %", "50 %", "75 %", "100 % (B)"])]
        with gr.Accordion("Export the blend as a voice file", open=False):
            with gr.Row():
                c.blend_name = gr.Textbox("My blend", label="Name", max_lines=1)
                c.blend_format = gr.Radio(["safetensors", "json"], value="safetensors", label="Format")
            c.export_btn = gr.Button("Export")
            c.export_file = gr.File(label="Blended voice file", interactive=False)
        gr.Examples([["Good evening. Here is the news, read by a voice that does not exist."],
                     ["Two voices, one sentence: listen to how the timbre moves from A to B."]],
                    [c.b_text], label="Examples")


def _design_tab(c, langs, examples):
    with gr.Tab("Voice design", id="tab-design"):
        c.d_desc = gr.Textbox(label="Describe the voice", lines=2,
                              value="A warm, low male voice, speaking slowly and calmly.")
        c.d_lang = gr.Dropdown(langs, value="auto", label="Language")
        c.d_text = gr.Textbox(label="Text", lines=3, value="Welcome. Let me tell you a story.")
        c.design_btn = gr.Button("▶ Design and speak", variant="primary", elem_id="design-generate",
                                 elem_classes=[lp.GENERATE_CLASS])
        with gr.Row():   # design, then clone: the last take kept as a voice (Base model)
            c.keep_name = gr.Textbox("My designed voice", label="Keep this voice as", max_lines=1, scale=3)
            c.keep_format = gr.Radio(["safetensors", "json"], value="safetensors", label="Format", scale=2)
            c.keep_btn = gr.Button("Keep the voice", elem_id="design-keep", scale=1)
        c.keep_file = gr.File(label="Your designed voice (reusable in every tab as my:<name>)", interactive=False,
                              height=120)
        ex = [[e["text"], e["description"]] for e in examples.get("design", [])]
        if ex:
            gr.Examples(ex, [c.d_text, c.d_desc], label="Examples")


def _wire(app, c):
    """Every event: handler, inputs (in the order of the handler's arguments), outputs, api_name."""
    common = [c.seed, c.randomize, c.temperature, c.top_k, c.top_p, c.rep, c.max_new, c.speed]
    gen_out = [c.live, c.final, c.status, c.seed]
    dd_out = [c.p_voice, *c.slot_voice]
    slot_in = [x for i in range(4) for x in (c.slot_voice[i], c.slot_file[i], c.slot_weight[i])]
    blend_in = [c.b_text, c.n_voices] + slot_in + [c.ab, c.b_lang, c.session] + common
    kw = dict(concurrency_id="tts", concurrency_limit=app.concurrency, show_progress="minimal")

    def on(button, fn, inputs, outputs, name, **extra):
        return button.click(guard(fn), inputs, outputs, api_name=name, api_description=api_doc(fn), **extra)

    def live(button, fn, inputs, outputs, name):
        """A generating event that the page's player listens to: its `js=` puts the click's token in as the
        last input (`live_token`), and the player learns when the server side is over."""
        full = inputs + [c.live_token]   # the page player's request may start it first (ui/early_start.py)
        ev = on(button, app.early.attachable(name, history.noting(c, fn, name, inputs), full), full, outputs, name,
                js=lp.token_js(name), **kw)
        lp.after_event(ev)
        return ev

    events = [live(c.p_btn, app.preset, [c.p_text, c.p_voice, c.p_lang, c.p_instruct, c.session] + common, gen_out,
                   "preset")]
    if app.models.has("base"):
        events.append(live(c.clone_btn, app.clone, [c.ref_audio, c.ref_text, c.xvec, c.voice_name, c.file_format,
                                                    c.c_text, c.c_lang, c.session] + common,
                           gen_out + [c.voice_file, c.session] + dd_out, "clone"))
        on(c.load_btn, app.load_voice, [c.load_file, c.load_name, c.session], [c.session, c.status] + dd_out,
           "load_voice")
        transcribe.wire(app, c, on)
    events.append(live(c.blend_btn, app.blend, blend_in, gen_out, "blend"))
    events.append(on(c.sweep_btn, app.blend_sweep, blend_in, c.sweep + [c.final, c.status, c.seed], "blend_sweep",
                     **kw))
    on(c.export_btn, app.blend_export, [c.n_voices] + slot_in + [c.ab, c.blend_name, c.blend_format, c.session],
       [c.export_file, c.session, c.status] + dd_out, "blend_export")
    events.append(dialogue_tab.wire(app, c, live, common, gen_out))
    if app.models.has("voice_design"):
        events.append(live(c.design_btn, app.design, [c.d_text, c.d_desc, c.d_lang] + common, gen_out, "design"))
    events += longform_tab.wire(app, c, live, on, common[:-1], gen_out)
    longform_tab.wire_subtitles(app, c, on)
    listen_tab.wire(app, c, on)
    _wire_text_takes(app, c, on)
    c.events = events
    c.stop_btn.click(app.stop, None, [c.status], cancels=events, api_name="stop", queue=False)

    # UI-only helpers (stable names, not part of the documented API)
    ui = dict(queue=False, show_progress="hidden", api_visibility="undocumented")
    c.n_voices.change(lambda n: slot_visibility(c, n), [c.n_voices],
                      [c.ab_row, c.sweep_btn, c.sweep_row] + c.slot_group + c.slot_weight + c.slot_share,
                      api_name="ui_slots", **ui)
    share_in = [c.n_voices, *c.slot_weight, c.ab]
    for j, comp in enumerate(share_in):
        comp.change(shares, share_in, c.slot_share + [c.ab_share], api_name=f"ui_shares_{j}", **ui)
    for i in range(4):
        c.slot_voice[i].change(lambda v: gr.update(visible=v == FILE_CHOICE), [c.slot_voice[i]], [c.slot_file[i]],
                               api_name=f"ui_slot_file_{i + 1}", **ui)
    c.p_voice.change(lambda v, s: gr.update(visible=app.voices.supports_instruct(v, s)), [c.p_voice, c.session],
                     [c.p_instruct], api_name="ui_instruct", **ui)


def _wire_text_takes(app, c, on):
    """The session's text and take settings (/text_settings), the preview of what the model reads, keep a design."""
    ins = [c.lexicon, c.read_out, c.take_mode, c.takes]
    for j, comp in enumerate(ins):
        comp.change(guard(app.text_settings), ins, [c.text_settings_note], queue=False, show_progress="hidden",
                    api_name="text_settings" if j == 0 else f"ui_text_settings_{j}",
                    api_description=api_doc(app.text_settings), api_visibility="public" if j == 0 else "undocumented")
    texts = [(c.p_text, c.p_lang), (getattr(c, "c_text", None), getattr(c, "c_lang", None)), (c.b_text, c.b_lang),
             (getattr(c, "d_text", None), getattr(c, "d_lang", None))]
    for j, (t, lang) in enumerate(x for x in texts if x[0] is not None):
        t.change(guard(app.preview), [t, lang], [c.preview], api_name="preview" if j == 0 else f"ui_preview_{j}",
                 api_description=api_doc(app.preview), queue=False, show_progress="hidden",
                 api_visibility="public" if j == 0 else "undocumented")
    if hasattr(c, "keep_btn") and app.models.has("base"):
        on(c.keep_btn, app.keep_design, [c.keep_name, c.keep_format, c.session],
           [c.keep_file, c.session, c.status, c.p_voice, *c.slot_voice], "keep_design")
    elif hasattr(c, "keep_btn"):
        c.keep_btn.visible = False


def slot_visibility(c, n_voices) -> dict:
    n = int(n_voices)
    out = {c.ab_row: gr.update(visible=n == 2), c.sweep_btn: gr.update(visible=n == 2),
           c.sweep_row: gr.update(visible=n == 2)}
    for i in range(4):
        out[c.slot_group[i]] = gr.update(visible=i < n)
        out[c.slot_weight[i]] = gr.update(visible=n > 2)
        out[c.slot_share[i]] = gr.update(visible=n > 2)
    return out


def shares(n_voices, w1, w2, w3, w4, a_to_b) -> tuple:
    """The blend shares shown next to the weight sliders, and the A/B split of the mix slider."""
    n = int(n_voices)
    pct = blendlib.shares_percent([float(w or 0) for w in [w1, w2, w3, w4][:n]])
    t = float(a_to_b or 0)
    return (*[f"{p} %" for p in pct], *["" for _ in range(4 - n)], f"A {100 - t:.0f} % · B {t:.0f} %")
