"""Counts the calls of an engine's two reference encoders (speaker encoder, codec encoder): what a cached clone
must skip."""


def count_encoders(engine, monkeypatch) -> dict:
    """Wraps `engine`'s speaker encoder `embed` and codec `encode`; the returned dict counts their calls."""
    calls = {"speaker": 0, "codec": 0}
    se, st = engine.model.speaker_encoder, engine.model.speech_tokenizer
    embed, encode = se.embed, st.encode

    def counting_embed(*a, **k):
        calls["speaker"] += 1
        return embed(*a, **k)

    def counting_encode(*a, **k):
        calls["codec"] += 1
        return encode(*a, **k)

    monkeypatch.setattr(se, "embed", counting_embed)
    monkeypatch.setattr(st, "encode", counting_encode)
    return calls
