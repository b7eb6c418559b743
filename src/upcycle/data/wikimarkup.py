"""MediaWiki markup to readable prose: a deliberately small, dependency-free stripper.

It aims for readable paragraphs (calibration and probe text), not a faithful rendering: templates, tables,
references, file/category links and non-prose blocks go; link labels, headings' text and paragraphs stay.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable

_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.DOTALL)
_REF_SELF_CLOSING = re.compile(r"<ref\b[^<>]*/\s*>", re.IGNORECASE)
_REF_PAIRED = re.compile(r"<ref\b[^<>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
# Tags whose content is code, formulas or image lists, never prose; keeping
# their inner text (as for ordinary tags) would leave LaTeX or file names.
_NON_PROSE_BLOCK = re.compile(
    r"<(math|chem|gallery|timeline|imagemap|score|syntaxhighlight|source|graph)"
    r"\b[^<>]*>.*?</\1\s*>",
    re.IGNORECASE | re.DOTALL,
)
# Only things that look like tags: a bare "<" in prose ("x < y") must survive.
_HTML_TAG = re.compile(r"</?[A-Za-z][^<>]*>")
_TABLE_OPEN = re.compile(r"^[ \t:]*\{\|", re.MULTILINE)
_TABLE_TOKEN = re.compile(r"^[ \t:]*(\{\||\|\})", re.MULTILINE)
_DROPPED_LINK = re.compile(r"\s*(?:file|image|category)\s*:", re.IGNORECASE)
# [[de:Foo]]-style interlanguage links are metadata, not text.
_INTERLANGUAGE_LINK = re.compile(r"[a-z]{2,3}(?:-[a-z0-9]+)*:")
_EXTERNAL_LINK = re.compile(r"\[(?:[a-z][a-z0-9+.-]*:)?//[^\s\[\]]+(?:[ \t]+([^\]\n]*))?\]", re.IGNORECASE)
_QUOTES = re.compile(r"'{2,}")
_HEADING = re.compile(r"^[ \t]*=+[ \t]*(.*?)[ \t]*=+[ \t]*$", re.MULTILINE)
_LIST_MARKER = re.compile(r"^[ \t]*[*#:;]+[ \t]*", re.MULTILINE)
_HORIZONTAL_RULE = re.compile(r"^[ \t]*-{4,}[ \t]*$", re.MULTILINE)
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_EMPTY_PARENS = re.compile(r"\([\s,;]*\)")
_SPACE_BEFORE_PUNCT = re.compile(r"[ \t]+([,;.])(?=\s|$)")
_RUNS_OF_SPACES = re.compile(r"[ \t]+")
_LINE_EDGE_SPACES = re.compile(r"^ +| +$", re.MULTILINE)
_MANY_NEWLINES = re.compile(r"\n{3,}")
_BRACKET_CHARS = {"{": re.compile(r"[{}]"), "[": re.compile(r"[\[\]]")}


def _balanced_end(text: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index just past the bracket group opening at ``start``, or -1 if unclosed.

    Single characters are counted rather than ``{{``/``}}`` pairs so that
    template parameters (``{{{1}}}``) and external links inside file captions
    (``[[File:x|[http://a b]]]``) balance correctly.
    """
    depth = 0
    for match in _BRACKET_CHARS[open_ch].finditer(text, start):
        depth += 1 if match.group() == open_ch else -1
        if depth == 0:
            return match.end()
    return -1


def _replace_groups(text: str, opener: str, replace: Callable[[str], str]) -> str:
    """Replace every balanced group starting with ``opener`` by ``replace(inner)``.

    A group that never closes loses only its opener, so one stray ``{{`` does
    not swallow the rest of the article.
    """
    open_ch, close_ch = opener[0], {"{": "}", "[": "]"}[opener[0]]
    out: list[str] = []
    pos = 0
    while (start := text.find(opener, pos)) >= 0:
        out.append(text[pos:start])
        end = _balanced_end(text, start, open_ch, close_ch)
        if end < 0:
            pos = start + len(opener)
            continue
        out.append(replace(text[start + len(opener) : end - len(opener)]))
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _remove_tables(text: str) -> str:
    """Drop ``{| ... |}`` tables, nested ones included (cells are rarely prose)."""
    out: list[str] = []
    pos = 0
    while match := _TABLE_OPEN.search(text, pos):
        out.append(text[pos : match.start()])
        depth = 0
        end = -1
        for token in _TABLE_TOKEN.finditer(text, match.start()):
            depth += 1 if token.group(1) == "{|" else -1
            if depth == 0:
                # The closing "|}" line may carry trailing junk; drop the line.
                line_end = text.find("\n", token.end())
                end = len(text) if line_end < 0 else line_end
                break
        if end < 0:
            # Unclosed table: drop only its opening line, keep what follows.
            line_end = text.find("\n", match.end())
            end = len(text) if line_end < 0 else line_end
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _link_text(inner: str) -> str:
    """Visible text of a ``[[...]]`` link given its inner content."""
    if _DROPPED_LINK.match(inner) or _INTERLANGUAGE_LINK.match(inner):
        return ""
    target, _, label = inner.partition("|")
    # "[[Foo (bar)|]]" (the pipe trick) and "[[Foo|]]" show the target.
    shown = label if label.strip() else target
    # Labels may themselves hold links in odd pages; a leading ":" only marks
    # an inline link to a category or file page.
    return _replace_groups(shown.lstrip(":"), "[[", _link_text)


def strip_wiki_markup(text: str) -> str:
    """Turn MediaWiki source into plain prose paragraphs.

    Removes comments, references, templates, tables, file/category and
    interlanguage links, external-link URLs, emphasis quotes, heading and list
    markers and HTML tags (keeping their inner text), then decodes entities
    and tidies whitespace.  It is a pragmatic approximation, not a parser.
    """
    # Comments first: they may hide any other markup, balanced or not.
    text = _COMMENT.sub("", text)
    text = _REF_SELF_CLOSING.sub("", text)
    text = _REF_PAIRED.sub("", text)
    text = _NON_PROSE_BLOCK.sub("", text)
    # Templates before tables: templates often contain table syntax, and
    # before links: template arguments contain links we do not want to keep.
    text = _replace_groups(text, "{{", lambda _inner: "")
    text = _remove_tables(text)
    text = _replace_groups(text, "[[", _link_text)
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1) or "", text)
    text = _HTML_TAG.sub("", text)
    text = _QUOTES.sub("", text)
    text = _HEADING.sub(r"\1", text)
    text = _LIST_MARKER.sub("", text)
    text = _HORIZONTAL_RULE.sub("", text)
    text = _MAGIC_WORD.sub("", text)
    # Entities last, so characters that authors escaped on purpose
    # (&lt;, &#91;) come out as literal text instead of being parsed as markup.
    text = html.unescape(text).replace("\xa0", " ")
    # Removed templates leave "()" and " ," behind, e.g. "(born {{date}})".
    text = _EMPTY_PARENS.sub("", text)
    text = _RUNS_OF_SPACES.sub(" ", text)
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    text = _LINE_EDGE_SPACES.sub("", text)
    text = _MANY_NEWLINES.sub("\n\n", text)
    return text.strip()
