"""Tests for upcycle.data.text: markup stripping, dump parsing, splits, caches, files."""

from __future__ import annotations

import bz2
import json
import os
import pathlib
import time

import pytest

from conftest import require_assets
from upcycle.data import text as T

# ---------------------------------------------------------------------------
# strip_wiki_markup
# ---------------------------------------------------------------------------


def test_nested_templates_removed_entirely():
    src = "Before {{Infobox|a={{nested|{{deeper}}}}|b=[[x]]}} after."
    assert T.strip_wiki_markup(src) == "Before after."


def test_template_parameters_with_triple_braces():
    assert T.strip_wiki_markup("a {{{1|{{x}}}}} b") == "a b"


def test_unclosed_template_does_not_swallow_the_rest():
    out = T.strip_wiki_markup("Keep {{broken this text {{ok}} and this.")
    assert "{{" not in out
    assert "this text" in out and "and this." in out


def test_piped_and_plain_links():
    src = "A [[political philosophy]] of [[self-governance|self-governed]] [[apple]]s."
    assert T.strip_wiki_markup(src) == ("A political philosophy of self-governed apples.")


def test_pipe_trick_link_shows_target():
    assert T.strip_wiki_markup("see [[Paris (France)|]]") == "see Paris (France)"


def test_file_links_with_nested_links_are_dropped():
    src = (
        "Intro [[File:Map.png|thumb|200px|A map of [[France]] and "
        "[[Spain|Spanish]] lands [http://x.org site]]] end. "
        "[[Image:Pic.jpg|left|caption [[with link]]]]"
    )
    out = T.strip_wiki_markup(src)
    assert out == "Intro end."


def test_category_and_interlanguage_links_dropped():
    src = "Body text.\n\n[[Category:Things| ]]\n[[category:Other]]\n[[de:Ding]]"
    assert T.strip_wiki_markup(src) == "Body text."


def test_refs_removed_in_all_forms():
    src = (
        'Claim.<ref name="a">{{cite web|url=http://x}} Some [[source]]</ref> '
        'More<ref name="b" /> text<REF>upper</REF>.'
    )
    out = T.strip_wiki_markup(src)
    assert out == "Claim. More text."


def test_comments_and_html_tags():
    src = "x<!-- hidden [[link]] -->y <small>tiny</small> H<sub>2</sub>O a < b"
    assert T.strip_wiki_markup(src) == "xy tiny H2O a < b"


def test_non_prose_blocks_dropped():
    assert T.strip_wiki_markup("Area <math>\\pi r^2</math> here") == "Area here"


def test_tables_removed_including_nested():
    src = "Before.\n{| class=wikitable\n|-\n| cell one || cell two\n|-\n|\n{|\n| inner cell\n|}\n|}\nAfter."
    out = T.strip_wiki_markup(src)
    assert "cell" not in out
    assert out == "Before.\n\nAfter."


def test_unclosed_table_drops_only_its_opening_line():
    out = T.strip_wiki_markup("Before.\n{| class=wikitable\nStill prose here.")
    assert out == "Before.\n\nStill prose here."


def test_headings_bold_italic_and_lists():
    src = (
        "== History ==\n"
        "'''Anarchism''' is ''a'' '''''word'''''.\n"
        "=== Sub ===\n"
        "* first item\n"
        "# numbered\n"
        ": indented\n"
        "; term\n"
    )
    assert T.strip_wiki_markup(src) == (
        "History\nAnarchism is a word.\nSub\nfirst item\nnumbered\nindented\nterm"
    )


def test_external_links():
    src = "See [http://example.com the site] and [https://bare.org] and [//p.org rel]."
    assert T.strip_wiki_markup(src) == "See the site and and rel."


def test_entities_and_whitespace():
    src = "a&nbsp;b &amp; c &ndash; d   \n\n\n\n\nnext   para  "
    assert T.strip_wiki_markup(src) == "a b & c – d\n\nnext para"


def test_escaped_markup_survives_as_text():
    # Authors escape brackets they mean literally; they must not be re-parsed.
    assert T.strip_wiki_markup("x &lt;b&gt; y") == "x <b> y"


# ---------------------------------------------------------------------------
# Synthetic dump
# ---------------------------------------------------------------------------

_NS = "http://www.mediawiki.org/xml/export-0.10/"
_BODY = "This is a sentence about [[topic]] with {{tmpl|x}} markup. " * 8


def _page(title: str, text: str, ns: int = 0, redirect: bool = False) -> str:
    redirect_xml = f'<redirect title="{title}x" />' if redirect else ""
    escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (
        f"<page><title>{title}</title><ns>{ns}</ns><id>1</id>{redirect_xml}"
        f'<revision><id>2</id><text xml:space="preserve">{escaped}</text>'
        f"</revision></page>"
    )


