"""The docs start a Lighthouse the way the recipe does (`edit-train-lighthouse`, behind the authenticating gate),
never torchft's raw, unauthenticated `torchft_lighthouse` (issue 64)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_no_doc_starts_the_raw_torchft_lighthouse() -> None:
    docs = [REPO / "README.md", REPO / "launchers" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    starts = re.compile(r"`torchft_lighthouse --|torchft's own\s+`torchft_lighthouse`")
    found = [f"{d.relative_to(REPO)}: {m.group(0)}" for d in docs for m in starts.finditer(d.read_text())]
    assert not found, found
    assert "edit-train-lighthouse --bind" in (REPO / "docs" / "configuration.md").read_text()
