"""Build an English text corpus from Debian documentation packages.

The corpus behind ``data/docs`` (the benchmarks' "English technical documentation"): the Python, Linux
kernel, Perl, PostgreSQL, SQLite, Django and git manuals, man pages, the Debian guides, GIMP and GnuCash
help, GNU info manuals, NetHack spoilers, plus the King James Bible, the Jargon File and fortunes. Each
document is cleaned to plain text (navigation and long listings dropped), repeated long paragraphs and
repeated documents are removed, documents that are short or not English prose are dropped, and the rest is
shuffled with ``--seed`` into ``<out>/docs_NN.jsonl`` shards, one ``{"text": ...}`` per line.

Inputs are Debian bookworm packages (the package names carry bookworm's versions), fetched on any machine
with bookworm in its apt sources:

    mkdir -p debs && (cd debs && apt-get download python3.11-doc linux-doc-6.1 manpages manpages-dev \\
        perl-doc postgresql-doc-15 debian-reference-en debian-handbook debian-policy debian-faq maint-guide \\
        developers-reference python-django-doc git-doc sqlite3-doc gimp-help-en gnucash-docs \\
        nethack-spoilers gnu-standards autoconf-doc bash-doc emacs-common bible-kjv bible-kjv-text \\
        fortunes jargon-text)

then

    python scripts/build_doc_corpus.py --debs debs --out corpus/docs
    python scripts/tokenize_corpus.py --out data/docs name=local 'paths=[corpus/docs/docs_*.jsonl]' \\
        tokenizer=embedded

Needs ``dpkg-deb`` (with ``--debs``), ``groff`` (man pages) and ``pod2text`` (Perl's pod); ``bible-kjv``'s
own ``bible`` program extracts the Bible's text, so that package must be of the machine's architecture.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser
from multiprocessing import Pool
from pathlib import Path

MIN_DOC_CHARS = 500
MAX_DOC_CHARS = 200_000  # bigger documents are split at paragraph breaks into pieces of about half this
MAX_PRE_CHARS = 1000  # longer <pre> blocks are listings or program output, not prose
MIN_DEDUP_PARAGRAPH_CHARS = 200  # shorter paragraphs ("Example:", "See also") legitimately repeat
MIN_LETTER_SHARE = 0.6  # of non-space characters that are ASCII letters
MIN_FUNCTION_WORD_SHARE = 0.06  # of words that are common English function words
ENGLISH_SAMPLE_CHARS = 20_000
FUNCTION_WORDS = frozenset(
    {
        "the",
        "of",
        "and",
        "to",
        "a",
        "in",
        "is",
        "that",
        "for",
        "it",
        "be",
        "are",
        "with",
        "as",
        "this",
        "by",
        "or",
        "not",
        "on",
    }
)
PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
MIN_MAN_SOURCE_CHARS = 300  # smaller man sources are stubs with no body worth keeping
TOOL_TIMEOUT_S = 120


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def read_text(path: Path) -> str:
    """The file's text, gunzipped when its name ends in .gz; undecodable bytes become U+FFFD."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        return handle.read().decode("utf-8", errors="replace")


def list_files(package_dir: Path, folder: str, pattern: str, exclude: str | None = None) -> list[Path]:
    """Regular files matching the glob pattern under package_dir/folder, sorted.

    exclude is a regex searched in the file's installed path (``/usr/share/...``).
    """
    found = []
    for path in sorted((package_dir / folder).glob(pattern)):
        # A symlink repeats a file listed under its own name, or points outside the package.
        if path.is_symlink() or not path.is_file():
            continue
        if exclude and re.search(exclude, "/" + path.relative_to(package_dir).as_posix()):
            continue
        found.append(path)
    return found


def join_until_over(items: Iterable[str], chars: int) -> list[str]:
    """Items joined by blank lines into documents, each closed once it is longer than chars."""
    docs, current = [], ""
    for item in items:
        current = f"{current}\n\n{item}" if current else item
        if len(current) > chars:
            docs.append(current)
            current = ""
    if current:
        docs.append(current)
    return docs


def join_up_to(items: Iterable[str], chars: int) -> list[str]:
    """Items joined by blank lines into documents of up to about chars (a longer item stays whole)."""
    docs, current = [], ""
    for item in items:
        if current and len(current) + len(item) > chars:
            docs.append(current)
            current = ""
        current = f"{current}\n\n{item}" if current else item
    if current:
        docs.append(current)
    return docs


