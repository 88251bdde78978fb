"""CPU tests of scripts/build_doc_corpus.py's cleaning, dedup and shard writing on tiny inline samples."""

import json
import re
import shutil

import pytest
from helpers.script_modules import load_script

corpus = load_script("build_doc_corpus")

_SENTENCES = (
    "The kernel keeps a list of the processes that are waiting for a lock, and it wakes the first one when "
    "the lock is released. This is not the only way to do it, but it is the one that is easiest to reason "
    "about, and it is fair to every process in the list."
)
ENGLISH = " ".join([_SENTENCES] * 3)


def test_html_drops_page_furniture_and_long_listings():
    html = (
        "<html><head><title>Page title</title></head><body>"
        '<nav><a href="/">Home</a> | <a href="/next">Next</a></nav>'
        '<div class="sphinxsidebar"><ul><li>Contents</li></ul></div>'
        '<h1>Sockets&nbsp;HOWTO<a class="headerlink" href="#s">\u00b6</a></h1>'
        "<p>A socket   is an  <em>endpoint</em>.</p>"
        "<ul><li>first</li><li>second</li></ul>"
        "<pre>ls -l\n  total 0</pre>"
        "<pre>" + "x = 1\n" * 300 + "</pre>"
        "<table><tr><td>a</td><td>b</td></tr></table>"
        '<div id="footer">Copyright</div>'
        "</body></html>"
    )
    assert corpus.html_to_text(html) == (
        "Sockets HOWTO\n\nA socket is an endpoint.\n\n- first\n\n- second\n\nls -l\n  total 0\n\na b"
    )


def test_html_skips_nested_furniture_to_its_own_end_tag():
    html = '<div class="toc"><div>one</div><div>two</div></div><p>kept</p><div role="navigation">gone</div>'
    assert corpus.html_to_text(html) == "kept"


def test_rst_cleanup():
    rst = (
        ".. SPDX-License-Identifier: GPL-2.0\n\n"
        ".. _sockets:\n\n"
        "=======\nSockets\n=======\n\n"
        ".. toctree::\n   :maxdepth: 2\n\n"
        "See :ref:`the API <api>` and :c:func:`socket` or ``connect()``; also `the site <https://example.org>`_.\n"
    )
    assert corpus.rst_to_text(rst) == "Sockets\n\nSee the API and socket or connect(); also the site."


def test_english_prose_filter():
    assert corpus.is_english_prose(ENGLISH)
    assert not corpus.is_english_prose(ENGLISH[: corpus.MIN_DOC_CHARS - 1])
    table = " ".join(f"the {i * 7919:08d} of {i * 104729:09d} and" for i in range(40))
    assert not corpus.is_english_prose(table)  # English words, but too few letters
    german = "Der Kern verwaltet eine Liste wartender Prozesse und weckt den ersten, sobald die Sperre frei wird. " * 8
    assert not corpus.is_english_prose(german)  # letters, but none of English's function words


def test_repeated_long_paragraphs_are_dropped():
    shared = "A paragraph long enough to count. " * 10
    short = "See also"
    seen: set[bytes] = set()
    first = corpus.drop_seen_paragraphs(f"Intro one.\n\n{shared}\n\n{short}", seen)
    second = corpus.drop_seen_paragraphs(f"Intro two.\n\n{shared}\n  \n{short}", seen)
    assert first == f"Intro one.\n\n{shared}\n\n{short}"
    assert second == f"Intro two.\n\n{short}"


def test_clean_documents_dedups_filters_and_splits():
    big = "\n\n".join(f"Paragraph {i}: {ENGLISH}" for i in range(corpus.MAX_DOC_CHARS // len(ENGLISH) + 10))
    docs = [("b", ENGLISH), ("a", ENGLISH), ("a", "too short"), ("c", big)]
    cleaned = corpus.clean_documents(docs)
    labels = [label for label, _ in cleaned]
    assert labels[:1] == ["a"] and "b" not in labels  # the duplicate kept is the first in sorted order
    big_pieces = [text for label, text in cleaned if label == "c"]
    # Pieces close at the first paragraph break past half the limit.
    assert len(big) > corpus.MAX_DOC_CHARS and len(big_pieces) == 3
    assert all(corpus.MAX_DOC_CHARS // 2 < len(piece) <= corpus.MAX_DOC_CHARS for piece in big_pieces[:2])
    assert "\n\n".join(big_pieces) == big


def test_shards_and_seeded_shuffle(tmp_path):
    docs = [("src", f"document {i} \u00e9") for i in range(40)]
    order = corpus.shuffled(docs, seed=0)
    assert order == corpus.shuffled(docs, seed=0)
    assert order != docs and sorted(order) == sorted(docs)
    assert order != corpus.shuffled(docs, seed=1)

    (tmp_path / "docs_07.jsonl").write_text("stale\n")
    paths = corpus.write_shards((text for _, text in order), tmp_path, shard_bytes=200)
    assert [path.name for path in paths] == [f"docs_{i:02d}.jsonl" for i in range(len(paths))]
    assert sorted(tmp_path.glob("docs_*.jsonl")) == paths  # the stale shard is gone
    assert len(paths) > 1 and all(path.stat().st_size <= 200 for path in paths)
    lines = [line for path in paths for line in path.read_text(encoding="utf-8").splitlines()]
    assert [json.loads(line) for line in lines] == [{"text": text} for _, text in order]


def test_info_nodes_drop_headers_and_menus():
    info = (
        "This is demo.info.\n\x1f\nFile: demo.info,  Node: Top,  Next: Intro\n\n"
        "Demo manual\n***********\n\nThis manual explains the demo program in detail.\n\n"
        "* Menu:\n\n* Intro::  Getting started.\n\n"
        "\x1f\nFile: demo.info,  Node: Intro,  Prev: Top\n\nShort\n"
        "\x1f\nTag Table:\nNode: Top\x7f20\n\x1f\nEnd Tag Table\n"
    )
    assert corpus.info_nodes(info) == ["Demo manual\n***********\n\nThis manual explains the demo program in detail."]


def test_docstring_download_command_lists_every_package():
    command = re.search(r"apt-get download ([^)]*)\)", corpus.__doc__).group(1)
    assert set(command.replace("\\", " ").split()) == corpus.PACKAGES


@pytest.mark.skipif(shutil.which("groff") is None, reason="needs groff")
def test_man_page_rendered_without_header_and_footer():
    roff = (
        '.TH DEMO 1 "2024-01-01" "demo 1.0" "User Commands"\n.SH NAME\ndemo \\- show a demo\n'
        ".SH DESCRIPTION\n.B demo\nprints a greeting to standard output and exits. " + "It takes no options. " * 12
    )
    text = corpus.man_to_text(roff)
    assert text.startswith("NAME\n       demo - show a demo")
    assert "DEMO(1)" not in text and "2024-01-01" not in text
    assert corpus.man_to_text(".so man1/other.1\n" + " " * 400) == ""


@pytest.mark.skipif(shutil.which("pod2text") is None, reason="needs pod2text")
def test_pod_rendered(tmp_path):
    pod = tmp_path / "demo.pod"
    pod.write_text("=head1 NAME\n\ndemo - show a demo\n\n=head1 DESCRIPTION\n\nPrints C<hello>.\n\n=cut\n")
    assert corpus.pod_file_to_text(pod) == 'NAME\n    demo - show a demo\n\nDESCRIPTION\n    Prints "hello".'