def _write_dump(path: pathlib.Path, pages: list[str]) -> pathlib.Path:
    xml = (
        f'<mediawiki xmlns="{_NS}" version="0.10"><siteinfo><sitename>W</sitename>'
        f"</siteinfo>{''.join(pages)}</mediawiki>"
    )
    with bz2.open(path, "wt", encoding="utf-8") as handle:
        handle.write(xml)
    return path


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("UPCYCLE_CACHE", str(cache))
    return cache


@pytest.fixture
def small_dump(tmp_path):
    pages = [
        _page("Alpha", "Alpha. " + _BODY),
        _page("Redirected", "Some text " + _BODY, redirect=True),
        _page("Hash redirect", "#redirect [[Alpha]]\n" + _BODY),
        _page("Upper redirect", "  #REDIRECT [[Alpha]]"),
        _page("Talk:Alpha", "Talk. " + _BODY, ns=1),
        _page("Template:Box", "Template. " + _BODY, ns=10),
        _page("Stub", "Too short {{but with a long template " + "x" * 500 + "}}"),
        _page("Beta", "Beta. <ref>r</ref>" + _BODY),
    ] + [_page(f"Gen{i}", f"Gen{i}. " + _BODY) for i in range(10)]
    return _write_dump(tmp_path / "dump.xml.bz2", pages)


def test_articles_skip_redirects_namespaces_and_stubs(small_dump):
    articles = T.wikipedia_articles(small_dump)
    titles = [a.title for a in articles]
    assert titles == ["Alpha", "Beta"] + [f"Gen{i}" for i in range(10)]
    assert all(isinstance(a, T.Article) for a in articles)
    assert articles[0].text.startswith("Alpha. This is a sentence about topic with")
    assert all("{{" not in a.text and "<ref" not in a.text for a in articles)
    assert all(len(a.text) >= 200 for a in articles)


def test_article_is_frozen():
    article = T.Article(title="t", text="x")
    with pytest.raises(AttributeError):
        article.text = "y"  # type: ignore[misc]


def test_articles_without_namespace_uri(tmp_path):
    xml = (
        "<mediawiki><page><title>Plain</title><ns>0</ns><revision><text>"
        + "plain words " * 30
        + "</text></revision></page></mediawiki>"
    )
    path = tmp_path / "plain.xml.bz2"
    path.write_bytes(bz2.compress(xml.encode()))
    assert [a.title for a in T.wikipedia_articles(path)] == ["Plain"]


def test_split_is_deterministic_and_disjoint(small_dump, cache_env):
    train, heldout = T.wikipedia_split(heldout_every=4, path=small_dump)
    texts = [a.text for a in T.wikipedia_articles(small_dump)]
    # 12 articles: indices 3, 7, 11 are held out.
    assert heldout == [texts[3], texts[7], texts[11]]
    assert train == [t for i, t in enumerate(texts) if i % 4 != 3]
    assert not set(train) & set(heldout)
    assert T.wikipedia_split(heldout_every=4, path=small_dump) == (train, heldout)


def test_split_rejects_bad_heldout_every(small_dump, cache_env):
    with pytest.raises(ValueError):
        T.wikipedia_split(heldout_every=1, path=small_dump)


def test_split_writes_and_reuses_jsonl_cache(small_dump, cache_env, monkeypatch):
    first = T.wikipedia_split(heldout_every=3, path=small_dump)
    caches = list(cache_env.glob("enwiki-articles*.jsonl"))
    assert len(caches) == 1
    assert not list(cache_env.glob("*.tmp"))  # the temp file was renamed away
    rows = [json.loads(line) for line in caches[0].read_text("utf-8").splitlines()]
    assert set(rows[0]) == {"title", "text"}
    assert [r["title"] for r in rows][:2] == ["Alpha", "Beta"]

    def boom(*_args, **_kwargs):
        raise AssertionError("parser must not run when the cache exists")

    monkeypatch.setattr(T, "wikipedia_articles", boom)
    assert T.wikipedia_split(heldout_every=3, path=small_dump) == first
    # The cache file, not the dump, is the source on later calls.
    caches[0].write_text(
        "\n".join(json.dumps({"title": f"t{i}", "text": f"x{i}"}) for i in range(4)),
        encoding="utf-8",
    )
    assert T.wikipedia_split(heldout_every=2, path=small_dump) == (
        ["x0", "x2"],
        ["x1", "x3"],
    )


def test_default_dump_uses_named_cache(cache_env, monkeypatch, small_dump):
    monkeypatch.setattr(T, "wikipedia_dump_path", lambda: small_dump)
    train, heldout = T.wikipedia_split()
    assert (cache_env / "enwiki-articles.jsonl").is_file()
    assert len(train) + len(heldout) == 12 and len(heldout) == 1


def test_damaged_cache_is_rebuilt(small_dump, cache_env):
    first = T.wikipedia_split(heldout_every=3, path=small_dump)
    cache = next(cache_env.glob("enwiki-articles*.jsonl"))
    cache.write_text("{not json\n", encoding="utf-8")
    assert T.wikipedia_split(heldout_every=3, path=small_dump) == first


