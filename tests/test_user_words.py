"""Text a user reads speaks to the user: no words about how the project was made.

README.md, docs/, the example and config files, every text file under benchmarks/ (scripts, configs, archived
results) and all of src/fedhet (CLI help, config descriptions, error messages and docstrings live there, and
docs/config.md turns even comments into descriptions) state facts and cite evidence by its command and archived
cells: no issue numbers, no work sessions, no lent machines. Each pattern is precise rather than a blanket
allowlist: "session" in its ordinary computing sense (a notebook or GUI session, a process's session of its own) is
not a work session."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]

PATTERNS = {
    "an issue number": r"\bissues?\s*#?\d+",
    "the issue as a source": r"\b(?:the|this|that) issue\b|\bissue's\b",
    # a POSIX session (a process group's, started with setsid) is not one either
    "a work session": r"(?<!notebook or )(?<!GUI )(?<!interactive )\bsessions?\b(?! of its own)",
    "a lent machine": r"\blent\b",
    "who did the work": r"\bengineers?\b",
}
WORDS = re.compile("|".join(f"(?:{p})" for p in PATTERNS.values()), re.IGNORECASE)


def user_files() -> list[Path]:
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for folder in ("src/fedhet", "benchmarks", "configs", "examples"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return sorted(files)


def text(path: Path) -> str | None:
    """The file's text; None for a binary file (a checkpoint, an image)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def offences(path: Path) -> list[str]:
    found = []
    for number, line in enumerate((text(path) or "").splitlines(), 1):
        for match in WORDS.finditer(line):
            kind = next(k for k, p in PATTERNS.items() if re.fullmatch(p, match[0], re.IGNORECASE))
            found.append(f"{path.relative_to(ROOT)}:{number}: {kind} ({match[0]!r}): {line.strip()[:160]}")
    return found


def test_the_patterns_catch_process_words_and_spare_ordinary_ones():
    for said in ("issue 30", "Issue 31:", "issues 3 and 13", "issue #29", "the issue's benchmark value",
                 "This session was lent a GPU machine", "an earlier session", "the first session that has a GPU",
                 "stopped at the session's end", "shared with other engineers"):  # fmt: skip
        assert WORDS.search(said), said
    for fine in ("the matplotlib backend of a notebook or GUI session", "this notebook or session",
                 "an interactive session", "runs in a session of its own", "FL-bench#5", "a client that raises",
                 "silent", "tissue"):  # fmt: skip
        assert not WORDS.search(fine), fine


def test_user_facing_text_has_no_words_about_how_the_project_was_made():
    files = user_files()
    assert len(files) > 100 and ROOT / "src/fedhet/cli.py" in files and ROOT / "docs/config.md" in files
    found = [line for path in files for line in offences(path)]
    assert not found, f"{len(found)} places speak of how the project was made:\n" + "\n".join(found)
