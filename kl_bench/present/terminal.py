"""Tables and prose fitted to the terminal. At a terminal every table fits its width or is stacked
(:func:`stacked`: the key columns repeated over parts that each fit), and prose wraps at the width
(:func:`prose`); a file or a pipe gets every table at its natural width and every sentence on one line,
so that grep and diff see whole lines (:func:`show`)."""
from __future__ import annotations

import itertools
import re
import textwrap

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text


_TRAILING = re.compile(r"[ \t]+((?:\x1b\[[0-9;]*m)*)$")     # spaces before any closing style codes


def show(console: Console, table, wide: bool = False, keys: int = 1, fold: bool = False, together: int = 1,
         group: int = 0) -> None:
    """Print a table: boxed for a terminal, and fitted to its width: a table wider than the terminal is
    :func:`stacked` (its first ``keys`` columns repeated in each part), never cut; with ``fold``, rich
    wraps its wrappable columns instead (their cells fold onto a second line), when that fits. Plain text
    when stdout is not a terminal (a file, a pipe, CI): no box-drawing, one space between columns, nothing
    around, at the table's natural width. Lines never end in spaces (rich pads every line to the table's
    width). ``wide``: at the table's natural width, cells whole, even where lines are longer than the
    terminal."""
    if not table.columns:       # a title alone (a sweep's grid too large for the table): rich prints nothing
        prose(console, str(table.title or ""))
        return
    width = console.width
    title, caption = table.title, table.caption
    if not console.is_terminal:
        _plain(table)
    if wide:                # rich never prints wider than the console: widen it for this table alone
        console.width = max(natural_width(console, table), width)
    try:
        text = _captured(console, _parts(console, table, wide, keys, fold, together, group), title, caption)
    finally:
        console.width = width
    console.file.write(text)
    console.file.flush()


def _plain(table: Table) -> None:
    """A table for a pipe: no box, one space between columns, nothing around; title and caption whole, on lines
    of their own (:func:`_captured` prints them; rich would wrap them)."""
    table.box = None
    table.padding = (0, 1)
    table.pad_edge = False
    table.show_edge = False
    table.title = table.caption = None


def _parts(console: Console, table: Table, wide: bool, keys: int, fold: bool, together: int, group: int) -> list:
    """What :func:`show` prints: the table whole (a pipe, ``wide``), its groups, or the table fitted to the terminal."""
    if not console.is_terminal or wide:
        return [table]
    if group and not fits(console, table):
        return grouped(table, group)
    return _fitted(console, table, keys, fold, together)


def _captured(console: Console, parts: list, title, caption) -> str:
    """The parts as printed, each line without its trailing spaces (rich pads every line to the table's width);
    ``title`` and ``caption`` on lines of their own in a pipe."""
    plain = not console.is_terminal
    with console.capture() as cap:
        if title and plain:
            console.print(title, soft_wrap=True)
        for i, part in enumerate(parts):
            if i and isinstance(part, Table) and part.title:      # a stacked part (grouped ones run on)
                console.print()
            console.print(part)
        if caption and plain:
            console.print(caption, soft_wrap=True)
    return "".join(_TRAILING.sub(r"\1", line) + "\n" for line in cap.get().splitlines())


def fits(console: Console, table) -> bool:
    """Whether a table's natural width fits the console (a pipe is 400 columns wide: see cli)."""
    return natural_width(console, table) <= console.width


def natural_width(console: Console, table) -> int:
    """The columns a table takes when nothing constrains it (rich caps a measure at the console's width)."""
    return console.measure(table, options=console.options.update_width(100_000)).maximum


def _fitted(console: Console, table: Table, keys: int, fold: bool, together: int = 1) -> list[Table]:
    """The table as it fits a terminal: whole, or folded (``fold``), or without its box, or stacked."""
    if fits(console, table) or (fold and _folds(console, table)):
        return [table]
    table.box, table.padding, table.show_edge = None, (0, 1), False     # without its box first
    return [table] if fits(console, table) else stacked(console, table, keys, together)


def _folds(console: Console, table: Table) -> bool:
    """Whether rich fits the table to the console by wrapping only its wrappable columns: the columns
    that do not wrap take their natural width, the others at least their narrowest (a word's) width."""
    return console.measure(table, options=console.options.update_width(100_000)).minimum <= console.width


