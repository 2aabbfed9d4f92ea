"""Headless Chromium for the tests that open a page: the HTML report and the documentation site."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

MISSING = "needs chromium (make test installs it where apt-get is available)"


def browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def headless(page: Path, profile: Path, *flags: str, timeout: float = 120) -> str:
    """Open ``page`` in headless Chromium with ``flags`` (``--screenshot=...``, ``--dump-dom``); its stdout."""
    command = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               f"--user-data-dir={profile}", *flags, page.as_uri()]  # fmt: skip
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=timeout).stdout
