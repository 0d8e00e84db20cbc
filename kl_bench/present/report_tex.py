"""The report's LaTeX renderer: table.tex, the paper table as booktabs tables a paper can include as
they are (:func:`table_tex`), every number as the tables show it (:func:`tex_number`)."""
from __future__ import annotations

from ..foundation.formatting import sig
from .report_document import ReportDocument, kl_head


_TEX = {"\\": r"\textbackslash{}", "_": r"\_", "%": r"\%", "&": r"\&", "#": r"\#", "$": r"\$", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "²": r"\textsuperscript{2}",
        "σ": r"$\sigma$", "μ": r"$\mu$", "λ": r"$\lambda$", "‖": r"$\|$", "−": "$-$", "·": r"$\cdot$",
        "∞": r"$\infty$", "–": "--", "—": "---", "×": r"$\times$", "≤": r"$\le$", "≥": r"$\ge$", "±": r"$\pm$",
        "†": r"$^\dagger$", "≈": r"$\approx$"}


def tex(text: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in str(text))


def tex_number(s: str) -> str:
    """A number as the tables show it, in LaTeX: 1.2e-5 as 1.2×10⁻⁵, a percentage's % escaped, a minus sign
    as math's minus ($-$), never a text hyphen."""
    if s.endswith("%"):
        return tex_number(s[:-1]) + r"\%"
    if s.lstrip("+-−") in ("inf", "∞"):
        return "$" + s.replace("−", "-").replace("inf", r"\infty").replace("∞", r"\infty") + "$"
    if "e" in s and s not in ("—",):
        mant, exp = s.split("e")
        return f"${mant.replace('−', '-')}\\times 10^{{{int(exp)}}}$"
    if s[:1] in "-−" and len(s) > 1:         # a real minus, not a text hyphen
        return "$-$" + tex(s[1:])
    return tex(s)


TEX_ROWS_PER_TABLE = 40        # body rows of one table float: one page of an article at \small


def _tex_families(cases, rows) -> list[list[tuple]]:
    """The cases in groups of one kind each (in order), cut so that no table has more than
    TEX_ROWS_PER_TABLE body rows: [[(case, [(label, 4 cells)])]]."""
    groups: list[list[tuple]] = []
    kind, size = None, 0
    for i, case in enumerate(cases):
        body = [(label, cells[i]) for label, cells in rows if any(cells[i])]
        if not groups or case[3] != kind or size + len(body) + 1 > TEX_ROWS_PER_TABLE:
            groups.append([])
            kind, size = case[3], 0
        groups[-1].append((case, body))
        size += len(body) + 1
    return groups


def table_tex(cases, rows, caption: str, provenance: str = "") -> str:
    """The paper table as LaTeX a paper can include as it is: one booktabs table per family of cases (same
    kind, at most TEX_ROWS_PER_TABLE rows), five columns (estimator, bias/true ± SE, exact, std/true ± SE,
    exact), a case's title as a row above its estimators, a short caption; no \\resizebox, so the type
    stays the document's. ``provenance`` (draws, seeds, devices) goes in a comment at the top."""
    lines = [r"% kl-bench paper tables; need \usepackage{booktabs}"]
    lines += [f"% {line}" for line in provenance.splitlines() if line]
    groups = _tex_families(cases, rows)
    for g, group in enumerate(groups):
        part = f" ({g + 1} of {len(groups)})" if len(groups) > 1 else ""
        lines += [r"\begin{table}[t]", r"\centering", r"\small", r"\begin{tabular}{lrrrr}", r"\toprule",
                  r"estimator & bias/true $\pm$ SE & exact & std/true $\pm$ SE & exact \\"]
        for (key, title, true, _), body in group:
            rel = r"$\approx$" if title.endswith(" ≈") else "$=$"
            head = tex(kl_head(title, true)[1]) if true == 0 else f"KL {rel} {tex_number(sig(true))}"
            lines += [r"\midrule", rf"\multicolumn{{5}}{{l}}{{\emph{{{tex(kl_head(title, true)[0])}}} "
                      rf"({head})}} \\"]
            lines += [tex(label) + " & " + " & ".join(tex_cell(c) for c in cells) + r" \\" for label, cells in body]
        lines += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{tex(caption)}{part}}}",
                  rf"\label{{tab:kl-bench-{g + 1}}}", r"\end{table}", ""]
    return "\n".join(lines)


def tex_cell(cell: str) -> str:
    """A table cell in LaTeX: "v ± se†" with each number as tex_number shows it."""
    mark = "$^\\dagger$" if cell.endswith("†") else ""
    parts = cell.removesuffix("†").split(" ± ")
    return " $\\pm$ ".join(tex_number(p) for p in parts) + mark if cell else ""


def render(doc: ReportDocument) -> dict[str, bytes]:
    """{"table.tex": the paper table in LaTeX, its provenance in a comment at the top}."""
    return {"table.tex": table_tex(doc.cases, doc.rows, doc.short_caption, doc.provenance).encode()}
