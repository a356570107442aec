"""A small Gradio page with the live player and a fake generator (a sine, at a chosen speed), served the way the
app serves its page (FastAPI + the live route + gr.mount_gradio_app(head=...)). For the player's browser tests,
and by hand:

    python -m tests.live_harness --port 7861 --rate 0.6     # generation at 0.6x real time: watch it buffer
"""
from __future__ import annotations

import argparse
import threading
import time

import gradio as gr
import numpy as np

from ui import live_player as lp

SR = lp.SR


class FakeGenerator:
    """Writes `seconds` of a 440 Hz sine into the sink: the first chunk after `first_chunk_s`, then chunks of
    `chunk_s` audio at `rate` audio seconds per wall second; once `hiccup_after_s` of audio is written, it stops for
    `hiccup_s` (a slow start: a busy CPU for a moment). Records every run in `runs`."""

    def __init__(self, streams: lp.LiveStreams):
        self.streams = streams
        self.rate, self.first_chunk_s, self.chunk_s, self.seconds, self.amplitude = 4.0, 0.07, 0.32, 3.0, 0.3
        self.hiccup_after_s, self.hiccup_s = None, 0.0
        self.runs: list[dict] = []
        self.lock = threading.Lock()

    def generate(self, text: str, token: str, request: gr.Request = None):
        session = getattr(request, "session_hash", None) or ""
        run = {"token": token, "session": session, "written_s": 0.0, "cancelled": False, "closed": False,
               "done": False, "sink": False}
        with self.lock:
            self.runs.append(run)
        if not text.strip():
            raise gr.Error("Enter some text")     # before the slot: the page must not wait for it forever
        sink = self.streams.open(token, session, expected_seconds=self.seconds)
        run["sink"] = sink is not None
        yield "Starting"
        t0 = time.perf_counter()
        n_total = int(self.seconds * SR)
        n_chunk = int(self.chunk_s * SR)
        n = 0
        hiccup = self.hiccup_after_s
        try:
            time.sleep(self.first_chunk_s)
            while n < n_total:
                if sink is not None and sink.cancelled:
                    run["cancelled"] = True
                    yield "Cancelled"
                    return
                k = min(n_chunk, n_total - n)
                t = (np.arange(n, n + k) / SR).astype(np.float64)
                pcm = (self.amplitude * 32767 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
                if sink is not None:
                    sink.write(pcm)
                n += k
                run["written_s"] = n / SR
                yield f"Streaming {n / SR:.2f} s (first audio {1000 * self.first_chunk_s:.0f} ms)"
                # the next chunk exists when generation at `rate` has made it
                wait = t0 + self.first_chunk_s + n / SR / self.rate - time.perf_counter()
                if hiccup is not None and n >= hiccup * SR:
                    t0 += self.hiccup_s
                    wait += self.hiccup_s
                    hiccup = None
                if wait > 0 and n < n_total:
                    time.sleep(wait)
        except GeneratorExit:
            run["closed"] = True     # Gradio closed the job (its page went away) before the sink saw the cancel
            raise
        finally:
            if sink is not None:
                sink.close()
            run["done"] = True
        yield f"Done {n / SR:.2f} s"


def build_app(streams: lp.LiveStreams | None = None):
    """-> (FastAPI app, FakeGenerator). The page: a text box, Generate (class live-generate), Stop, a status line
    and the live player's own status element."""
    from fastapi import FastAPI

    streams = streams or lp.LiveStreams()
    fake = FakeGenerator(streams)
    with gr.Blocks(title="live player harness") as demo:
        text = gr.Textbox("Hello there.", label="Text", elem_id="text")
        token = gr.Textbox("", visible=False, elem_id="live-token")
        with gr.Row():
            gen = gr.Button("Generate", elem_id="preset-generate", elem_classes=[lp.GENERATE_CLASS])
            stop = gr.Button("Stop", elem_id="stop", elem_classes=[lp.STOP_CLASS])
        status = gr.Markdown("", elem_id="status")
        gr.HTML(lp.STATUS_HTML)

        def stopped():
            return "Stopped"

        ev = gen.click(fake.generate, [text, token], [status], js=lp.TOKEN_JS, api_name="generate",
                       trigger_mode="once")
        lp.after_event(ev)
        stop.click(stopped, None, [status], cancels=[ev], queue=False)
    demo.queue(default_concurrency_limit=4)
    api = FastAPI()
    lp.install(api, streams)
    return gr.mount_gradio_app(api, demo, path="/", head=lp.HEAD), fake


def main(argv=None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7861)
    p.add_argument("--rate", type=float, default=4.0, help="audio seconds generated per wall second")
    p.add_argument("--seconds", type=float, default=3.0)
    a = p.parse_args(argv)
    app, fake = build_app()
    fake.rate, fake.seconds = a.rate, a.seconds
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
