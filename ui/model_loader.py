"""Models load in the background while the page is already served: `ModelLoader` loads the engines of some roles
one after another in a thread (weights, then one short warm-up synthesis), says where each one stands (for the
status line and the page's "models ready" indicator), and lets a request that needs a role still loading wait for
it (`wait`), so it starts as soon as that model is ready. The warm-up is only for a later click's latency (nothing
needs it to be right): where a request is already waiting when the weights are in, it is skipped, and that request
starts at once (it warms the engine itself).

The page learns the state from `GET /live/models` (JSON), which `assets/model_state.js` polls while anything
loads and writes into the element `#model-state` (see `STATE_HTML`)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from fastapi.responses import FileResponse, JSONResponse

from ui.config import ROLE_LABEL

log = logging.getLogger("qwen3_tts_live")

# The stages of one role's loading, in order; `RoleLoad.stage` is one of them.
QUEUED, WEIGHTS, WARMING, READY, FAILED = "queued", "loading the weights", "warming up", "ready", "failed"
STEP = {QUEUED: 0, WEIGHTS: 1, WARMING: 2, READY: 3, FAILED: 3}


@dataclass
class RoleLoad:
    role: str
    stage: str = QUEUED
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    finished_at: float | None = None
    error: str = ""
    exception: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self.stage in (QUEUED, WEIGHTS, WARMING)

    def seconds(self) -> float:
        if self.started_at is None:
            return 0.0
        return (self.finished_at or time.monotonic()) - self.started_at

    def describe(self) -> str:
        """"Loading the CustomVoice model: step 1/2, loading the weights (2.1 s)" and the like."""
        name = ROLE_LABEL.get(self.role, self.role)
        if self.stage == QUEUED:
            return f"Loading the {name} model: waiting for the model before it"
        if self.stage in (WEIGHTS, WARMING):
            return f"Loading the {name} model: step {STEP[self.stage]}/2, {self.stage} ({self.seconds():.1f} s)"
        if self.stage == READY:
            return f"{name} model ready ({self.seconds():.1f} s)"
        return f"{name} model failed to load: {self.error}"


class ModelLoader:
    """Loads `Models` roles in one background thread. `load(role)` and `warm_up(role)` are the two steps (callables
    of the role); `wait(role)` blocks a request until a role queued here is ready (or failed); roles never queued
    here do not wait (they load on first use, as before)."""

    def __init__(self, load, warm_up):
        self._load, self._warm_up = load, warm_up
        self._cond = threading.Condition()
        self.roles: dict[str, RoleLoad] = {}
        self._waiting: dict[int, str] = {}      # thread id -> the role it waits for (for its status line)
        self._thread: threading.Thread | None = None

    # --- starting ----------------------------------------------------------------------------------------
    def start(self, roles) -> threading.Thread | None:
        """Queue `roles` (in order) and load them in the background; roles queued before are kept."""
        with self._cond:
            for r in roles:
                if r not in self.roles or self.roles[r].stage == FAILED:
                    self.roles[r] = RoleLoad(r)
            if self._thread is None:          # (the thread clears it, under this lock, when nothing is left)
                self._thread = threading.Thread(target=self._run, name="model-loader", daemon=True)
                self._thread.start()
            return self._thread

    def load_now(self, roles) -> None:
        """Load `roles` in the calling thread (the old blocking `--preload`, for tests and scripts)."""
        with self._cond:
            for r in roles:
                if r not in self.roles or self.roles[r].stage == FAILED:
                    self.roles[r] = RoleLoad(r)
        for r in roles:
            job = self.roles[r]
            self._one(job)
            self.wait(r)                     # (the background thread may have taken it first)
            if job.stage == FAILED and job.exception is not None:
                raise job.exception

    def _run(self) -> None:
        while True:
            with self._cond:
                todo = next((x for x in self.roles.values() if x.stage == QUEUED), None)
                if todo is None:
                    self._thread = None
                    return
            self._one(todo)

    def _one(self, job: RoleLoad) -> None:
        with self._cond:
            if job.stage != QUEUED:          # taken by another thread, or done
                return
            job.started_at = time.monotonic()
            job.stage = WEIGHTS
            self._cond.notify_all()
        try:
            self._load(job.role)
            if self.awaited(job.role):
                log.info("%s warm-up skipped: a request is waiting for the model, it starts now",
                         ROLE_LABEL[job.role])
            else:
                self._set(job, WARMING)
                try:
                    self._warm_up(job.role)
                except Exception as e:   # a failed warm-up leaves a usable engine: the first request is slower
                    log.warning("%s warm-up failed (%s: %s); serving anyway", ROLE_LABEL[job.role], type(e).__name__,
                                e)
            self._set(job, READY)
            log.info("%s model ready in %.1f s", ROLE_LABEL[job.role], job.seconds())
        except Exception as e:
            job.exception = e
            job.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            log.error("loading the %s model failed: %s", ROLE_LABEL[job.role], job.error)
            self._set(job, FAILED)

    def _set(self, job: RoleLoad, stage: str) -> None:
        with self._cond:
            job.stage = stage
            if stage in (READY, FAILED):
                job.finished_at = time.monotonic()
            self._cond.notify_all()

    # --- waiting -----------------------------------------------------------------------------------------
    def wait(self, role: str, timeout: float | None = None) -> bool:
        """Block while `role` is queued or loading here; -> False on timeout. A failed load returns True: the
        caller then loads it itself and gets the error as a readable message."""
        me = threading.get_ident()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            job = self.roles.get(role)
            if job is None or not job.busy or (self._thread is not None and me == self._thread.ident):
                return True
            self._waiting[me] = role
            try:
                while job.busy:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._waiting.pop(me, None)

    def waiting_for(self, thread_id: int | None) -> RoleLoad | None:
        """The role that thread `thread_id` is waiting for right now (None when it is not waiting)."""
        with self._cond:
            role = self._waiting.get(thread_id) if thread_id is not None else None
            return self.roles.get(role) if role else None

    def awaited(self, role: str) -> bool:
        """A request is waiting for `role` right now (`wait`)."""
        with self._cond:
            return role in self._waiting.values()

    def busy(self, role: str) -> bool:
        with self._cond:
            job = self.roles.get(role)
            return bool(job and job.busy)

    # --- reporting ---------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """{"ready": all queued roles are ready, "loading": any still loading, "roles": [{role, label, stage,
        step, steps, seconds, text}]}"""
        with self._cond:
            jobs = list(self.roles.values())
            rows = [{"role": j.role, "label": ROLE_LABEL.get(j.role, j.role), "stage": j.stage,
                     "step": STEP[j.stage], "steps": 2, "seconds": round(j.seconds(), 1), "text": j.describe(),
                     "error": j.error or None} for j in jobs]
        return {"ready": bool(jobs) and all(j.stage == READY for j in jobs),
                "loading": any(j.busy for j in jobs), "roles": rows}

    def summary(self) -> str:
        """One line for the page: what is loading, or which models are ready."""
        snap = self.snapshot()
        if not snap["roles"]:
            return ""
        busy = [r for r in snap["roles"] if r["stage"] not in (READY, FAILED)]
        failed = [r for r in snap["roles"] if r["stage"] == FAILED]
        if busy:
            return "⏳ " + busy[0]["text"] + (f" · then {len(busy) - 1} more" if len(busy) > 1 else "")
        ready = [r["label"] for r in snap["roles"] if r["stage"] == READY]
        text = ("✅ Models ready: " + ", ".join(ready)) if ready else ""
        if failed:
            text += (" · " if text else "") + "⚠️ " + "; ".join(r["text"] for r in failed)
        return text


# --- the page's side ---------------------------------------------------------------------------------------
STATE_HTML = '<div id="model-state" aria-live="polite"></div>'
HEAD = '<script src="live/model_state.js"></script>'


def install(app, loader: ModelLoader, prefix: str = "/live") -> None:
    """`GET {prefix}/models` (the loader's snapshot plus a one-line summary) and `{prefix}/model_state.js`."""
    from ui.live_player import ASSETS

    def models():
        return JSONResponse({**loader.snapshot(), "summary": loader.summary()}, headers={"Cache-Control": "no-store"})

    def script():
        return FileResponse(ASSETS / "model_state.js", media_type="text/javascript",
                            headers={"Cache-Control": "no-cache"})

    app.add_api_route(f"{prefix}/models", models, methods=["GET"], include_in_schema=False)
    app.add_api_route(f"{prefix}/model_state.js", script, methods=["GET"], include_in_schema=False)
