"""Contract: the documentation stands on its own -- every link in the repository's Markdown points
at a file inside the repository, and the documents README promises exist -- and lists every wait:
README's table every run deadline, docs/engine.md's every ``weightsync serve`` deadline flag, each
with the default the code has."""

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


def _table_rows(doc: str, name: str) -> list[str]:
    text = (REPO / doc).read_text()
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    assert begin in text, f"{doc} has no {name} table"
    assert end in text, f"{doc}'s {name} table has no end"
    rows = text[text.index(begin) + len(begin):text.index(end)].strip().splitlines()
    return [r for r in rows[2:] if r.startswith("|")]


def test_every_run_deadline_is_in_the_readme_table_with_its_default():
    """README's "Reliability" table lists every ``Deadlines`` field by its ``--deadlines`` key with
    the default the code has, and nothing else."""
    from dataclasses import fields

    from weightsync.launch.config import Deadlines

    want = {f.name.removesuffix("_s"): f.default for f in fields(Deadlines)}
    rows = {m.group(1): m.group(2) for r in _table_rows("README.md", "deadlines")
            if (m := re.match(r"\|\s*`(\w+)`\s*\|\s*([\d.]+)\s*\|", r))}
    assert set(rows) == set(want), f"missing: {sorted(set(want) - set(rows))}, stale: {sorted(set(rows) - set(want))}"
    assert {k: float(v) for k, v in rows.items()} == want


def test_every_serve_deadline_flag_is_in_the_engine_table_with_its_default():
    """docs/engine.md's waits table names every ``weightsync serve`` timeout, deadline and interval flag with
    its default (the live check's default depends on the transport: said in words), and no flag
    that does not exist."""
    import argparse

    from weightsync.cli.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {a.option_strings[0]: a.default for a in parser._actions
             if a.option_strings and a.dest.endswith(("_timeout_s", "_interval_s", "_deadline_s"))}
    assert len(flags) >= 6
    text = "\n".join(_table_rows("docs/engine.md", "waits"))
    for flag, default in flags.items():
        assert f"`{flag}`" in text, f"{flag} is missing from docs/engine.md's waits table"
        if default is not None:
            assert re.search(rf"`{flag}` {default:g}\b", text), f"{flag}'s default {default:g} is not in the table"
    named = set(re.findall(r"`(--[a-z-]+)`", text))
    every = {o for a in parser._actions for o in a.option_strings}
    assert named <= every, f"flags that serve does not have: {sorted(named - every)}"
