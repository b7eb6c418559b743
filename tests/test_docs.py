"""The documentation stays true to the repository: the README is short, every link and path the README and
docs/ name exists, and the configuration page's key table is the one the code's declarations generate."""

from __future__ import annotations

import re
from pathlib import Path

from upcycle.config_table import END, START, table

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_the_readme_is_at_most_250_lines_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]*)?\)", readme))
    assert {f"docs/{p.name}" for p in DOCS} <= linked, "a docs page the README does not link"


def _links(page: Path):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target) and not target.startswith("mailto:"):
            yield target


def test_every_relative_link_and_named_path_exists():
    missing = []
    for page in [ROOT / "README.md", *DOCS]:
        for target in _links(page):
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} links {target}")
        # paths in code spans: `src/upcycle/...py`, `benchmarks/...`, `configs/...`, `tests/...`
        for path in re.findall(r"`((?:src/upcycle|benchmarks|configs|tests)/[\w./-]+)`", page.read_text()):
            if "*" not in path and not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)} names {path}")
    assert not missing, "\n".join(missing)


def test_the_configuration_page_holds_the_generated_key_table():
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert START in text and END in text, "docs/configuration.md has lost its table markers"
    shown = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert shown == table().strip(), ("docs/configuration.md's key table is not what the config declares: "
                                      "regenerate it with `python -m upcycle.config_table`")
