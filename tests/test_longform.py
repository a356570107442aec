"""Long-form jobs (serving/longform.py, ui/longform_tab.py) through gradio_client on the launched app (tiny random
checkpoints): a Markdown book and an EPUB into chapters, loudness, subtitles, the zip; a job stopped after its first
chapter and continued (also by a new app on the same cache folder) gives the files of a straight run; bad input; an
SRT of five cues into a timed track."""
from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import numpy as np
import pyloudnorm
import pytest
import soundfile as sf

from serving import longform as L
from serving.subtitles import parse_srt
from tts_engine import TTSError
from ui.text import chunk_text

from live_server import tiny_gradio_app

MD = ("# The Book\n\n## Chapter 1\n\nThe first chapter begins here. It has two sentences.\n\nA second paragraph.\n\n"
      "## Chapter 2\n\nThe second chapter is short.\n\n## Chapter 3\n\nThe third chapter ends the book. Goodbye.\n")
KW = dict(voice="ryan", seed=11, randomize=False, max_new_tokens=12)
# segments long enough (40 frames: chunks of 1, 1, 2, 4, 8, 12, 12) that the chunks of neighbouring segments would
# be cut on shared frames if a segment were not `reproducible`: a continued job then differs in the chapter it
# starts with (checked: 02_Chapter_2.flac)
RESUME_KW = dict(KW, max_new_tokens=40)


def make_epub(path: Path, chapters: list[tuple[str, str]] | None) -> Path:
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("id1")
    book.set_title("Two chapters")
    book.set_language("en")
    items = []
    for i, (title, body) in enumerate(chapters or []):
        ch = epub.EpubHtml(title=title, file_name=f"c{i}.xhtml", lang="en")
        ch.content = f"<html><body><h1>{title}</h1>{body}</body></html>"
        book.add_item(ch)
        items.append(ch)
    if not items:                                 # a book with only a picture page
        ch = epub.EpubHtml(title="Cover", file_name="cover.xhtml", lang="en")
        ch.content = "<html><body><img src='x.png'/></body></html>"
        book.add_item(ch)
        items.append(ch)
    book.toc = items
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = items
    epub.write_epub(str(path), book)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("longform")
    with tiny_gradio_app(folder, max_text_chars=1500) as (app, client):
        yield app, client, folder


@pytest.fixture(scope="module")
def straight(served):
    """MD rendered once with KW in the module's app: (the /audiobook result, its zip's files). The tests that compare
    with a straight run share it (the same checkpoints, text and seeds give the same files in any app; the tests
    that change a job render their own)."""
    _app, client, _folder = served
    res = client.predict(text=MD, job_id="", **KW, api_name="/audiobook")
    return res, _files(res[4])


@pytest.fixture(scope="module")
def straight_resume(served):
    """MD rendered once with RESUME_KW (segments long enough that chunk alignment with a neighbour would change their
    samples): (the /audiobook result, its zip's files), for the tests that stop and continue a job."""
    _app, client, _folder = served
    res = client.predict(text=MD, job_id="", **RESUME_KW, api_name="/audiobook")
    return res, _files(res[4])


def _unzip(zpath, dest: Path) -> Path:
    with zipfile.ZipFile(zpath) as z:
        z.extractall(dest)
    return dest


def _check_book(out: Path, n_chapters: int, job: L.Job):
    meta = json.loads((out / "chapters.json").read_text())
    assert [e["index"] for e in meta["chapters"]] == list(range(1, n_chapters + 1))
    starts = [e["start"] for e in meta["chapters"]]
    assert starts[0] == 0 and starts == sorted(starts)
    book, sr = sf.read(out / "book.flac")
    assert sr == 24000 and abs(len(book) / sr - meta["duration"]) < 0.01
    meter = pyloudnorm.Meter(sr)
    for ci, e in enumerate(meta["chapters"]):
        name = e["file"][:-5]
        for ext in ("flac", "srt", "vtt") + (("mp3",) if L.mp3_available() else ()):
            assert (out / f"{name}.{ext}").exists(), (name, ext)
        audio, _ = sf.read(out / f"{name}.flac")
        assert abs(e["duration"] - len(audio) / sr) < 0.01
        assert abs(meter.integrated_loudness(audio) - L.TARGET_LUFS) < 0.5
        assert L.true_peak_db(audio) <= L.TRUE_PEAK_DBTP + 0.3      # 16-bit rounding, measured oversampled
        cues = parse_srt((out / f"{name}.srt").read_text())
        # one cue per sentence group, in order, inside the audio
        assert [q.text for q in cues] == [s.text for s in job.chapters[ci].segments]
        assert all(a.end <= b.start for a, b in zip(cues, cues[1:]))
        assert cues[0].start >= L.LEAD_IN_S - 0.002 and cues[-1].end <= len(audio) / sr
        assert (out / f"{name}.vtt").read_text().startswith("WEBVTT")
    whole = parse_srt((out / "book.srt").read_text())
    assert len(whole) == sum(len(c.segments) for c in job.chapters) and whole[-1].end <= len(book) / sr


