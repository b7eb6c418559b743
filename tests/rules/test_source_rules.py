"""Rules over the source tree: no module reaches into another's private names, and every reference the code
makes to the design and methods documents names a file and a section that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src" / "upcycle"


def _modules():
    for path in sorted(SOURCE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def test_no_module_imports_another_modules_underscore_name():
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name} from {node.module}"
                          for a in node.names if a.name.startswith("_") and a.name != "__version__"]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                # module._name: only `self._x`/`cls._x` and objects' own attributes are allowed, so flag names
                # read off an imported module
                base = node.value
                if isinstance(base, ast.Name) and base.id in _imported_modules(tree):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {base.id}.{node.attr}")
    assert not found, "\n".join(found)


def _imported_modules(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("upcycle")}
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("upcycle")):
            # `from . import mixtral`: a module of ours under that name
            names |= {a.asname or a.name for a in node.names
                      if (SOURCE / Path(*(node.module or "").split("."))).with_suffix("").exists()
                      or (SOURCE / Path(*(node.module or "").split(".")) / f"{a.name}.py").exists()}
    return names


REFERENCE = re.compile(r"(docs/[\w./-]+\.md)(?:\s+(?:§\s*([\d.]+)|principle\s+(\d+)))?")
STALE = re.compile(r"\b(METHODS|DESIGN)(\.md)?\s*(§|principle)|\bissue \d+|\(issue|DESIGN\b")


def _sections(doc: Path) -> tuple[set[str], set[str]]:
    """The § numbers (from headings like `## §2.3 Title` or `## 2.3 Title`) and the design principles
    (numbered list items `N. **...`) a document holds."""
    text = doc.read_text()
    sections = set(re.findall(r"^#+\s*§?\s*(\d+(?:\.\d+)*)\b", text, flags=re.M))
    principles = set(re.findall(r"^(\d+)\.\s+\*\*", text, flags=re.M))
    return sections, principles


CODE = [*sorted(SOURCE.rglob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py")),
        *sorted(SOURCE.rglob("*.yaml"))]


def test_every_document_reference_in_the_code_resolves():
    problems, seen = [], 0
    for path in CODE:
        text = path.read_text()
        where = path.relative_to(ROOT)
        for match in STALE.finditer(text):
            problems.append(f"{where}: '{match.group(0)}' names a document or an issue outside the repository")
        for doc, section, principle in REFERENCE.findall(text):
            seen += 1
            file = ROOT / doc
            if not file.is_file():
                problems.append(f"{where}: {doc} does not exist")
                continue
            sections, principles = _sections(file)
            if section and section.rstrip(".") not in sections:
                problems.append(f"{where}: {doc} has no section §{section}")
            if principle and principle not in principles:
                problems.append(f"{where}: {doc} has no principle {principle}")
    assert seen > 20, "the code cites the docs by file and section; the pattern found too few"
    assert not problems, "\n".join(problems)


def test_only_the_staging_module_renames_an_output_into_place():
    """One atomic-write helper: every rename that puts a file or folder in place (`os.replace`, `os.rename`,
    `Path.replace(target)`, `Path.rename(target)`) is in upcycle/outputs/staging.py, and the rest of the package
    writes through it (`staged_directory`, `Staging`, `atomic_directory`, `atomic_write`). A one-argument
    `.replace(x)` is a Path's: `str.replace` takes two, and `dataclasses.replace` is called with keywords."""
    found = []
    for path, tree in _modules():
        if path == SOURCE / "outputs" / "staging.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                call, owner = node.func, getattr(node.func.value, "id", None)
                if (owner == "os" and call.attr in ("replace", "rename", "renames")) or \
                        (call.attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "\n".join(found)
