"""The "Use via API" description of each generating handler (ui.handlers.api_doc): every argument a caller sends
is described once, in argument order; the shared ones (seed, sampling, speed, live_token) come from one table
unless the handler says more about them."""
from __future__ import annotations

import inspect

import pytest

from ui.dialogue import DialogueHandler
from ui.handlers import SHARED_PARAMS, Handlers, api_doc

HANDLERS = [Handlers.preset, Handlers.clone, Handlers.blend, Handlers.blend_sweep, Handlers.design,
            DialogueHandler.dialogue]


def _params(doc: str) -> list[tuple[str, str]]:
    section = doc.split("Parameters:\n", 1)[1].split("Returns:", 1)[0]
    return [tuple(x.strip() for x in ln.split(":", 1)) for ln in section.splitlines() if ln.strip()]


@pytest.mark.parametrize("fn", HANDLERS, ids=lambda f: f.__name__)
def test_every_argument_is_described_once_in_order(fn):
    doc = api_doc(fn)
    args = [a for a in inspect.signature(fn).parameters if a not in ("self", "session", "request")]
    names = [n for n, _ in _params(doc)]
    assert names == args, (names, args)
    assert all(desc for _, desc in _params(doc))
    assert doc.split("Parameters:")[0].strip() and "Returns:" in doc


def test_shared_lines_come_from_the_table_unless_the_handler_says_more():
    preset = dict(_params(api_doc(Handlers.preset)))
    for name in ("seed", "temperature", "top_k", "repetition_penalty", "speed", "live_token"):
        assert preset[name] == SHARED_PARAMS[name]
    assert "temperature" not in (inspect.getdoc(DialogueHandler.dialogue) or "")   # written once, not per handler
    dialogue = dict(_params(api_doc(DialogueHandler.dialogue)))
    assert dialogue["seed"] != SHARED_PARAMS["seed"] and "every line" in dialogue["seed"]
    assert dialogue["top_p"] == SHARED_PARAMS["top_p"]
    sweep = dict(_params(api_doc(Handlers.blend_sweep)))
    assert "five" in sweep["speed"] and "live_token" not in sweep


def test_a_docstring_without_parameters_is_left_as_it_is():
    def f(seed=None):
        """Only a description."""
    assert api_doc(f) == "Only a description."