# ----------------------------------------------------------------------------------------------- HTML

# Elements and attributes of page furniture (navigation, tables of contents, headers, footers, forms).
SKIPPED_TAGS = frozenset(
    {"script", "style", "head", "nav", "header", "footer", "noscript", "svg", "button", "form", "select"}
)
SKIPPED_CLASSES = frozenset(
    {
        "sphinxsidebar",
        "related",
        "footer",
        "navheader",
        "navfooter",
        "headerlink",
        "toc",
        "toctree-wrapper",
        "breadcrumbs",
        "navigation",
        "docnav",
        "mobile-nav",
        "menu",
        "header",
        "document-nav",
        "nav",
        "docs-toc",
        "contents",
        "topic",
        "footnote-back",
        "highlight-pycon3",
    }
)
SKIPPED_IDS = frozenset(
    {"sidebar", "footer", "header", "toc", "nav", "docs-content-nav", "billboard", "search", "banner"}
)
PARAGRAPH_TAGS = frozenset(
    {"p", "h1", "h2", "h3", "h4", "h5", "h6", "table", "section", "dl", "ul", "ol", "blockquote"}
)
LINE_TAGS = frozenset({"div", "br", "li", "tr", "dt", "dd", "article", "main", "hr", "caption", "figure", "title"})
CELL_TAGS = frozenset({"td", "th"})
# Elements with no end tag: skipping one must not wait for a closing tag that never comes.
VOID_TAGS = frozenset({"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "wbr"})


def is_page_furniture(tag: str, attrs: dict[str, str | None]) -> bool:
    classes = set((attrs.get("class") or "").split())
    return (
        tag in SKIPPED_TAGS
        or not classes.isdisjoint(SKIPPED_CLASSES)
        or (attrs.get("id") or "") in SKIPPED_IDS
        or attrs.get("role") == "navigation"
    )


def normalize_flow_text(text: str) -> str:
    """Running HTML text with whitespace collapsed the way a browser shows it."""
    text = re.sub(r"[ \t\r\f\v\u00a0]+", " ", text)
    text = text.replace("\u00b6", "")  # Sphinx's pilcrow permalinks
    return re.sub(r" *\n *", "\n", text)


class _TextExtractor(HTMLParser):
    """Collects a page's text: block elements become line breaks, page furniture is skipped."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self._segments: list[str] = []  # finished text: normalized running text and verbatim <pre> blocks
        self._flow: list[str] = []  # running text not yet normalized
        self._skipped_tag: str | None = None
        self._skip_depth = 0  # open elements named _skipped_tag, the skipped one included
        self._pre_depth = 0
        self._pre: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skipped_tag:
            if tag == self._skipped_tag and tag not in VOID_TAGS:
                self._skip_depth += 1
            return
        if is_page_furniture(tag, dict(attrs)):
            if tag not in VOID_TAGS:
                self._skipped_tag, self._skip_depth = tag, 1
            return
        if tag == "pre":
            self._pre_depth += 1
        elif self._pre_depth:
            return  # a <pre> block's whitespace is its own; markup inside it adds none
        elif tag in PARAGRAPH_TAGS:
            self._flow.append("\n\n")
        elif tag in LINE_TAGS:
            self._flow.append("\n- " if tag == "li" else "\n")
        elif tag in CELL_TAGS:
            self._flow.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if self._skipped_tag:
            if tag == self._skipped_tag:
                self._skip_depth -= 1
                if self._skip_depth == 0:
                    self._skipped_tag = None
            return
        if tag == "pre":
            if self._pre_depth:
                self._pre_depth -= 1
                if self._pre_depth == 0:
                    self._close_pre()
        elif not self._pre_depth and (tag in PARAGRAPH_TAGS or tag in LINE_TAGS):
            self._flow.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skipped_tag:
            (self._pre if self._pre_depth else self._flow).append(data)

    def _close_pre(self) -> None:
        block = "".join(self._pre).strip("\n")
        self._pre = []
        if 0 < len(block) <= MAX_PRE_CHARS:
            self._flow.append("\n\n")
            self._flush_flow()
            self._segments.append(block)
            self._flow.append("\n\n")

    def _flush_flow(self) -> None:
        self._segments.append(normalize_flow_text("".join(self._flow)))
        self._flow = []

    def text(self) -> str:
        self._flush_flow()
        text = "".join(self._segments)
        text = re.sub(r"\n(- *\n)+", "\n", text)  # bullets of list items whose text was all skipped
        return re.sub(r"\n{3,}", "\n\n", text).strip()


def html_to_text(html: str) -> str:
    extractor = _TextExtractor()
    extractor.feed(html)
    extractor.close()
    return extractor.text()


# ------------------------------------------------------------------------------------- man, pod, rst

GROFF_COMMAND = [
    "groff",
    "-t",
    "-e",
    "-Tutf8",
    "-man",  # tables and equations preprocessed, UTF-8 text
    "-P-cbou",  # plain characters: no overstriking for bold or underline, no terminal escapes
    "-rLL=78n",
    "-rcR=1",
    "-rHY=0",  # 78 columns, one continuous page, no hyphenation
]


def strip_page_header_and_footer(lines: list[str]) -> list[str]:
    """The lines between the first and last non-blank ones (the page's title line and its footer)."""
    nonblank = [index for index, line in enumerate(lines) if line.strip()]
    if len(nonblank) < 2:
        return []
    return lines[nonblank[0] + 1 : nonblank[-1]]


def man_to_text(roff: str) -> str:
    """A man page's source rendered by groff as plain text; "" for stubs and pages that only point elsewhere."""
    # A ".so" page includes another page, which is converted under its own name.
    if roff.lstrip().startswith(".so ") or len(roff) < MIN_MAN_SOURCE_CHARS:
        return ""
    # Left-aligned: justification pads lines with runs of spaces that are not in the text.
    roff = re.sub(r"^(\.TH.*)$", r"\1\n.ad l", roff, count=1, flags=re.MULTILINE)
    try:
        result = subprocess.run(
            GROFF_COMMAND, input=roff.encode(), capture_output=True, check=False, timeout=TOOL_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return ""
    lines = strip_page_header_and_footer(result.stdout.decode("utf-8", errors="replace").split("\n"))
    text = "\n".join(line.rstrip() for line in lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def pod_file_to_text(path: Path) -> str:
    # pod2text reads the file itself so that it honours the file's own =encoding.
    try:
        result = subprocess.run(
            ["pod2text", "-w", "78", str(path)], capture_output=True, check=False, timeout=TOOL_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return ""
    return result.stdout.decode("utf-8", errors="replace").strip()


# reStructuredText markup lines with no prose: licence tags, link targets, substitution definitions, and
# directives whose argument is a file, a symbol or a format rather than text.
_RST_MARKUP_LINE = re.compile(
    r"^\.\. (SPDX.*|_[^:]+:|\|[^|]+\| .*|c:namespace.*"
    r"|(include|toctree|kernel-doc|only|raw|highlight|index|contents|tabularcolumns)::.*)\s*$",
    re.MULTILINE,
)
_RST_DIRECTIVE_OPTION = re.compile(
    r"^ +:(maxdepth|numbered|glob|titlesonly|caption|internal|export|identifiers|functions|no-identifiers"
    r"|doc|man_section):.*$",
    re.MULTILINE,
)
_RST_SECTION_RULE = re.compile(r"""^[=\-~^*#+"`'.:_]{3,}\s*$""", re.MULTILINE)
# :role:`text <target>` keeps text, for the roles the kernel and Python docs use; other roles stay as written.
_RST_ROLE = re.compile(
    r":(ref|doc|c:func|c:type|c:macro|c:member|func|manpage|file|kbd|option|envvar|term|c:data|abbr|c:enum"
    r"|c:struct|c:union|c:var):`(?P<text>[^`<]*?)(?:\s*<[^>]*>)?`"
)
_RST_LITERAL = re.compile(r"``([^`]+)``")
_RST_HYPERLINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")


def rst_to_text(rst: str) -> str:
    text = _RST_MARKUP_LINE.sub("", rst)
    text = _RST_DIRECTIVE_OPTION.sub("", text)
    text = _RST_SECTION_RULE.sub("", text)
    text = _RST_ROLE.sub(r"\g<text>", text)
    text = _RST_LITERAL.sub(r"\1", text)
    text = _RST_HYPERLINK.sub(r"\1", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def plain_to_text(text: str) -> str:
    return text.replace("\r\n", "\n").strip()


# Converters of single files, by the name the file sources use.
CONVERTERS: dict[str, Callable[[Path], str]] = {
    "html": lambda path: html_to_text(read_text(path)),
    "man": lambda path: man_to_text(read_text(path)),
    "pod": pod_file_to_text,
    "rst": lambda path: rst_to_text(read_text(path)),
    "plain": lambda path: plain_to_text(read_text(path)),
}
# External programs some converters need: (program, the Debian package that provides it, what it converts).
CONVERTER_TOOLS = {"man": ("groff", "groff-base", "man pages"), "pod": ("pod2text", "perl", "pod files")}


# ------------------------------------------------------------------- info manuals, books, collections

INFO_DOC_CHARS = 20_000
INFO_PART_NAME = re.compile(r"\.info(-(?P<part>\d+))?(\.gz)?$")


def info_manuals(files: Iterable[Path]) -> dict[tuple[Path, str], list[Path]]:
    """The files of each info manual (foo.info, foo.info-1, ...), in part order."""
    manuals: dict[tuple[Path, str], list[Path]] = {}
    for path in files:
        manuals.setdefault((path.parent, INFO_PART_NAME.sub("", path.name)), []).append(path)
    for parts in manuals.values():
        parts.sort(key=lambda path: int(INFO_PART_NAME.search(path.name).group("part") or 0))
    return manuals


def info_nodes(info: str) -> list[str]:
    """The text of each node of an info file, without its header line and menus."""
    nodes = []
    for chunk in info.split("\x1f"):  # nodes are separated by ^_; other chunks are tag tables
        chunk = chunk.strip("\n")
        if not chunk.startswith("File:"):
            continue
        body = chunk.partition("\n")[2]
        body = re.sub(r"\* Menu:.*?(?=\n\n[^*\n]|\Z)", "", body, flags=re.DOTALL)
        body = re.sub(r"\n{3,}", "\n\n", body).strip()
        if len(body) > 40:  # shorter nodes are only a title
            nodes.append(body)
    return nodes


def info_docs(root: Path, package: str, folder: str) -> list[str]:
    """A package's info manuals, consecutive small nodes merged into documents of up to INFO_DOC_CHARS."""
    docs = []
    for parts in info_manuals(list_files(root / package, folder, "*.info*")).values():
        nodes = [node for part in parts for node in info_nodes(read_text(part))]
        docs += join_up_to(nodes, INFO_DOC_CHARS)
    return docs


BIBLE_BOOKS = (
    "Genesis",
    "Exodus",
    "Leviticus",
    "Numbers",
    "Deuteronomy",
    "Joshua",
    "Judges",
    "Ruth",
    "1 Samuel",
    "2 Samuel",
    "1 Kings",
    "2 Kings",
    "1 Chronicles",
    "2 Chronicles",
    "Ezra",
    "Nehemiah",
    "Esther",
    "Job",
    "Psalms",
    "Proverbs",
    "Ecclesiastes",
    "Song of Solomon",
    "Isaiah",
    "Jeremiah",
    "Lamentations",
    "Ezekiel",
    "Daniel",
    "Hosea",
    "Joel",
    "Amos",
    "Obadiah",
    "Jonah",
    "Micah",
    "Nahum",
    "Habakkuk",
    "Zephaniah",
    "Haggai",
    "Zechariah",
    "Malachi",
    "Matthew",
    "Mark",
    "Luke",
    "John",
    "Acts",
    "Romans",
    "1 Corinthians",
    "2 Corinthians",
    "Galatians",
    "Ephesians",
    "Philippians",
    "Colossians",
    "1 Thessalonians",
    "2 Thessalonians",
    "1 Timothy",
    "2 Timothy",
    "Titus",
    "Philemon",
    "Hebrews",
    "James",
    "1 Peter",
    "2 Peter",
    "1 John",
    "2 John",
    "3 John",
    "Jude",
    "Revelation",
)
BIBLE_VERSE = re.compile(r"^(?P<book>\d?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.*)$")
BIBLE_DOC_CHARS = 4000


def bible_chapters(listing: str) -> list[str]:
    """Each chapter of the `bible` program's verse listing ("Ge1:1 In the beginning ...") as a text."""
    chapters: dict[tuple[str, str], list[str]] = {}  # insertion order is the Bible's order
    for line in listing.split("\n"):
        verse = BIBLE_VERSE.match(line)
        if verse:
            key = (verse["book"], verse["chapter"])
            chapters.setdefault(key, []).append(f"{verse['verse']} {verse['text']}")
    abbreviations = list(dict.fromkeys(book for book, _ in chapters))
    # The listing abbreviates book names; spell them out when every book is there to pair them in order.
    names = dict(zip(abbreviations, BIBLE_BOOKS)) if len(abbreviations) == len(BIBLE_BOOKS) else {}
    return [
        f"{names.get(book, book)} chapter {chapter}\n\n" + "\n".join(verses)
        for (book, chapter), verses in chapters.items()
    ]


def bible_docs(root: Path) -> list[str]:
    """The King James Bible, consecutive chapters merged into documents of a few KB."""
    command = [
        str(root / "bible-kjv/usr/bin/bible"),
        "-p",
        str(root / "bible-kjv-text/usr/lib"),
        "-f",
        "-l",
        "100000",
        "Gen1:1-Rev22:21",
    ]
    listing = subprocess.run(command, capture_output=True, check=True, timeout=TOOL_TIMEOUT_S).stdout
    return join_until_over(bible_chapters(listing.decode("utf-8", errors="replace")), BIBLE_DOC_CHARS)


def fortune_docs(root: Path) -> list[str]:
    """Each fortune file's sayings, merged into documents of a few KB."""
    docs = []
    # *.dat are strfile's binary indexes.
    for path in list_files(root / "fortunes", "usr/share/games/fortunes", "*", exclude=r"\.dat$"):
        sayings = [saying.strip("\n") for saying in re.split(r"\n%\n", read_text(path)) if saying.strip()]
        docs += join_until_over(sayings, 6000)
    return docs


def jargon_docs(root: Path) -> list[str]:
    jargon = read_text(root / "jargon-text/usr/share/doc/jargon-text/jargon.txt.gz")
    return join_until_over(PARAGRAPH_BREAK.split(jargon), 8000)


# ------------------------------------------------------------------------------------------ sources


@dataclass(frozen=True)
class FileSource:
    """Files of one package, each converted into one document."""

    label: str  # the part of the corpus it counts towards in the summary
    converter: str  # a key of CONVERTERS
    package: str
    folder: str  # inside the unpacked package
    pattern: str  # glob under folder
    exclude: str | None = None  # regex searched in the installed path


@dataclass(frozen=True)
class WholeSource:
    """Documents built from whole packages: a book cut into chapters, a collection of short items."""

    label: str
    packages: tuple[str, ...]
    build: Callable[[Path], list[str]]  # the folder of unpacked packages -> documents


# Indexes, search pages, release notes and change logs are lists of names or versions, not prose; the
# kernel's translations are not English and its devicetree/netlink/ABI files are schemas.
KERNEL_DOCS = "usr/share/doc/linux-doc-6.1/Documentation"
KERNEL_EXCLUDE = r"/(translations|devicetree|netlink|ABI)/"
SPHINX_EXCLUDE = r"/(genindex.*|search|py-modindex|_static|_sources)[./]"
GNUCASH_DOCS = "usr/share/doc/gnucash-docs"
FILE_SOURCES = (
    FileSource(
        "python-docs",
        "html",
        "python3.11-doc",
        "usr/share/doc/python3.11/html",
        "**/*.html",
        r"/(genindex.*|search|py-modindex|_static|_sources|bugs|copyright|license|download)[./]",
    ),
    FileSource("linux-kernel-docs", "rst", "linux-doc-6.1", KERNEL_DOCS, "**/*.rst.gz", KERNEL_EXCLUDE),
    FileSource("linux-kernel-docs", "plain", "linux-doc-6.1", KERNEL_DOCS, "**/*.txt.gz", KERNEL_EXCLUDE),
    FileSource("man-pages", "man", "manpages", "usr/share/man", "man*/*.gz"),
    FileSource("man-pages", "man", "manpages-dev", "usr/share/man", "man*/*.gz"),
    FileSource("man-pages", "man", "postgresql-doc-15", "usr/share/postgresql/15/man", "man*/*.gz"),
    # perl-doc's man1 pages render the same pods again, and perl*delta.pod are old change logs.
    FileSource("perl-docs", "man", "perl-doc", "usr/share/man", "man3/*.gz"),
    FileSource("perl-docs", "pod", "perl-doc", "usr/share/perl", "**/*.pod", r"/perl\d+delta\.pod$"),
    FileSource("debian-docs", "html", "debian-reference-en", "usr/share/debian-reference", "*.en.html"),
    FileSource(
        "debian-docs",
        "html",
        "debian-handbook",
        "usr/share/doc/debian-handbook/html/en-US",
        "*.html",
        r"/(index|ix\d*)\.html$",
    ),
    FileSource(
        "debian-docs",
        "html",
        "debian-policy",
        "usr/share/doc/debian-policy",
        "**/*.html",
        r"/(genindex|search|index)\.html$|policy\.html$|upgrading-checklist",
    ),
    FileSource("debian-docs", "html", "debian-faq", "usr/share/doc/debian/FAQ", "*.en.html"),
    FileSource("debian-docs", "html", "maint-guide", "usr/share/doc/maint-guide/html", "*.en.html"),
    FileSource(
        "debian-docs",
        "html",
        "developers-reference",
        "usr/share/developers-reference",
        "*.html",
        r"/(genindex|search|index|developers-reference)\.html$",
    ),
    FileSource(
        "postgresql-docs",
        "html",
        "postgresql-doc-15",
        "usr/share/doc/postgresql-doc-15/html",
        "*.html",
        r"/(bookindex|index|release-\d.*)\.html$",
    ),
    FileSource(
        "django-docs",
        "html",
        "python-django-doc",
        "usr/share/doc/python-django-doc/html",
        "**/*.html",
        SPHINX_EXCLUDE + r"|/releases/\d",
    ),
    # everyday.html is a stub that points at giteveryday.html.
    FileSource("git-docs", "html", "git-doc", "usr/share/doc/git-doc", "**/*.html", r"/everyday\.html$"),
    FileSource(
        "sqlite-docs",
        "html",
        "sqlite3-doc",
        "usr/share/doc/sqlite3",
        "**/*.html",
        r"/(releaselog|c3ref|syntax|session)/"
        r"|/(changes|chronology|doclist|keyword_index|sitemap|toc|capi3ref|fileformat)\.html$",
    ),
    FileSource("gimp-help", "html", "gimp-help-en", "usr/share/gimp/2.0/help/en", "**/*.html"),
    FileSource("gnucash-docs", "html", "gnucash-docs", f"{GNUCASH_DOCS}/gnucash-guide-en", "*.html", r"/index\.html$"),
    FileSource("gnucash-docs", "html", "gnucash-docs", f"{GNUCASH_DOCS}/gnucash-help-en", "*.html", r"/index\.html$"),
    FileSource("nethack-spoilers", "plain", "nethack-spoilers", "usr/share/doc/nethack-spoilers", "**/*.txt*"),
    FileSource("nethack-spoilers", "html", "nethack-spoilers", "usr/share/doc/nethack-spoilers", "**/*.html"),
)
WHOLE_SOURCES = (
    WholeSource(
        "gnu-info-manuals",
        ("gnu-standards",),
        functools.partial(info_docs, package="gnu-standards", folder="usr/share/info"),
    ),
    WholeSource(
        "gnu-info-manuals",
        ("autoconf-doc",),
        functools.partial(info_docs, package="autoconf-doc", folder="usr/share/info"),
    ),
    WholeSource(
        "gnu-info-manuals", ("bash-doc",), functools.partial(info_docs, package="bash-doc", folder="usr/share/info")
    ),
    WholeSource(
        "gnu-info-manuals",
        ("emacs-common",),
        functools.partial(info_docs, package="emacs-common", folder="usr/share/info/emacs"),
    ),
    WholeSource("bible-kjv", ("bible-kjv", "bible-kjv-text"), bible_docs),
    WholeSource("fortunes", ("fortunes",), fortune_docs),
    WholeSource("jargon-file", ("jargon-text",), jargon_docs),
)
PACKAGES = frozenset(
    {source.package for source in FILE_SOURCES} | {package for source in WHOLE_SOURCES for package in source.packages}
)


# ------------------------------------------------------------------------------- cleaning and dedup


def ascii_letter_share(text: str) -> float:
    """The share of ASCII letters among the text's non-space characters (0 for blank text)."""
    visible = re.sub(r"\s", "", text)
    if not visible:
        return 0.0
    return sum(char.isascii() and char.isalpha() for char in visible) / len(visible)


def function_word_share(text: str) -> float:
    """The share of common English function words among the words of the text's start."""
    words = re.findall(r"[a-z]+", text[:ENGLISH_SAMPLE_CHARS].lower())
    if not words:
        return 0.0
    return sum(word in FUNCTION_WORDS for word in words) / len(words)


def is_english_prose(text: str) -> bool:
    """Long enough, mostly letters (not tables of numbers or code), and with English's function words."""
    return (
        len(text) >= MIN_DOC_CHARS
        and ascii_letter_share(text) >= MIN_LETTER_SHARE
        and function_word_share(text) > MIN_FUNCTION_WORD_SHARE
    )


def digest(text: str) -> bytes:
    return hashlib.sha1(text.encode()).digest()


def drop_seen_paragraphs(text: str, seen: set[bytes]) -> str:
    """The text without its long paragraphs already in seen; the new ones are added to seen.

    Manuals repeat themselves across pages (a chapter page and its section pages, a man page and its HTML
    twin), which exact document dedup does not catch.
    """
    kept = []
    for paragraph in PARAGRAPH_BREAK.split(text):
        if len(paragraph) >= MIN_DEDUP_PARAGRAPH_CHARS:
            paragraph_digest = digest(paragraph.strip())
            if paragraph_digest in seen:
                continue
            seen.add(paragraph_digest)
        kept.append(paragraph)
    return "\n\n".join(kept)


def split_oversized(text: str) -> list[str]:
    if len(text) <= MAX_DOC_CHARS:
        return [text]
    return join_until_over(PARAGRAPH_BREAK.split(text), MAX_DOC_CHARS // 2)


def clean_documents(docs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """(label, text) documents with repeated long paragraphs and repeated documents removed, oversized ones
    split, and pieces that are not English prose dropped."""
    seen_paragraphs: set[bytes] = set()
    seen_docs: set[bytes] = set()
    kept = []
    # Sorted so that which copy of a repeated paragraph survives does not depend on conversion order.
    for label, text in sorted(docs):
        for piece in split_oversized(drop_seen_paragraphs(text, seen_paragraphs)):
            piece = piece.strip()
            piece_digest = digest(piece)
            if piece_digest in seen_docs or not is_english_prose(piece):
                continue
            seen_docs.add(piece_digest)
            kept.append((label, piece))
    return kept


def shuffled(items: Sequence[tuple[str, str]], seed: int) -> list[tuple[str, str]]:
    order = list(items)
    random.Random(seed).shuffle(order)
    return order


def group_into_shards(lines: Iterable[bytes], shard_bytes: int) -> list[list[bytes]]:
    """Consecutive lines grouped into shards of at most shard_bytes (a longer line gets a shard of its own)."""
    shards: list[list[bytes]] = []
    size = 0
    for line in lines:
        if not shards or (size and size + len(line) > shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(line)
        size += len(line)
    return shards


def write_shards(texts: Iterable[str], out_dir: Path, shard_bytes: int) -> list[Path]:
    """Writes the texts in order as out_dir/docs_NN.jsonl, one {"text": ...} per line; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # Shards of an earlier, larger run would otherwise be picked up along with these by docs_*.jsonl.
    for stale in out_dir.glob("docs_*.jsonl"):
        stale.unlink()
    lines = ((json.dumps({"text": text}, ensure_ascii=False) + "\n").encode() for text in texts)
    paths = []
    for index, shard in enumerate(group_into_shards(lines, shard_bytes)):
        path = out_dir / f"docs_{index:02d}.jsonl"
        path.write_bytes(b"".join(shard))
        paths.append(path)
    return paths


# -------------------------------------------------------------------------------------------- build


def unpack_debs(debs_dir: Path, dest: Path) -> None:
    """Unpacks each .deb of a package on the list into dest/<package>; other .debs are ignored."""
    require_tool("dpkg-deb", "dpkg", "it unpacks the .deb files given with --debs")
    debs = sorted(debs_dir.glob("*.deb"))
    if not debs:
        sys.exit(f"error: no .deb files in {debs_dir}; download them with the apt-get command in --help")
    for deb in debs:
        field = subprocess.run(
            ["dpkg-deb", "--field", str(deb), "Package"], capture_output=True, check=False, text=True
        )
        package = field.stdout.strip()
        if field.returncode != 0 or not package:
            sys.exit(f"error: {deb} is not a readable .deb: {field.stderr.strip()}")
        if package not in PACKAGES:
            continue
        if (dest / package).exists():
            sys.exit(f"error: {debs_dir} holds two .deb files of {package}; keep one")
        print(f"unpacking {deb.name}", flush=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(dest / package)], check=True)


def require_tool(tool: str, debian_package: str, why: str) -> None:
    if shutil.which(tool) is None:
        sys.exit(f"error: {tool} not found ({why}); install it with `apt-get install {debian_package}`")


def present_packages(root: Path) -> set[str]:
    """The packages of the list unpacked under root; warns about each missing one."""
    present = {package for package in PACKAGES if (root / package).is_dir()}
    if not present:
        sys.exit(f"error: none of the packages is unpacked under {root} (expected {root}/<package>/usr/...)")
    for package in sorted(PACKAGES - present):
        warn(f"{package} is not in {root}: its documents are left out; fetch it with `apt-get download {package}`")
    return present


def check_converter_tools(sources: Iterable[FileSource]) -> None:
    """Exits naming each missing program that converts files of the given sources."""
    packages_by_converter: dict[str, set[str]] = {}
    for source in sources:
        packages_by_converter.setdefault(source.converter, set()).add(source.package)
    for converter, (tool, debian_package, files) in CONVERTER_TOOLS.items():
        if converter in packages_by_converter:
            users = ", ".join(sorted(packages_by_converter[converter]))
            require_tool(tool, debian_package, f"it converts the {files} of {users}")


def convert_file(job: tuple[str, str, Path]) -> tuple[str, str]:
    label, converter, path = job
    try:
        return label, CONVERTERS[converter](path)
    # One broken file (truncated gzip, HTML the parser gives up on) costs that file, not the whole run.
    except Exception as error:  # noqa: BLE001
        warn(f"{path}: {error!r}; skipped")
        return label, ""


def convert_files(root: Path, sources: Iterable[FileSource]) -> list[tuple[str, str]]:
    jobs = [
        (source.label, source.converter, path)
        for source in sources
        for path in list_files(root / source.package, source.folder, source.pattern, source.exclude)
    ]
    print(f"converting {len(jobs)} files", flush=True)
    with Pool(os.cpu_count() or 1) as pool:
        converted = pool.imap_unordered(convert_file, jobs, chunksize=8)
        return [(label, text) for label, text in converted if text]


def build_whole_sources(root: Path, sources: Iterable[WholeSource]) -> list[tuple[str, str]]:
    docs = []
    for source in sources:
        try:
            docs += [(source.label, text) for text in source.build(root)]
        except (OSError, subprocess.SubprocessError) as error:
            warn(f"{source.label} ({', '.join(source.packages)}): {error}; left out")
    return docs


def print_summary(docs: Sequence[tuple[str, str]], shards: Sequence[Path]) -> None:
    totals: dict[str, list[int]] = {}  # label -> [text bytes, documents]
    for label, text in docs:
        total = totals.setdefault(label, [0, 0])
        total[0] += len(text.encode())
        total[1] += 1
    text_bytes = sum(size for size, _ in totals.values())
    print(f"{len(shards)} shards, {len(docs)} documents, {text_bytes / 1e6:.1f} MB of text")
    for label, (size, count) in sorted(totals.items(), key=lambda item: -item[1][0]):
        print(f"  {label:20s} {size / 1e6:7.2f} MB {count:6d} documents")


def build_corpus(root: Path, out_dir: Path, shard_bytes: int, seed: int) -> None:
    present = present_packages(root)
    file_sources = [source for source in FILE_SOURCES if source.package in present]
    whole_sources = [source for source in WHOLE_SOURCES if present.issuperset(source.packages)]
    check_converter_tools(file_sources)
    docs = convert_files(root, file_sources) + build_whole_sources(root, whole_sources)
    docs = shuffled(clean_documents(docs), seed)
    shards = write_shards((text for _, text in docs), out_dir, shard_bytes)
    print_summary(docs, shards)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    inputs = parser.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--debs", type=Path, help="folder of the downloaded .deb files (unpacked under $TMPDIR)")
    inputs.add_argument("--unpacked", type=Path, help="folder of packages already unpacked as DIR/<package>")
    parser.add_argument("--out", type=Path, required=True, help="folder for the docs_NN.jsonl shards")
    parser.add_argument("--shard-mb", type=float, default=25, help="shard size limit in MiB (default 25)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document order (default 0)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    shard_bytes = int(args.shard_mb * 1024 * 1024)
    if args.unpacked:
        build_corpus(args.unpacked, args.out, shard_bytes, args.seed)
        return
    with tempfile.TemporaryDirectory(prefix="doc-corpus-") as scratch:
        unpack_debs(args.debs, Path(scratch))
        build_corpus(Path(scratch), args.out, shard_bytes, args.seed)


if __name__ == "__main__":
    main()
