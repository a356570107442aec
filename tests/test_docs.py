"""The README stays a page for visitors and deployers, and the documentation's cross-references resolve: every
`docs/*.md` named in the README or in docs/ exists, and every relative markdown link (with its #anchor, GitHub's
rule) points at a file and heading that exist."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 260


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation other than - and _ dropped, spaces -> -."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower())
    return s.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, seen = set(), {}
    for line in page.read_text(encoding="utf-8").splitlines():
        if re.match(r"#{1,6} ", line):
            a = _anchor(line)
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def test_the_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; internals belong in docs/ (docs/architecture.md)"


def test_every_docs_page_named_exists():
    for page in PAGES:
        for name in set(re.findall(r"docs/[\w.-]+\.md", page.read_text(encoding="utf-8"))):
            assert (ROOT / name).exists(), f"{page.name} names {name}, which does not exist"


def test_relative_links_and_their_anchors_resolve():
    checked = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: link to {target}: no such file"
            if anchor:
                assert anchor in _anchors(dest), f"{page.name}: link to {target}: no such heading"
            checked += 1
    assert checked >= 10   # the index of docs/benchmarks.md links into docs/bench-history.md
