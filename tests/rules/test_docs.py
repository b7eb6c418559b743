"""The documentation stays true to the repository: the README is short, every link and path the README and
docs/ name exists, and the configuration page's key table is the one the code's declarations generate."""

from __future__ import annotations

import re
from pathlib import Path

from upcycle.config_table import END, START, table

ROOT = Path(__file__).resolve().parents[2]
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


# Words that tell how the code was made rather than what it does: an issue or a review that asked for it, the
# session or wave of work it came in, a commit hash used as the date of a measurement. A reader of the code and
# docs needs none of them; the history is in git.
PROCESS_WORDS = re.compile(
    r"\bissues?\s*#?\d+|\(issue\b|\bthe issue\b|\bas (?:the )?issue\b"
    r"|\b(?:the|a|an|adversarial|code|last|first|second)\s+review(?:er)?s?\b|\breviewer'?s?\b"
    r"|\b(?:this|that|the|a|each|one|two|three|several|first|second|third|last|next|previous|earlier|later|another)"
    r"\s+sessions?\b"
    r"|\bsessions?'s?\b(?!\.sh)|\bbetween sessions\b"
    r"|\b(?:this|last|next|previous|the last)\s+(?:wave|round of work)\b|\bthis (?:change|PR|pull request)\b"
    r"|\b(?:at|since|before|after|as of|from) commit [0-9a-f]{7,40}\b",
    flags=re.IGNORECASE)
# Words that tell a measurement's history instead of what is: the code before a change, the run that came first,
# what was fixed and when. The docs say what the code does and what it measures now, in the present tense; the
# history of the numbers is in git and in the results files, which keep every row with its commit.
NARRATIVE_WORDS = re.compile(
    r"\bearlier (?:code|runs?|versions? of (?:this|the) code)\b|\bbefore the [\w-]+ work\b"
    r"|\bthe first run (?:of|missed)\b|\b(?:was|were) re-?run\b|\bin the time there was\b|\bhad taken\b"
    r"|\ball fixed\b|\bnot yet understood\b|\bstill failing\b|\bnow (?:checks|runs|takes|gives|writes)\b"
    r"|\bused to (?:be|take|run)\b",
    flags=re.IGNORECASE)
# Records of provenance that name the commit which wrote a test fixture, so that it can be written again; and the
# files that hold the rules themselves (their patterns and examples).
EXEMPT = {"tests/fixtures/pre_layout/README.md", "tests/fixtures/reports_before/README.md",
          "tests/commands/test_old_checkpoints.py", "tests/rules/test_docs.py", "tests/rules/test_source_rules.py"}


def _written_text() -> list[Path]:
    files = [ROOT / "README.md", *DOCS, *(ROOT / "tests").rglob("*.py"), *(ROOT / "tests").rglob("*.md")]
    for pattern in ("*.py", "*.yaml", "*.md"):
        files += (ROOT / "src" / "upcycle").rglob(pattern)
    return sorted(p for p in files if str(p.relative_to(ROOT)) not in EXEMPT)


def test_no_file_narrates_how_it_was_made():
    found = [f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}" for path in _written_text()
             for n, line in enumerate(path.read_text().splitlines(), 1) for m in PROCESS_WORDS.finditer(line)]
    assert not found, "\n".join(found)


def test_no_file_tells_the_history_of_its_numbers():
    found = [f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}" for path in _written_text()
             for n, line in enumerate(path.read_text().splitlines(), 1) for m in NARRATIVE_WORDS.finditer(line)]
    assert not found, "\n".join(found)


def test_the_narrative_word_pattern_catches_the_usual_phrases():
    for phrase in ("| earlier code |", "Before the memory work the checked run took 120 s",
                   "The first run of this study", "were re-run with a checkpoint", "in the time there was",
                   "the same analysis had taken 422 s", "four places (all fixed)",
                   "Still failing there, not yet understood", "the test now checks that"):
        assert NARRATIVE_WORDS.search(phrase), phrase
    for phrase in ("the earliest checkpoint", "before the first block", "the first run's seed", "fixed-size rows",
                   "from here on it writes", "re-running a cell"):
        assert not NARRATIVE_WORDS.search(phrase), phrase


def test_the_process_word_pattern_catches_the_usual_phrases():
    for phrase in ("every bad input the issue lists", "Issue 11 asked", "(issue 4)", "the adversarial review",
                   "a reviewer's VM", "the session of this change had no GPU", "over two sessions",
                   "The second session's runs", "541 s at commit 6b77dce", "differences between sessions"):
        assert PROCESS_WORDS.search(phrase), phrase
    for phrase in ("scope=\"session\"", "gpu_session.sh", "onnxruntime.InferenceSession", "seconds_this_session",
                   "(under review; no arXiv id)", "llama.cpp's own commit 0c1e57098", "round(x, 4)"):
        assert not PROCESS_WORDS.search(phrase), phrase


def test_the_development_page_holds_the_generated_layout_table():
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from layout_table import END as LAYOUT_END
    from layout_table import START as LAYOUT_START
    from layout_table import table as layout

    text = (ROOT / "docs" / "development.md").read_text()
    assert LAYOUT_START in text and LAYOUT_END in text, "docs/development.md has lost its layout table markers"
    shown = text.split(LAYOUT_START, 1)[1].split(LAYOUT_END, 1)[0].strip()
    assert shown == layout().strip(), ("docs/development.md's layout table is not what the code says: "
                                       "regenerate it with `.venv/bin/python tests/layout_table.py --write`")
    assert f"`{Path(__file__).name}`" not in shown          # the table lists src/upcycle, not the tests
    assert "`training/trainer.py`" in shown and "`probe.py`" in shown
