"""Test helper: what a tests/oracle/ script recorded in its safetensors file (the official implementation's outputs):
the cases as JSON in the file's metadata ("cases") and every tensor."""
from __future__ import annotations

import json

from safetensors import safe_open


def read_record(path) -> tuple[list[dict], dict]:
    """(cases, {name: tensor}) of the record at `path`."""
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["cases"]), {k: f.get_tensor(k) for k in f.keys()}
