"""Test helper: a small local stand-in for ZeroGPU's scheduling service, the HTTP API that the `spaces` package
calls (spaces/zero/api.py: `POST /startup-report`, `POST /schedule`, `POST /allow`, `POST /release`,
`GET /queue-size`). It grants every request a GPU ("nvidiaIndex" 0) unless told to refuse the next ones with a
quota answer (429, what the service answers a visitor whose daily quota is used up), and records every call."""
from __future__ import annotations

import contextlib
import secrets
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from live_server import serve


class ZeroGPUService:
    def __init__(self):
        self.calls: list[tuple[str, dict]] = []     # (path, query parameters), in order
        self.refuse = 0                             # refuse this many of the next /schedule calls (quota)
        self.lock = threading.Lock()
        self.app = self._make_app()

    # --- what the tests read ----------------------------------------------------------------------------
    def of(self, path: str) -> list[dict]:
        with self.lock:
            return [q for p, q in self.calls if p == path]

    def wait_for(self, path: str, n: int, timeout: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.of(path)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.of(path)

    # --- the service ---------------------------------------------------------------------------------
    def _make_app(self) -> FastAPI:
        app = FastAPI()

        def record(request: Request) -> dict:
            q = dict(request.query_params)
            with self.lock:
                self.calls.append((request.url.path, q))
            return q

        @app.post("/startup-report")
        def startup_report(request: Request):
            record(request)
            return Response(status_code=200)

        @app.post("/schedule")
        def schedule(request: Request):
            record(request)
            with self.lock:
                refuse = self.refuse > 0
                self.refuse -= 1 if refuse else 0
            if refuse:
                return JSONResponse({"left": 0, "wait": "0:10:00"}, status_code=429,
                                    headers={"X-Authenticated": "regular"})
            return JSONResponse({"idle": True, "nvidiaIndex": 0, "nvidiaUUID": "GPU-stand-in",
                                 "allowToken": secrets.token_hex(8)})

        @app.post("/allow")
        def allow(request: Request):
            record(request)
            return Response(status_code=200)

        @app.post("/release")
        def release(request: Request):
            record(request)
            return Response(status_code=200)

        @app.get("/queue-size")
        def queue_size(request: Request):
            record(request)
            return 0.0

        return app

    @contextlib.contextmanager
    def running(self):
        with serve(self.app) as url:
            yield url
