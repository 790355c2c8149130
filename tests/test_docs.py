"""The docs: a MkDocs site (mkdocs.yml at the root, pages under docs/) that builds with `--strict`,
so a broken link between pages, an anchor no heading makes or a page left out of the nav fails
here; and a README short enough to read, with the two set-up commands. A few seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
SETUP_COMMANDS = (
    "bash launch/install.sh && .venv/bin/python -m launch.train     # install, then train the default job",
    "bash launch/install.sh && .venv/bin/python -m pytest           # run the tests (CI runs exactly this)",
)


def nav_pages(nav) -> list[str]:
    """The page files the nav lists, in order (entries as `Title: page.md`, `page.md` or a section
    holding a list of them)."""
    pages = []
    for entry in nav:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def config() -> dict:
    with open(ROOT / "mkdocs.yml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def test_the_docs_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about MkDocs 2.0, not a warning of ours
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (site / "index.html").is_file()
    for page in nav_pages(config()["nav"]):
        name = page.removesuffix(".md")
        built = site / ("index.html" if name == "index" else f"{name}/index.html")
        assert built.is_file(), f"{page} (in mkdocs.yml's nav) was not built: no {built.relative_to(site)}"


def test_the_readme_is_short_and_has_the_two_commands():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    for command in SETUP_COMMANDS:
        assert command in lines, f"README.md lacks the set-up command line {command!r}"


def test_every_page_is_in_the_nav():
    cfg = config()
    docs = ROOT / cfg.get("docs_dir", "docs")
    on_disk = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*.md"))
    in_nav = nav_pages(cfg["nav"])
    assert len(in_nav) == len(set(in_nav)), f"a page is listed twice in mkdocs.yml's nav: {in_nav}"
    assert sorted(in_nav) == on_disk, (f"not in the nav: {sorted(set(on_disk) - set(in_nav))}; "
                                       f"in the nav but not in {docs.name}/: {sorted(set(in_nav) - set(on_disk))}")