def stacked(console: Console, table: Table, keys: int = 1, together: int = 1) -> list[Table]:
    """A table too wide for the console as several tables that each fit: the first ``keys`` columns (what
    names a row) in every part, the other columns in order, as many to a part as fit; every cell is kept.
    The title goes on the first part (with "1/n" on each part), the caption on the last. A key part that
    alone is too wide gets one other column a part, and rich folds its cells rather than cut them.
    ``together``: runs of that many columns stay in one part (a case's columns side by side: the run's first
    header names the case, so a part never shows a case's second column without its name)."""
    cols = list(table.columns)
    key, rest = cols[:keys], cols[keys:]
    runs = [rest[i:i + together] for i in range(0, len(rest), max(together, 1))]
    groups: list[list] = []
    for run in runs:
        if groups and fits(console, _part(table, key + groups[-1] + run)):
            groups[-1] += run
        else:
            groups.append(list(run))
    parts = []
    for i, group in enumerate(groups or [[]]):
        part = _part(table, key + group)
        title = table.title if isinstance(table.title, str) else ""
        part.title = f"{title} ({i + 1}/{len(groups)})" if i == 0 and title else f"({i + 1}/{len(groups)})"
        part.title_justify = "left"
        part.caption = table.caption if i == len(groups) - 1 else None
        parts.append(part)
    return parts


def _part(table: Table, cols: list) -> Table:
    """A table of some of ``table``'s columns, with its rows, style and box (title and caption unset)."""
    t = Table(box=table.box, show_edge=table.show_edge, pad_edge=table.pad_edge, padding=table.padding,
              show_header=table.show_header, title_justify=table.title_justify, caption_justify=table.caption_justify)
    for c in cols:
        t.add_column(c.header, justify=c.justify, no_wrap=c.no_wrap, overflow="fold", min_width=c.min_width)
    for cells in zip(*(list(c.cells) for c in cols)):
        t.add_row(*cells)
    return t


def grouped(table: Table, group: int) -> list:
    """A table whose first ``group`` columns are constant over runs of rows (a case, its sampler) as those runs
    one after another: the header once, then each run under a line naming it (its ``group`` cells), its rows
    without those columns, every column at one width throughout so that the runs line up. A case is never
    split, and its name is printed whole on a line of its own rather than folded into a narrow column."""
    cols = list(table.columns)
    rest = cols[group:]
    widths = [max(Text.from_markup(str(x)).cell_len for x in [c.header, *c.cells]) for c in rest]

    def part(rows, header: bool) -> Table:
        t = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, show_header=header)
        for c, w in zip(rest, widths):
            t.add_column(c.header, justify=c.justify, width=w, no_wrap=True)
        for row in rows:
            t.add_row(*row[group:])
        return t
    rows = list(zip(*(list(c.cells) for c in cols)))
    title = table.title if isinstance(table.title, str) else ""
    parts: list = [Text.from_markup(title)] if title else []
    parts.append(part([], True))
    for key, members in itertools.groupby(rows, key=lambda r: r[:group]):
        parts.append(Text.from_markup("[bold]" + "  ".join(str(k) for k in key if str(k)) + "[/]"))
        parts.append(part(list(members), False))
    if table.caption:
        parts.append(Text.from_markup(str(table.caption)))
    return parts


def prose(console: Console, text: str, indent: str = "  ", markup: bool = False) -> None:
    """A sentence or a paragraph: at a terminal wrapped on words at its width, lines after the first
    indented by ``indent`` (so that a wrapped line reads as a continuation); to a file or a pipe each line
    whole, never wrapped (grep finds a sentence on one line). ``text``'s own line breaks are kept."""
    if not console.is_terminal:
        console.print(text, markup=markup, soft_wrap=True, highlight=False)
        return
    width = max(console.width, 20)
    lines = []
    for line in text.split("\n"):
        lead = line[:len(line) - len(line.lstrip(" "))]
        lines += textwrap.wrap(line, width=width, subsequent_indent=lead + indent, break_on_hyphens=False,
                               drop_whitespace=True) or [""]
    # textwrap counts characters; a wide character (CJK in a case name) takes two cells: cut such lines
    lines = [piece for line in lines for piece in _cells_within(line, width)]
    console.print("\n".join(lines), markup=markup, soft_wrap=True, highlight=False)


def _cells_within(line: str, width: int) -> list[str]:
    if cell_len(line) <= width:
        return [line]
    out, cur = [], ""
    for ch in line:
        if cell_len(cur + ch) > width:
            out.append(cur)
            cur = ""
        cur += ch
    return out + [cur]
