#!/usr/bin/env python3
"""Qwen3-TTS Live: the Gradio app (preset voices, cloning, blending, voice design), streaming as it speaks.

    python app.py                       # http://0.0.0.0:7860, CustomVoice + Base 0.6B, loading in the background
    python app.py --tiny                # tiny random checkpoints: no download, the audio is noise
    python app.py --help                # every flag; each has an environment variable too

This file is the entry point only: flags and environment -> `AppConfig`, build the page, serve it together
with the OpenAI-compatible speech API (on Hugging Face ZeroGPU: through `demo.launch()`, see ui/zerogpu.py). The app itself lives in the package `ui/` (see ui/__init__.py for
its rooms); the engine in `tts_engine/`, the speech API in `server/`.

API (gradio_client, `Client(url).predict(..., api_name="/preset")`): `/preset`, `/clone`, `/blend`,
`/blend_sweep`, `/blend_export`, `/design`, `/load_voice`, `/stop`; each documents its arguments on the
page's "Use via API" view; the final output holds the lossless WAV. Programs that want the audio while it is
generated use `POST /v1/audio/speech` with `stream=true` (Gradio's own streaming audio needs ffmpeg).
"""
from __future__ import annotations

from ui import zerogpu  # first: imports `spaces` (Hugging Face ZeroGPU) before anything imports torch

import argparse
import logging
import os
from pathlib import Path

from tts_engine import QUANT_MODES, TTSError, cache_paths
from ui.config import DEFAULT_CHECKPOINTS, ENV, ROLE_LABEL, ROLES, AppConfig
from ui.app import TTSApp
from ui.server import create_server

log = logging.getLogger("qwen3_tts_live")

__all__ = ["AppConfig", "TTSApp", "create_server", "parse_args", "config_from_args", "main"]


# --- command line ---------------------------------------------------------------------------------------

