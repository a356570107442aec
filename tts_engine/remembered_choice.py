"""A choice between two code paths, measured once on this machine and remembered as a small JSON file in the cache
folder (`cache_paths.choices_root()/<folder>/`; on a Space with persistent storage under /data): the fused decode
step (fused vs eager) and the code predictor's frame in one call (frame vs Python loop) each keep theirs per key
(machine, code version, model shape), so later engines load the answer instead of timing again."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from .cache_paths import choices_root

log = logging.getLogger("tts_engine")


def setting(env: str) -> str:
    """"auto" (measure, or use what was measured before), "on" or "off": the environment variable `env` that forces a
    measured choice (0/off/no/false, 1/on/yes/true; anything else is auto)."""
    v = os.environ.get(env, "auto").strip().lower()
    if v in ("0", "off", "no", "false"):
        return "off"
    if v in ("1", "on", "yes", "true"):
        return "on"
    return "auto"


def path_for(folder: str, key: dict, prefix: str = "") -> Path:
    """The file of `key` (a JSON-able dict): <cache>/<folder>/<prefix><16 hex digits of its sha1>.json."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return choices_root() / folder / f"{prefix}{digest}.json"


def recall(path: Path, key: dict, choices: tuple[str, ...]) -> dict | None:
    """{"choice": one of `choices`, "why": ...} remembered for exactly `key` at `path`, else None (no file, another
    key, an unknown choice or a damaged file)."""
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(got, dict) or got.get("key") != key or got.get("choice") not in choices:
        return None
    return {"choice": got["choice"], "why": got.get("why", "")}


def remember(path: Path, key: dict, choice: str, why: str) -> None:
    """Write the choice for `key` to `path` (whole or not at all: a temporary file renamed); a folder that cannot be
    written costs one log line, never an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "choice": choice, "why": why}, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError as err:
        log.info("choice not saved to %s: %s", path, err)
