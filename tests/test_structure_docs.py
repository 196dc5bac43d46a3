"""Contract: the documentation stands on its own -- every link in the repository's Markdown points
at a file inside the repository, and the documents README promises exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "BENCHMARKS.md", *(REPO / "docs").rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_links_stay_inside_the_repository(doc):
    bad = []
    for target in LINK.findall(doc.read_text()):
        path = target.split("#", 1)[0]
        if re.match(r"^[a-z]+:", target):
            bad.append(f"{target} (outside the repository)")
        elif path:
            resolved = (doc.parent / path).resolve()
            if not resolved.is_relative_to(REPO):
                bad.append(f"{target} (outside the repository)")
            elif not resolved.exists():
                bad.append(f"{target} (no such file)")
    assert not bad, f"{doc.relative_to(REPO)}: " + ", ".join(bad)


def test_the_promised_documents_exist():
    for name in ("docs/architecture.md", "CONTRIBUTING.md"):
        assert (REPO / name).is_file(), name
    assert not (REPO / "docs" / "TEAM.md").exists()
    readme = (REPO / "README.md").read_text()
    assert "docs/architecture.md" in readme
    assert "CONTRIBUTING.md" in readme
