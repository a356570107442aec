"""The Dialogue tab: the script as text and as a table (each edit of one rewrites the other), a voice slot per
speaker (filled with the script's names as they appear), the pause between turns, the Speak button (/dialogue)
and the per-line WAVs. `build` makes the components (into `c`), `wire` connects them."""
from __future__ import annotations

import gradio as gr

from ui import live_player as lp
from ui.dialogue_script import (DEFAULT_PAUSE_S, HEADERS, MAX_PAUSE_S, MAX_SPEAKERS, format_script, from_rows,
                              parse_script, speakers, to_rows)

EXAMPLE = ("Ryan: Did you hear that? Something moved in the garden.\n"
           "Vivian [whispering]: It's only the wind. Go back to sleep.\n"
           "Ryan: The wind does not open gates.")


def _default_voices(choices: list[tuple[str, str]]) -> list[str | None]:
    plain = [v for _, v in choices]
    preferred = [v for v in ("ryan", "vivian", "aiden", "serena") if v in plain]
    plain = preferred + [v for v in plain if v not in preferred]
    return [plain[i % len(plain)] for i in range(MAX_SPEAKERS)] if plain else [None] * MAX_SPEAKERS


def build(app, c, langs) -> None:
    choices = app.voices.choices(None)
    lines = parse_script(EXAMPLE, strict=False)
    names = speakers(lines)
    with gr.Tab("Dialogue", id="tab-dialogue"):
        gr.Markdown("A conversation: one turn per line, `Name: text`, or `Name [instruction]: text` where the "
                    "voice's checkpoint follows instructions. Each name gets a voice (presets, preset clips, your "
                    "clones, blends and voice files). The next line is generated while one plays.")
        c.dlg_script = gr.Textbox(EXAMPLE, label="Script", lines=6, elem_id="dialogue-script")
        with gr.Accordion("Table view (edit here or in the script)", open=False):
            c.dlg_table = gr.Dataframe(to_rows(lines), headers=HEADERS, type="array", interactive=True,
                                       column_count=3, datatype="str", elem_id="dialogue-table", wrap=True)
        defaults = _default_voices(choices)
        c.dlg_speaker, c.dlg_voice = [], []
        for i in range(MAX_SPEAKERS):
            with gr.Row(equal_height=True):
                c.dlg_speaker.append(gr.Textbox(names[i] if i < len(names) else "", label=f"Speaker {i + 1}",
                                                max_lines=1, scale=2, elem_id=f"dialogue-speaker-{i + 1}"))
                c.dlg_voice.append(gr.Dropdown(choices, value=defaults[i], label="Voice", allow_custom_value=True,
                                               scale=3, elem_id=f"dialogue-voice-{i + 1}"))
        with gr.Row():
            c.dlg_pause = gr.Slider(0, MAX_PAUSE_S, value=DEFAULT_PAUSE_S, step=0.05, label="Pause between turns (s)",
                                    elem_id="dialogue-pause")
            c.dlg_lang = gr.Dropdown(langs, value="auto", label="Language")
        c.dlg_btn = gr.Button("▶ Speak the dialogue", variant="primary", elem_id="dialogue-generate",
                              elem_classes=[lp.GENERATE_CLASS])
        c.dlg_files = gr.File(label="One WAV per line", file_count="multiple", interactive=False,
                              elem_id="dialogue-files")


def assign_names(current: list[str], names: list[str]) -> list[str]:
    """The speaker slots for `names` (the script's speakers in order): a name already in a slot keeps it (and so
    its voice), new names take the free slots in order."""
    wanted = {n.lower(): n for n in names}
    slots = [cur if str(cur or "").strip().lower() in wanted else "" for cur in current]
    placed = {s.lower() for s in slots if s}
    for n in names:
        if n.lower() not in placed and "" in slots:
            slots[slots.index("")] = n
            placed.add(n.lower())
    return slots


def _names_update(c, lines, current) -> dict:
    slots = assign_names(list(current), speakers(lines))
    return {box: gr.update(value=v) for box, v in zip(c.dlg_speaker, slots)}


def script_to_table(c, script, *current) -> dict:
    lines = parse_script(script, strict=False)
    return {c.dlg_table: to_rows(lines), **_names_update(c, lines, current)}


def table_to_script(c, rows, *current) -> dict:
    lines = from_rows(rows)
    return {c.dlg_script: format_script(lines), **_names_update(c, lines, current)}


def wire(app, c, live, common: list, gen_out: list):
    """The /dialogue event (returned, for Stop's `cancels=`) and the UI-only syncing."""
    inputs = [c.dlg_script] + [x for i in range(MAX_SPEAKERS) for x in (c.dlg_speaker[i], c.dlg_voice[i])]
    ev = live(c.dlg_btn, app.dialogue, inputs + [c.dlg_pause, c.dlg_lang, c.session] + common,
              gen_out + [c.dlg_files], "dialogue")
    ui = dict(queue=False, show_progress="hidden", api_visibility="undocumented")
    c.dlg_script.input(lambda s, *cur: script_to_table(c, s, *cur), [c.dlg_script, *c.dlg_speaker],
                       [c.dlg_table, *c.dlg_speaker], api_name="ui_dialogue_table", **ui)
    c.dlg_table.input(lambda rows, *cur: table_to_script(c, rows, *cur), [c.dlg_table, *c.dlg_speaker],
                      [c.dlg_script, *c.dlg_speaker], api_name="ui_dialogue_script", **ui)
    # the session's voices (clones, loaded files, exported blends) become choosable as they appear
    c.session.change(lambda s: [gr.update(choices=app.voices.choices(s)) for _ in c.dlg_voice], [c.session],
                     c.dlg_voice, api_name="ui_dialogue_voices", **ui)
    return ev
