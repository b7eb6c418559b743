"""The layout table of docs/development.md, generated from the code: every module of src/upcycle with its layer
(`test_import_graph.LAYERS`) and the first sentence of its docstring, so the table cannot name a file that does
not exist or miss one that does.

    .venv/bin/python tests/layout_table.py            # print it
    .venv/bin/python tests/layout_table.py --write    # replace the table in docs/development.md
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "rules"))

from test_import_graph import LAYERS, layer_of, module_name  # noqa: E402  (the path above first)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "upcycle"
PAGE = ROOT / "docs" / "development.md"
START, END = "<!-- layout-table -->", "<!-- /layout-table -->"


def first_sentence(path: Path) -> str:
    """The docstring's first sentence, on one line ('' when the module has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    # a sentence ends at a full stop before a capital (not "et al. 2024", not "--methods ... copy")
    match = re.search(r"\.(?=\s+[A-Z`(])", paragraph)
    sentence = paragraph[: match.start() + 1] if match else paragraph
    if sentence.endswith(":"):
        sentence = sentence[:-1] + "."
    return sentence.replace("|", "\\|")


def table() -> str:
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path, PACKAGE)
        unit, layer = layer_of(module)
        name = str(path.relative_to(PACKAGE))
        rows.append((layer, unit, name, first_sentence(path)))
    rows.sort(key=lambda r: (-r[0], r[1], r[2] != r[1].split(".")[-1] + "/__init__.py", r[2]))
    lines = ["| layer | module | its job |", "|---|---|---|"]
    lines += [f"| {layer} | `{name}` | {job} |" for layer, _, name, job in rows]
    assert set(LAYERS) >= {r[1] for r in rows}
    return "\n".join(lines)


def main() -> None:
    text = table()
    if "--write" not in sys.argv:
        print(text)
        return
    page = PAGE.read_text()
    head, rest = page.split(START, 1)
    PAGE.write_text(f"{head}{START}\n{text}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main()
