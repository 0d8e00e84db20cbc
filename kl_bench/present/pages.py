"""What every report page shares: figure files (PNG for the pages, PDF and SVG for a paper, the same bytes
each time), and self-contained HTML (one style sheet, escaped text, figures embedded as data URIs, tables
that scroll in their own box). The run report (kl_bench.present.report), the training report and the audit report
build their pages from these, so that they look alike and open on their own.

Foundation layer: matplotlib is imported only inside :func:`figure_bytes`."""
from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import io
import warnings
from collections import Counter
from typing import Iterable, Iterator

from ..foundation.errors import SpecError

ALL_FORMATS = ("png", "pdf", "svg")     # PNG for the pages; PDF and SVG for a paper (vector)
DEFAULT_FORMATS = ("png",)
# No creation dates and a fixed SVG id salt: the same results give the same bytes.
_METADATA = {"png": {"Software": None}, "pdf": {"CreationDate": None, "Producer": None}, "svg": {"Date": None}}


def parse_formats(text: str, key: str = "--formats") -> tuple[str, ...]:
    """'png,pdf,svg' → ('png', 'pdf', 'svg'). PNG is always among them (the pages show it); an unknown
    format is a one-line SpecError naming ``key``."""
    given = [f.strip().lower().lstrip(".") for f in str(text).split(",") if f.strip()]
    bad = [f for f in given if f not in ALL_FORMATS]
    if bad:
        raise SpecError(f"unknown figure format '{bad[0]}' (use a comma-separated list of {', '.join(ALL_FORMATS)})",
                        key=key)
    return tuple(dict.fromkeys(["png", *given]))


def figure_bytes(fig, formats=DEFAULT_FORMATS) -> dict[str, bytes]:
    """{format: the figure saved in it} (PNG at 110 dpi), the same bytes for the same figure; then the
    figure is closed."""
    import matplotlib
    import matplotlib.pyplot as plt
    out = {}
    with matplotlib.rc_context({"svg.hashsalt": "kl-bench", "pdf.compression": 6}), quiet_drawing():
        for fmt in formats:
            buf = io.BytesIO()
            fig.savefig(buf, format=fmt, dpi=110, metadata=_METADATA.get(fmt))
            out[fmt] = buf.getvalue()
    plt.close(fig)
    return out


# What matplotlib warns of while it lays out and renders a figure whose text comes from the data: a glyph
# the font lacks (a case named 日本語 or with an emoji: drawn as a box, one warning per glyph and format) and
# a constrained layout it cannot fit (a very long label). The figure is still written and the page names
# the case in full; two dozen warnings on stderr would bury the report's one line.
_DRAWING_WARNINGS = (r"Glyph \d+ .*missing from", r"[Cc]onstrained_?layout not applied", r"[Tt]ight_?layout not applied",
                     r"Matplotlib currently does not support .* natively")


@contextlib.contextmanager
def quiet_drawing() -> Iterator[None]:
    """A context in which matplotlib's warnings about text from the data (_DRAWING_WARNINGS) are not shown;
    every other warning still is."""
    with warnings.catch_warnings():
        for message in _DRAWING_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


# ----------------------------------------------------------------------------- file names
STEM_CHARS = 60           # a name's slug is cut here: with a prefix and a hash, a file name stays far below 255 bytes


def _slug(text: str) -> str:
    keep = "".join(ch if (ch.isascii() and ch.isalnum()) or ch in "-_." else "-" for ch in str(text))
    return "-".join(filter(None, keep.split("-")))[:STEM_CHARS].strip(".") or "case"


def name_hash(text: str) -> str:
    """8 hex digits of the sha256 of ``text`` (UTF-8): the same in every run, process and platform."""
    return hashlib.sha256(str(text).encode("utf-8", "surrogatepass")).hexdigest()[:8]


def file_stems(names: Iterable[str]) -> dict[str, str]:
    """{name: its file-name stem}: its slug (ASCII letters, digits, - _ .; at most STEM_CHARS: the name itself
    where it is one) where no other name's slug equals it ignoring case; else the slug, a dash and a hash of
    the exact name. So ``a|b``, ``a,b`` and ``a-b`` get three files, as do 日本語 and κλ, two long names
    that share their first characters, and Noise and noise (one file on a case-insensitive file system, as
    macOS and Windows have by default); a name whose slug meets no other keeps a short, readable stem (a
    progress line shows it). The same names give the same stems."""
    names = [str(n) for n in dict.fromkeys(names)]
    slugs = {n: _slug(n) for n in names}
    count = Counter(s.lower() for s in slugs.values())
    return {n: s if count[s.lower()] == 1 else f"{s}-{name_hash(n)}" for n, s in slugs.items()}