def test_markdown_book_through_gradio_client(served, straight, tmp_path):
    app, client, folder = served
    res = straight[0]
    _live, whole, status, seed, zpath, job_id, progress = res
    assert "Book done" in status and "3 chapters" in status and seed == 11, status
    job = L.Job.load(app.jobs_root(), job_id)
    assert [c.title for c in job.chapters] == ["Chapter 1", "Chapter 2", "Chapter 3"] and job.title == "The Book"
    assert [s.text for s in job.chapters[0].segments] == ["Chapter 1", *chunk_text(
        "The first chapter begins here. It has two sentences."), "A second paragraph."]
    _check_book(_unzip(zpath, tmp_path / "z"), 3, job)
    assert "Chapters 3/3" in progress


def test_epub_book_through_gradio_client(served, tmp_path):
    from gradio_client import handle_file

    app, client, folder = served
    path = make_epub(tmp_path / "two.epub", [("Arrival", "<p>They arrived at noon.</p><p>It was hot.</p>"),
                                             ("Departure", "<p>They left at dawn.</p>")])
    res = client.predict(text="", book_file=handle_file(str(path)), job_id="", **KW,
                         api_name="/audiobook")
    status, zpath, job_id = res[2], res[4], res[5]
    assert "Book done" in status and "2 chapters" in status, status
    job = L.Job.load(app.jobs_root(), job_id)
    assert [c.title for c in job.chapters] == ["Arrival", "Departure"]
    _check_book(_unzip(zpath, tmp_path / "z"), 2, job)


def _files(zpath) -> dict[str, bytes]:
    with zipfile.ZipFile(zpath) as z:
        return {n: z.read(n) for n in z.namelist()}


def _same_book(a: dict[str, bytes], b: dict[str, bytes]) -> None:
    """The same files byte for byte: every chapter's FLAC (and MP3), SRT and WebVTT, the whole book, chapters.json.
    A segment's samples do not depend on which segments (or other users' requests) ran beside it in the engine
    (`reproducible` requests: docs/long-form.md, "Nothing lost")."""
    assert a.keys() == b.keys()
    assert {n.rsplit(".", 1)[-1] for n in a} >= {"flac", "srt", "vtt", "json"}
    for n in a:
        assert a[n] == b[n], n


def test_stopped_job_continues_to_the_same_files(served, straight_resume, tmp_path):
    app, client, folder = served
    first = client.predict(text=MD, job_id="", only_chapters="1", **RESUME_KW, api_name="/audiobook")
    assert "Stopped" in first[2] and first[4] is None
    job = L.Job.load(app.jobs_root(), first[5])
    assert all(s.done for s in job.chapters[0].segments) and not job.chapters[1].segments[0].done
    assert job.state == "stopped"
    rest = client.predict(text="", job_id=first[5], **RESUME_KW, api_name="/audiobook")
    assert "Book done" in rest[2]
    _same_book(straight_resume[1], _files(rest[4]))