def test_a_read_only_cache_loses_only_the_shortcut(small_dump, cache_env):
    """A cache folder upcycle cannot write (read-only, full): the articles are parsed and used all the same, and a
    warning says they were not cached; nothing is written there."""
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    cache_env.mkdir()
    cache_env.chmod(0o555)
    try:
        with pytest.warns(UserWarning, match="were not cached in"):
            train, held = T.wikipedia_split(heldout_every=3, path=small_dump)
        assert train and held and list(cache_env.iterdir()) == []
    finally:
        cache_env.chmod(0o755)


def test_a_cache_write_that_fails_loses_only_the_shortcut(small_dump, cache_env, monkeypatch):
    """The same without relying on permissions (root ignores them): the write fails with EROFS."""
    import errno

    def refused(path, write):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(T, "atomic_write", refused)
    with pytest.warns(UserWarning, match="were not cached in .*Read-only file system"):
        assert T.wikipedia_split(heldout_every=3, path=small_dump)[0]


def test_a_cache_location_that_is_a_file_is_refused_at_first_use(tmp_path, monkeypatch):
    from upcycle.errors import UpcycleError

    (tmp_path / "cache").write_text("mine")
    monkeypatch.setenv("UPCYCLE_CACHE", str(tmp_path / "cache"))
    for create in (True, False):
        with pytest.raises(UpcycleError, match=r"cache folder \(UPCYCLE_CACHE\) is .*cache, which is not a folder"):
            T.cache_dir(create=create)
    assert (tmp_path / "cache").read_text() == "mine"


# ---------------------------------------------------------------------------
# cache_dir
# ---------------------------------------------------------------------------


def test_cache_dir_prefers_upcycle_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UPCYCLE_CACHE", str(tmp_path / "a" / "b"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert T.cache_dir() == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()


def test_cache_dir_uses_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("UPCYCLE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert T.cache_dir() == tmp_path / "xdg" / "upcycle"
    assert (tmp_path / "xdg" / "upcycle").is_dir()


def test_cache_dir_falls_back_to_home(tmp_path, monkeypatch):
    monkeypatch.delenv("UPCYCLE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert T.cache_dir() == tmp_path / ".cache" / "upcycle"
    assert (tmp_path / ".cache" / "upcycle").is_dir()


# ---------------------------------------------------------------------------
# read_texts
# ---------------------------------------------------------------------------


def test_read_texts_jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(
        '{"text": "first doc", "id": 1}\n\n{"text": "second\\ndoc"}\n   \n',
        encoding="utf-8",
    )
    assert T.read_texts(path) == ["first doc", "second\ndoc"]
    assert T.read_texts(str(path)) == ["first doc", "second\ndoc"]


@pytest.mark.parametrize(
    "bad_line",
    ['{"text": ', '{"title": "no text"}', '{"text": 3}', '["text"]'],
)
def test_read_texts_jsonl_errors_name_file_and_line(tmp_path, bad_line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n' + bad_line + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        T.read_texts(path)
    assert str(path) in str(info.value)
    assert ":3:" in str(info.value)


def test_read_texts_plain(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text(
        "\n\nFirst para\nsecond line\n\n\n  \nSecond doc\n\n\n\nThird\n",
        encoding="utf-8",
    )
    assert T.read_texts(path) == ["First para\nsecond line", "Second doc", "Third"]


def test_read_texts_missing_file(tmp_path):
    path = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError) as info:
        T.read_texts(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("name", "content"),
    [("empty.txt", ""), ("blank.txt", "\n \n\n"), ("empty.jsonl", '\n{"text": " "}\n')],
)
def test_read_texts_no_text(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match="no text"):
        T.read_texts(path)


# ---------------------------------------------------------------------------
# The real dump shipped in the gensim wheel
# ---------------------------------------------------------------------------


def test_dump_path_missing_package(monkeypatch):
    monkeypatch.setattr(T.importlib.util, "find_spec", lambda _name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gensim==4.4.0"):
        T.wikipedia_dump_path()


def test_real_dump(cache_env, capsys):
    require_assets("gensim")
    path = T.wikipedia_dump_path()
    assert path.is_file() and os.fspath(path).endswith("-shortened.bz2")
    start = time.perf_counter()
    articles = T.wikipedia_articles()
    assert time.perf_counter() - start < 20
    assert len(articles) >= 80
    words = sum(len(a.text.split()) for a in articles)
    assert 300_000 <= words <= 700_000
    for article in articles:
        for junk in ("{{", "[[", "<ref"):
            assert junk not in article.text, (article.title, junk)
    train, heldout = T.wikipedia_split()
    assert len(heldout) == len(articles) // 10
    assert len(train) + len(heldout) == len(articles)
    assert (cache_env / "enwiki-articles.jsonl").is_file()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
