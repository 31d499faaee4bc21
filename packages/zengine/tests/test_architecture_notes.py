"""ARCHITECTURE.md's index of the Notes is complete and true: every ``[Note: ...]`` that the
packages' code names (where it is written, or where a comment points at it) has a row, and
each row's file is where the Note is written (its name opens a line or a docstring there)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_MENTION = re.compile(r"\[Note: ([^\]]+)\]")
_ROW = re.compile(r"\| (.+?) \| `([^`]+)` \|")


def _name(text: str) -> str:
    """A Note's name as written across comment lines: without the ``#`` and the line breaks."""
    return " ".join(text.replace("#", " ").split())


def _sources() -> dict[str, str]:
    """Each package's source file, by its path under ``src/`` (``zcomm/_pool.py``), -> text."""
    return {
        "/".join(path.relative_to(ROOT).parts[3:]): path.read_text()  # packages/<name>/src/...
        for path in sorted(ROOT.glob("packages/*/src/**/*.py"))
    }


def _index() -> dict[str, str]:
    """The Notes table of ARCHITECTURE.md: a Note's name -> the file it names."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text[text.index("## The Notes") :].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        row = _ROW.fullmatch(line)
        if row is not None:
            for name in row.group(1).split(", "):  # one row may hold two Notes of one file
                rows[name] = row.group(2)
    return rows


def _written(name: str, text: str) -> bool:
    """Whether `text` writes the Note: its name opens a line (after a comment's ``#`` or a
    docstring's quotes), not only in a pointer such as ``see [Note: x]``."""
    opening = re.compile(r'^\s*(?:#\s*|r?""")?\[Note: ' + re.escape(name) + r"\]", re.M)
    return opening.search(text) is not None


def test_every_note_in_the_code_has_a_row_that_names_its_file() -> None:
    sources, rows = _sources(), _index()
    assert len(rows) > 40  # the table was found and read
    mentioned = {
        _name(found): path for path, text in sources.items() for found in _MENTION.findall(text)
    }
    assert sorted(set(mentioned) - set(rows)) == [], "Notes missing from ARCHITECTURE.md"
    wrong = {
        name: where
        for name, where in rows.items()
        if where not in sources or not _written(name, sources[where])
    }
    assert wrong == {}, "rows whose file does not write the Note (or does not exist)"