def test_job_continues_after_a_restart(straight_resume, tmp_path, monkeypatch):
    """A new app on the same cache folder lists the job and finishes it: the same files as a straight run, byte for
    byte (the module's, made by an app of the same configuration). Its start removes an expired job (finished 8 days
    ago) and keeps the unfinished one."""
    import time

    folder = tmp_path / "restart"
    with tiny_gradio_app(folder, max_text_chars=1500) as (app, client):
        first = client.predict(text=MD, job_id="", only_chapters="1", **RESUME_KW, api_name="/audiobook")
    with monkeypatch.context() as m:
        m.setattr(L, "now", lambda: time.time() - 8 * 86400)
        old = L.Job.create(L.jobs_root(folder / "cache"), "Old", [L.Chapter("Old", ["Done long ago."])], ["ryan"],
                           1, L.Settings(), split=chunk_text)
        old.state = "done"
        old.save()
    with tiny_gradio_app(folder, max_text_chars=1500) as (app, client):
        listed = [j.id for j in L.list_jobs(app.jobs_root())]
        assert first[5] in listed and old.id not in listed and not old.folder.exists()
        shown = {jid: text for text, jid in app._job_choices()}      # the page's job list
        assert "stopped" in shown[first[5]] and "kept until" in shown[first[5]]
        rest = client.predict(text="", job_id=first[5], **RESUME_KW, api_name="/audiobook")
    assert "Book done" in rest[2]
    _same_book(straight_resume[1], _files(rest[4]))


def test_redo_one_segment_rebuilds_its_chapter(served, tmp_path):
    app, client, folder = served
    done = client.predict(text=MD, job_id="", **KW, api_name="/audiobook")
    before = _files(done[4])
    res = client.predict(job_id=done[5], chapter=2, segment=2, text="The second chapter is different now.",
                         seed=99, randomize=False, api_name="/audiobook_redo")
    assert "Book done" in res[2] and res[3] == 99
    job = L.Job.load(app.jobs_root(), done[5])
    seg = job.chapters[1].segments[1]
    assert seg.text == "The second chapter is different now." and seg.seed == 99 and seg.done
    after = _files(res[4])
    changed = {n for n in after if after[n] != before.get(n)}
    assert any(n.startswith("02_") for n in changed) and not any(n.startswith(("01_", "03_")) for n in changed)
    assert parse_srt(after["02_Chapter_2.srt"].decode())[1].text == seg.text


def _tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if "longform" not in p.parts}


