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

from tts_engine.cache_paths import choices_root

log = logging.getLogger("tts_engine")
_made: dict[str, str] = {}   # what this process chose, for the app's footer and the log (`note`, `made`)


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
    note(_name(path), got["choice"], "remembered")
    return {"choice": got["choice"], "why": got.get("why", "")}


def remember(path: Path, key: dict, choice: str, why: str) -> None:
    """Write the choice for `key` to `path` (whole or not at all: a temporary file renamed); a folder that cannot be
    written costs one log line, never an error."""
    note(_name(path), choice, "measured now")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "choice": choice, "why": why}, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError as err:
        log.info("choice not saved to %s: %s", path, err)


def _name(path: Path) -> str:
    """"fused_step talker" for <cache>/fused_step/talker-<digest>.json, "codec_int8" for <cache>/codec_int8/<digest>."""
    prefix = path.name[:-len("0123456789abcdef.json")].rstrip("-")
    return f"{path.parent.name} {prefix}".strip()


def note(name: str, choice: str, how: str) -> None:
    """Record that this process uses `choice` for `name`, and how it came ("measured now", "remembered",
    "default (...)"): `made()` lists them for the app's footer."""
    _made[name] = f"{choice} ({how})"


def made() -> dict[str, str]:
    """{name: "choice (how)"} of every choice this process made through here, in the order they were made."""
    return dict(_made)