def _env_bool(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description="Qwen3-TTS Live: streaming text-to-speech web app",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default=env("GRADIO_SERVER_NAME", "0.0.0.0"), help="address to listen on "
                   "[GRADIO_SERVER_NAME]")
    p.add_argument("--port", type=int, default=int(env("TTS_PORT") or env("GRADIO_SERVER_PORT") or 7860),
                   help="port [TTS_PORT or GRADIO_SERVER_PORT]")
    p.add_argument("--device", default=env("TTS_DEVICE"), help="cuda, cuda:1, cpu (default: cuda if present) "
                   "[TTS_DEVICE]")
    p.add_argument("--dtype", default=env("TTS_DTYPE"), choices=["fp32", "bf16", "fp16"],
                   help="weights dtype (default: bf16 on GPU; on a CPU bf16 where native (AVX-512 BF16 / AMX), else fp32) [TTS_DTYPE]")
    for role, flag in (("custom_voice", "--custom-voice-model"), ("base", "--base-model"),
                       ("voice_design", "--voice-design-model")):
        p.add_argument(flag, dest=role, default=env(ENV[role], DEFAULT_CHECKPOINTS[role]),
                       help=f"{ROLE_LABEL[role]} checkpoint: hub id or local folder; empty to disable [{ENV[role]}]")
    p.add_argument("--quantize", default=env("TTS_QUANTIZE", "auto"), choices=["auto", "none", *QUANT_MODES],
                   help="quantised talker and code predictor on a CPU (lossy, faster; labelled on the page and in "
                        "the API): int8 / int4 weights, w8a8 int8 weights x int8 activations. auto: the fastest "
                        "mode measured on this CPU whose quality against fp32 is acceptable (the page's footer "
                        "says which and why; none when a dtype is given); none: the checkpoint's weights "
                        "[TTS_QUANTIZE]")
    p.add_argument("--eager", action="store_true", default=_env_bool("TTS_EAGER"),
                   help="no CUDA graphs on a GPU (the eager per-frame step) [TTS_EAGER]")
    p.add_argument("--backend", default=env("TTS_BACKEND"),
                   help="URL of a remote OpenAI-compatible speech server (vLLM-Omni, or another instance of this "
                        "app) to use instead of local models [TTS_BACKEND]")
    p.add_argument("--tiny", action="store_true", default=_env_bool("TTS_TINY"),
                   help="tiny random checkpoints for every role (no download; the audio is noise) [TTS_TINY]")
    p.add_argument("--no-offline-fallback", dest="offline_fallback", action="store_false",
                   default=not _env_bool("TTS_NO_OFFLINE_FALLBACK"),
                   help="fail instead of falling back to random tiny checkpoints when the hub cannot be reached "
                        "[TTS_NO_OFFLINE_FALLBACK]")
    p.add_argument("--cache-dir", default=env(cache_paths.ENV),
                   help="the cache folder: tiny checkpoints, preset and uploaded voices, the measured kernel table, "
                        "dtype and quality choices, the compiled predictor (default ~/.cache/qwen3-tts-live) "
                        "[TTS_CACHE_DIR]")
    p.add_argument("--concurrency", type=int, default=int(env("TTS_CONCURRENCY") or 0) or None,
                   help="generations running at once (default 16 on GPU, 4 on CPU) [TTS_CONCURRENCY]")
    p.add_argument("--preload", action="store_true", default=_env_bool("TTS_PRELOAD"),
                   help="load and warm up every model at start-up, in the background while the page is already "
                        "served (without it: the models of the default tab) [TTS_PRELOAD]")
    p.add_argument("--share", action="store_true", default=_env_bool("TTS_SHARE"),
                   help="also open a public gradio.live link (off by default) [TTS_SHARE]")
    p.add_argument("--ssl-certfile", default=env("TTS_SSL_CERTFILE"),
                   help="HTTPS certificate (browsers allow the microphone only over HTTPS or on localhost) "
                        "[TTS_SSL_CERTFILE]")
    p.add_argument("--ssl-keyfile", default=env("TTS_SSL_KEYFILE"), help="HTTPS key [TTS_SSL_KEYFILE]")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> AppConfig:
    return AppConfig(checkpoints={r: getattr(a, r) or "" for r in ROLES}, device=a.device, dtype=a.dtype,
                     tiny=a.tiny, offline_fallback=a.offline_fallback,
                     cache_dir=Path(a.cache_dir) if a.cache_dir else None, concurrency=a.concurrency,
                     preload=a.preload, backend=a.backend, quantize=a.quantize, eager=a.eager)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    if bool(a.ssl_certfile) != bool(a.ssl_keyfile):
        raise SystemExit("--ssl-certfile and --ssl-keyfile go together")
    if a.cache_dir:
        cache_paths.use(a.cache_dir)      # every cache of the engine, not only the app's own, follows --cache-dir
    try:
        app = TTSApp(config_from_args(a))
    except TTSError as e:
        raise SystemExit(f"error: {e}")
    if app.random_roles:
        log.warning("RANDOM WEIGHTS for %s: the audio is noise (see the banner on the page)",
                    ", ".join(app.random_roles))
    if not app.cfg.gradio_live_audio:
        log.info("ffmpeg not found: the Gradio endpoints stream status updates and end with the WAV; programs that "
                 "want audio as it is generated: POST /v1/audio/speech with stream=true")
    if app.zerogpu:   # Hugging Face ZeroGPU: load now, serve through demo.launch() (see ui/zerogpu.py)
        zerogpu.serve(app, a.host, a.port, ssl_certfile=a.ssl_certfile, ssl_keyfile=a.ssl_keyfile)
        return
    # the page is served at once; the models load meanwhile (those of the default tab, or all with --preload)
    app.load_in_background(None if not app.cfg.preload else list(app.roles))
    demo = app.build()
    demo.queue(default_concurrency_limit=app.concurrency, max_size=app.limits.max_queue)
    if a.share:  # a public link needs Gradio's own launcher; the HTTP API is then not served
        log.warning("--share: serving the UI through gradio.live; the /v1 speech API is not mounted")
        demo.launch(server_name=a.host, server_port=a.port, share=True, ssl_certfile=a.ssl_certfile,
                    ssl_keyfile=a.ssl_keyfile, ssl_verify=not a.ssl_certfile, **app.launch_kwargs())
        return
    import uvicorn

    scheme = "https" if a.ssl_certfile else "http"
    log.info("serving the app and the /v1/audio/speech API on %s://%s:%d", scheme, a.host, a.port)
    uvicorn.run(create_server(app, demo), host=a.host, port=a.port, ssl_certfile=a.ssl_certfile,
                ssl_keyfile=a.ssl_keyfile, log_level="warning")


if __name__ == "__main__":
    main()