def test_bad_input_gets_a_clear_message(served, tmp_path):
    from gradio_client import handle_file

    app, client, folder = served
    jobs_before = {j.id for j in L.list_jobs(app.jobs_root())}
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(bytes(range(256)) * 100)
    big = tmp_path / "big.txt"
    big.write_bytes(b"word " * (20 * 10**6 // 5))
    no_text = make_epub(tmp_path / "pictures.epub", None)
    not_epub = tmp_path / "fake.epub"
    not_epub.write_bytes(b"PK\x03\x04 not really a zip")
    many = "\n\n".join(f"Chapter {i}\nSome words." for i in range(1, L.MAX_CHAPTERS + 2))
    cases = [(dict(book_file=handle_file(str(empty))), "empty"),
             (dict(book_file=handle_file(str(binary))), "not text"),
             (dict(book_file=handle_file(str(big))), "too big"),
             (dict(book_file=handle_file(str(no_text))), "no text to read"),
             (dict(book_file=handle_file(str(not_epub))), "not a readable EPUB"),
             (dict(text=many), f"{L.MAX_CHAPTERS + 1} chapters; the limit is {L.MAX_CHAPTERS}"),
             (dict(text=""), "paste some text"),
             (dict(text=MD, job_id="../../etc"), "unknown job"),
             (dict(text=MD, only_chapters="2-9"), "2-9 is outside 1-3"),
             (dict(text=MD, target_lufs=5), "greater than maximum value -10")]
    tree = _tree(folder)
    for kw, msg in cases:
        with pytest.raises(Exception, match="(?i)" + re.escape(msg)):
            client.predict(**{"text": "", "job_id": "", **KW, **kw}, api_name="/audiobook")
    with pytest.raises(Exception, match="malformed at line 1"):
        client.predict(srt_text="not an srt", voice="ryan", api_name="/dub")
    assert {j.id for j in L.list_jobs(app.jobs_root())} == jobs_before      # no job was made
    assert _tree(folder) == tree                                            # nothing written elsewhere
    res = client.predict(text="Still working. Fine.", job_id="", **KW, api_name="/audiobook")   # unharmed
    assert "Book done" in res[2]


def test_dub_five_cues_start_at_their_times(served):
    app, client, folder = served
    starts = [0.5, 2.0, 3.5, 5.0, 6.6]   # each cue 1 s long, 0.5 s apart
    srt = "\n".join(f"{i + 1}\n00:00:{int(s):02d},{int(round(s * 1000)) % 1000:03d} --> 00:00:{int(s) + 1:02d},"
                    f"{int(round(s * 1000)) % 1000:03d}\nCue number {i + 1} is here.\n" for i, s in enumerate(starts))
    _live, track, status, seed, report = client.predict(srt_text=srt, voice="ryan", seed=3, randomize=False,
                                                        max_new_tokens=20, api_name="/dub")
    assert "Track done" in status and "5 cues" in status, status
    audio, sr = sf.read(track, dtype="float32")
    rows = report["cues"]
    assert [r["cue"] for r in rows] == [1, 2, 3, 4, 5]
    assert all((r["fits"] and r["speed"] <= 2.0) or (not r["fits"] and r["needed_speed"] > 2.0) for r in rows)
    win = int(0.01 * sr)
    for s, r in zip(starts, rows):
        if r["speech"] == 0:
            continue
        a = int(s * sr)
        seg = audio[a - int(0.2 * sr): a + int(0.2 * sr)]
        frames = np.sqrt(np.mean(seg[: len(seg) // win * win].reshape(-1, win) ** 2, axis=1))
        before, after = frames[:20], frames[20:]
        onset = (np.argmax(after > max(1e-4, 0.05 * after.max())) + 20) * win / sr - 0.2 + s
        assert before[:-4].max() < 0.05 * after.max() + 1e-4          # silence before the cue's time
        assert abs(onset - s) <= 0.04, (s, onset)


def test_reading_rules():
    with pytest.raises(TTSError, match="no text to read"):
        L.read_book("   \n# \n")
    chapters = L.split_chapters("Preface.\n\nCHAPTER 1\nHello there.\n\nChapter II: The Return\nBack again.")
    assert [c.title for c in chapters] == ["Opening", "CHAPTER 1", "Chapter II: The Return"]
    assert L.split_chapters("Just a text.\n\nTwo paragraphs.")[0].paragraphs == ["Just a text.", "Two paragraphs."]
    rows = L.to_rows(chapters)
    assert [c.title for c in L.from_rows(rows + [["", "", ""]])] == [c.title for c in chapters]
    assert [c.title for c in L.from_rows({"headers": L.TABLE_HEADERS, "data": rows})] == [c.title for c in chapters]


def test_stop_during_a_job_keeps_what_was_made(served, straight, tmp_path):
    """Stop pressed once the first chapter is on disk: the job keeps its finished segments, and rendering it again
    gives the files of a straight run."""
    import time

    app, client, folder = served
    before = {j.id for j in L.list_jobs(app.jobs_root())}
    kw = dict(KW, max_new_tokens=60)          # slow enough to stop in the middle
    job = client.submit(text=MD, job_id="", **kw, api_name="/audiobook")
    deadline = time.time() + 120
    new = None
    while time.time() < deadline:
        new = next((j for j in L.list_jobs(app.jobs_root()) if j.id not in before), None)
        if new is not None and all(s.done for s in new.chapters[0].segments):
            break
        time.sleep(0.05)
    client.predict(api_name="/stop")
    try:
        job.result(timeout=120)
    except Exception:
        pass
    stopped = L.Job.load(app.jobs_root(), new.id)
    assert all(s.done for s in stopped.chapters[0].segments) and stopped.pending(), "stopped too late to test"
    assert stopped.state == "stopped"
    for ci, si in [(c, s) for c, ch in enumerate(stopped.chapters) for s, x in enumerate(ch.segments) if x.done]:
        assert len(stopped.segment_audio(ci, si)) == stopped.chapters[ci].segments[si].samples   # whole files
    again = client.predict(text="", job_id=new.id, **kw, api_name="/audiobook")
    assert "Book done" in again[2]
    ref = _files(client.predict(text=MD, job_id="", **kw, api_name="/audiobook")[4])
    _same_book(ref, _files(again[4]))
    assert straight[1].keys() == ref.keys()


def test_edited_chapter_list_with_a_voice_per_chapter(served, tmp_path):
    """/audiobook_chapters fills the list; an edited list (a title changed, chapter 2 in a Base preset clip's voice,
    chapter 3 dropped) is what gets rendered, each chapter with its own voice and engine."""
    app, client, folder = served
    rows, status = client.predict(text=MD, api_name="/audiobook_chapters")
    assert "3 chapters" in status
    data = rows["data"] if isinstance(rows, dict) else rows
    assert [r[0] for r in data] == ["Chapter 1", "Chapter 2", "Chapter 3"]
    edited = [["The start", "", data[0][2]], ["Chapter 2", "preset:emma", data[1][2]]]
    res = client.predict(text="", chapters={"headers": L.TABLE_HEADERS, "data": edited}, job_id="", **KW,
                         api_name="/audiobook")
    assert "Book done" in res[2] and "2 chapters" in res[2], res[2]
    job = L.Job.load(app.jobs_root(), res[5])
    assert [(c.title, c.voice) for c in job.chapters] == [("The start", "ryan"), ("Chapter 2", "preset:emma")]
    meta = json.loads(_files(res[4])["chapters.json"])
    assert [e["voice"] for e in meta["chapters"]] == ["ryan", "preset:emma"]
    with pytest.raises(Exception, match="(?i)unknown voice"):
        client.predict(text="", chapters={"headers": L.TABLE_HEADERS, "data": [["A", "nobody", "Hi."]]},
                       job_id="", **KW, api_name="/audiobook")


def test_pause_tags_in_a_book_give_their_silence_and_bad_ones_a_message():
    """A pause tag inside a chapter's paragraph is exactly the pause after its run (serving/text_prep.py's tags, as
    in every text field); the segments keep the written text; a bad tag is refused with a clear message."""
    from serving.text_prep import TextPrepError

    ch = L.Chapter("One", ["Hello there. [pause 1.5s] The next part.", "Last paragraph [pause 250ms]"])
    segs = L.segments_of(ch, lambda t: [t.strip()], speak_title=False)
    assert [(s.text, s.pause_after) for s in segs] == [
        ("Hello there.", 1.5), ("The next part.", L.PARAGRAPH_PAUSE_S), ("Last paragraph", 0.25)]
    with pytest.raises(TextPrepError, match="pause"):
        L.segments_of(L.Chapter("Two", ["Wait [pause 99s] here."]), lambda t: [t], speak_title=False)


@pytest.mark.parametrize("text, expect", [
    ("\ufeff1\r\n00:00:01,000 --> 00:00:02,500\r\n<i>Hello</i> there\r\nsecond line\r\n\r\n",
     [(1.0, 2.5, "Hello there second line")]),
    ("00:00:01.000 --> 00:00:02.000\nNo number.\n\n2\n00:00:03,000 --> 00:00:04,000 X1:10 X2:20\n{\\an8}Top.\n",
     [(1.0, 2.0, "No number."), (3.0, 4.0, "Top.")]),
    ("1\n00:00:01,000 --> 00:00:02,000\nA\n2\n00:00:03,000 --> 00:00:04,000\nB\n", [(1.0, 2.0, "A"), (3.0, 4.0, "B")]),
])
def test_srt_input_variants_are_read(text, expect):
    """What real SRT files hold (a BOM, CRLF, no cue number, dotted timings, position fields, tags, no blank line
    between cues) is read by the srt library into the cues dubbing speaks."""
    assert [(q.start, q.end, q.text) for q in parse_srt(text)] == expect


@pytest.mark.parametrize("text, msg", [
    ("1\n00:00:01,000 --> 00:00:02,000\nA\n\n2\n00:00:03,000 -> 00:00:04,000\nB\n", "malformed at line 5"),
    ("1\n00:00:01,000 --> 00:00:02,000\nA\n\n\nstray words\n", "malformed at line 6"),
    ("1\n00:00:01,000 --> 00:00:02,000\nA\n\n2\n00:00:09,000 --> 00:00:04,000\nB\n", "cue at line 5 ends before"),
    ("1\n00:00:01,000 --> 00:00:02,000\n<i></i>\n", "cue at line 1 has no text"),
])
def test_malformed_srt_names_the_line(text, msg):
    with pytest.raises(TTSError, match=msg):
        parse_srt(text)
