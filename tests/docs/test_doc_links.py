"""Every relative link in the README, docs/**/*.md, launchers/README.md and results/README.md resolves: the file
(or folder) exists, and a `#anchor` names a heading of the file it points to (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
while not (REPO / "pyproject.toml").is_file() and REPO != REPO.parent:  # wherever tests/ puts this file
    REPO = REPO.parent
LINK = re.compile(r"(?<!\\)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[Path]:
    found = [REPO / "README.md", REPO / "launchers" / "README.md", REPO / "results" / "README.md",
             *sorted((REPO / "docs").rglob("*.md"))]
    return [p for p in found if p.is_file()]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (a link written there is an example)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", page.read_text()))
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http:, https:, mailto:, ...: not relative
        path_part, _, anchor = target.partition("#")
        dest = page if not path_part else (page.parent / path_part).resolve()
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
            where = dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest.name
            bad.append(f"{target}: no heading #{anchor} in {where}")
    return bad


def test_the_slugs_are_githubs() -> None:
    assert slug("2.6 Adding an aggregation rule or a transport") == "26-adding-an-aggregation-rule-or-a-transport"
    assert slug("The outer-loop options (issue 51)") == "the-outer-loop-options-issue-51"
    assert slug("`sync.mode`: when units move") == "syncmode-when-units-move"
    assert slug("Run [across sites](x.md)") == "run-across-sites"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Top\n\n[ok](#top-1) [ok](b.md) [no](c.md) [no](b.md#x) "
                                   "`[code](d.md)` [web](https://x)\n\n```\n[fence](e.md)\n```\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert broken_links(tmp_path / "a.md") == ["c.md: no such file", "b.md#x: no heading #x in b.md"]


def test_every_relative_link_resolves() -> None:
    assert len(pages()) > 10
    assert [f"{page.relative_to(REPO)}: {bad}" for page in pages() for bad in broken_links(page)] == []
