"""Serving: the launch settings of the page (`launch_kwargs`: theme, CSS, upload limit, allowed paths) and
`create_server`, one FastAPI app with the OpenAI-compatible speech API (`/v1/audio/speech`,
`/v1/audio/voices`, from server/openai_api.py) on the same engines as the page, and the page mounted at `/`."""
from __future__ import annotations

import gradio as gr

from ui import history, live_player, model_loader
from ui.layout import CSS


def launch_kwargs(app) -> dict:
    return dict(theme=gr.themes.Soft(primary_hue="indigo", secondary_hue="pink"), css=CSS,
                max_file_size=app.limits.max_upload_bytes,
                allowed_paths=[str(app.cfg.presets_dir), str(app.files.dir),   # + the session's takes (history.py)
                               str(app.jobs_root())])                          # long-form jobs' zips (longform_tab.py)


def create_server(app, demo: gr.Blocks):
    """The UI and the speech API on one server. `demo.queue()` must have been called."""
    from fastapi import FastAPI

    from server.openai_api import install

    api = FastAPI(title="Qwen3-TTS Live")
    install(api, app.models.registry, app.limits, take_guard=app.take_guard)   # the page's guard, shared
    model_loader.install(api, app.models.loader)   # GET /live/models: the page's "models ready" indicator
    # GET/POST /live/{token}: the page's player's PCM stream (POST may start the click's generation), its JS files
    live_player.install(api, app.live, starter=app.early)
    kw = launch_kwargs(app)
    return gr.mount_gradio_app(api, demo, path="/", theme=kw["theme"], css=kw["css"],
                               head=live_player.HEAD + model_loader.HEAD + history.head(),
                               max_file_size=kw["max_file_size"], allowed_paths=kw["allowed_paths"])