def unique_files(files: list[str], keys: list[str]) -> list[str]:
    """``files`` (names ending in .png) with every name that is shared ignoring case made unique by a hash of
    its ``key`` (what the figure shows, e.g. its caption): file names composed of several parts (a run's
    prefix, a case, an aggregate) can meet even where each part is unique."""
    count = Counter(f.lower() for f in files)
    return [f if count[f.lower()] == 1 else f"{f.removesuffix('.png')}-{name_hash(k)}.png" for f, k in zip(files, keys)]


# ----------------------------------------------------------------------------- Markdown
_MD_SPECIAL = "\\`|[]"


def md_text(text) -> str:
    """Text from the data (a case name, a row label) for Markdown: a backslash before each character that
    would end a table cell (|), open a code span or a link (` [ ]: an image's alt text ends at ]) or escape (\\), so
    that the name is shown as it is and a table keeps its columns; a line break (none in names) as a space."""
    text = " ".join(str(text).splitlines())
    return "".join("\\" + ch if ch in _MD_SPECIAL else ch for ch in text)


def figure_files(stem: str, by_format: dict[str, bytes]) -> dict[str, bytes]:
    """{figures/<stem>.<format>: bytes} of one figure."""
    return {f"figures/{stem}.{fmt}": data for fmt, data in by_format.items()}


def vector_links(stem: str, by_format: dict[str, bytes]) -> str:
    """'Vector: [PDF](figures/x.pdf), [SVG](figures/x.svg)' for Markdown, or '' when there are none."""
    vectors = [f"[{fmt.upper()}](figures/{stem}.{fmt})" for fmt in by_format if fmt != "png"]
    return f"Vector: {', '.join(vectors)}" if vectors else ""


# ----------------------------------------------------------------------------- HTML
CSS = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;line-height:1.4}"
       ".scroll{overflow-x:auto;max-width:100%;margin:1em 0}"
       "table{border-collapse:collapse;font-size:0.85em}"
       "td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right;white-space:nowrap}"
       "td:first-child,th:first-child{text-align:left}"
       "table.rows td:nth-child(-n+3),table.rows th:nth-child(-n+3){text-align:left}"
       "table.diffs td:nth-child(-n+4),table.diffs th:nth-child(-n+4){text-align:left}"
       "code{font-family:ui-monospace,monospace;font-size:0.9em;background:#f4f4f4;padding:0 3px;border-radius:3px}"
       "img{max-width:100%;height:auto;border:1px solid #eee}figure{margin:1.5em 0}"
       "figcaption{font-size:0.9em;color:#333}p.caption{font-style:italic;max-width:100%}"
       "ul.advice li{margin:0.3em 0}")


def html_text(text) -> str:
    """Text from the data (names, descriptions) for HTML: escaped, backticks as entities, so that none
    is read as markup and the page's source holds no literal backtick."""
    return html.escape(str(text)).replace("`", "&#96;")


def html_inline(text: str) -> str:
    """Prose with Markdown-style `code` spans (as in report.md) as HTML: the spans become <code>."""
    parts = str(text).split("`")
    if len(parts) % 2 == 0:          # an unmatched backtick: no code spans, only text
        return html_text(text)
    return "".join(f"<code>{html_text(p)}</code>" if k % 2 else html_text(p) for k, p in enumerate(parts))


def scroll(table_html: str) -> str:
    """A table in its own horizontally scrolling box: a wide table never widens the page."""
    return f"<div class='scroll'>{table_html}</div>"


def table_html(header: list[str], rows: list[list[str]], classes: str = "rows") -> str:
    """A table of strings (escaped: data, never markup) in its scrolling box."""
    head = "<tr>" + "".join(f"<th>{html_text(h)}</th>" for h in header) + "</tr>"
    body = ["<tr>" + "".join(f"<td>{html_text(c)}</td>" for c in row) + "</tr>" for row in rows]
    return scroll(f"<table class='{classes}'>" + "\n".join([head, *body]) + "</table>")


def table_md(header: list[str], rows: list[list[str]], numeric: list[bool] | None = None) -> str:
    """The same table in Markdown (``numeric``: columns aligned right)."""
    numeric = numeric or [False] * len(header)
    lines = ["| " + " | ".join(map(md_text, header)) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(map(md_text, row)) + " |" for row in rows]
    return "\n".join(lines)


def figure_html(name: str, caption: str, png: bytes) -> str:
    """A figure embedded as a data URI, with its caption and the file it was written to."""
    b64 = base64.b64encode(png).decode()
    return (f"<figure id='{html_text(name)}'><img src='data:image/png;base64,{b64}' alt='figures/{html_text(name)}'>"
            f"<figcaption>{html_inline(caption)} (<code>figures/{html_text(name)}</code>)</figcaption></figure>")


def page(title: str, parts: list[str]) -> str:
    """A self-contained HTML page: the style sheet inline, ``parts`` (HTML) in order."""
    head = ("<!doctype html><html><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{html_text(title)}</title><style>{CSS}</style></head><body>")
    return "\n".join([head, f"<h1>{html_text(title)}</h1>", *parts, "</body></html>"])
