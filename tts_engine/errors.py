"""The one error type users see.

Every problem caused by the caller's input (empty text, unknown speaker or language, unreadable audio, a
voice file of the wrong shape, non-finite values, ...) raises `TTSError` with a message a person can act on.
Anything else that escapes the engine is a bug.
"""


class TTSError(ValueError):
    """Bad input or an unsupported request; `str(err)` is meant for the end user."""


class EngineBusyError(TTSError):
    """The engine's waiting queue is full; try again shortly. `retry_after_s`: seconds after which a place is
    likely (from the measured drain rate of the queue), or None where unknown."""

    retry_after_s: int | None = None
