"""The documentation site (mkdocs.yml): it builds under --strict, so a broken link, anchor, page outside the
navigation or API reference fails, and its home page and an API page render in headless Chromium."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from browser import MISSING, browser, headless
from PIL import Image

ROOT = Path(__file__).parents[1]
API = ["run", "compare", "tune", "resume", "load_run", "load_runs", "records_dataframe", "RunResult"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built from this checkout into a temporary folder (never into the repository's site/)."""
    out = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", "mkdocs.yml", "--site-dir", out]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-5000:]  # mkdocs names every broken link or anchor here
    return out


@pytest.mark.slow
def test_every_doc_page_is_built_with_the_api_reference(site):
    pages = {p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md")}
    for page in pages:  # every page is in the navigation too: mkdocs.yml's validation warns of one left out
        assert (site / (page.parent if page.name == "index" else page) / "index.html").is_file(), page
    api = (site / "api" / "index.html").read_text()
    for name in API:
        assert f'id="fedhet.api.{name}"' in api, name
    contract = (site / "api" / "algorithm" / "index.html").read_text()
    for name in ("Algorithm", "Message", "Reply", "ClientContext", "Setup"):
        assert re.search(rf'id="fedhet\.algorithms\.(base|contract)\.{name}"', contract), name
    registries = (site / "api" / "registries" / "index.html").read_text()
    for name in ("registry.Registry", "registry.Registry.register", "plugins.load"):
        assert f'id="fedhet.{name}"' in registries, name


@pytest.mark.slow
def test_long_lines_in_code_blocks_wrap_on_every_page(site):
    """Material scrolls a long code line sideways behind a thin scrollbar, so long commands read as cut off: the
    site's own stylesheet wraps them, and every page links it."""
    css = (site / "stylesheets" / "extra.css").read_text()
    assert re.search(r"\.md-typeset pre > code \{[^}]*white-space: pre-wrap;", css), css
    for page in site.rglob("index.html"):
        if "<pre" in (html := page.read_text()):
            assert "stylesheets/extra.css" in html, page


def test_the_home_page_defines_every_link_the_readme_defines():
    """docs/index.md includes README.md up to its link definitions and defines them anew for the site (a link
    it left undefined would show as bracketed text, which no build warns about)."""
    labels = re.compile(r"^\[([^\]]+)\]: ", re.M)
    readme, home = (ROOT / "README.md").read_text(), (ROOT / "docs" / "index.md").read_text()
    assert readme.count("--8<-- [end:home]") == 1
    assert set(labels.findall(readme)) == set(labels.findall(home)) != set()
    used = set(re.findall(r"\]\[([^\]]+)\]", readme.split("--8<-- [end:home]")[0]))
    assert used <= set(labels.findall(home)), used - set(labels.findall(home))


@pytest.mark.slow
@pytest.mark.skipif(browser() is None, reason=MISSING)
def test_the_home_page_and_the_api_page_render_in_headless_chromium(site, tmp_path):
    home = headless(site / "index.html", tmp_path / "profile", "--dump-dom")
    assert re.search(r'<h1 id="fedhet">fedhet', home)
    for heading in ("Install", "Algorithms", "Python", "Runs you can trust", "Documentation"):
        assert re.search(rf'<h2 id="[^"]+">{heading}', home), heading
    api = headless(site / "api" / "index.html", tmp_path / "profile", "--dump-dom")
    for name in API:
        assert re.search(rf'<h3 id="fedhet\.api\.{name}"', api) and f"{name}</span>" in api, name
    shot = tmp_path / "api.png"
    headless(site / "api" / "index.html", tmp_path / "profile", "--window-size=1280,1600", f"--screenshot={shot}")
    image = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    dark = (image.sum(axis=2) < 300).mean()  # text
    assert 0.005 < dark < 0.5, dark  # a page of text, not a blank or an error page
