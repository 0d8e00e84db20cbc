"""A spec's ``[[sweep]]`` tables expanded into cases: each swept base case replaced by one case per
combination of its values (lists, or geomspace/linspace grids), named "<base>[key=value;...]"."""
from __future__ import annotations

import copy
import itertools
import math
from typing import Any, Callable

from ..foundation.typed_toml import convert, typename
from ..foundation.formatting import fmt_count
from ..foundation.errors import SpecError
from ..foundation.registry import did_you_mean

# A sweep names a base case and maps case keys (dotted for nested tables: "p.noise",
# "sampler.temperature") to values: a list, {geomspace = [a, b], num = n} or {linspace = [a, b], num = n}.
# The base case is replaced by one case per combination of values (the cartesian product of the table's
# keys), named "<base>[key=value,...]"; several sweeps of one base add their cases together.
MAX_SWEEP_CASES = 1024      # cases a spec's sweeps may make: a grid beyond it is almost surely a typo
_GRID_DIGITS = 4            # geomspace/linspace inner values are rounded to this many significant digits,
                            # so case names stay short and every value is written exactly (the ends: as written)


def _grid_values(v: Any, where: str, file: str) -> list[Any]:
    def err(msg: str) -> SpecError:
        return SpecError(msg, file=file, key=where)
    if isinstance(v, list):
        return _listed_values(v, err)
    if not isinstance(v, dict):
        raise err(f"must be a list of values, or {{ geomspace = [a, b], num = n }} / {{ linspace = [a, b], num = n }}; "
                  f"got {typename(v)}")
    out = _grid_points(*_grid_spec(v, err))        # finite: finite ends (convert), inner values within them
    if len(set(out)) < len(out):            # [1, 1.0001] in 5 steps: all 1 once rounded (names say the value)
        raise err(f"its {len(out)} values are not all different once the inner ones are rounded to {_GRID_DIGITS} "
                  f"significant digits ({', '.join(dict.fromkeys(map(_fmt_value, out)))}): give ends further apart, "
                  "or fewer values")
    return out


def _grid_points(grid: str, a: float, b: float, num: int) -> list[float]:
    """``num`` values from ``a`` to ``b``, evenly spaced (linspace) or in ratio (geomspace). The ends are
    ``a`` and ``b`` exactly as written (``a + (b − a)`` had made [1.1, 1e-20]'s last value 0.0); the inner
    values are a + (b − a)·i/(num − 1) (of the logs for geomspace; (1 − i/(num − 1))·a + b·i/(num − 1) where
    b − a overflows, as for [−1e308, 1e308]), rounded to :data:`_GRID_DIGITS` significant digits and kept
    within [a, b]."""
    if num == 1:
        return [a]
    lo, hi = min(a, b), max(a, b)
    steps = range(1, num - 1)
    if grid == "geomspace":
        la, lb = math.log(a), math.log(b)
        inner = [math.exp(la + (lb - la) * i / (num - 1)) for i in steps]
    elif math.isfinite(b - a):
        inner = [a + (b - a) * i / (num - 1) for i in steps]
    else:
        inner = [(1 - i / (num - 1)) * a + b * i / (num - 1) for i in steps]
    return [a, *(min(max(float(f"{x:.{_GRID_DIGITS}g}"), lo), hi) for x in inner), b]


def _listed_values(v: list, err: Callable[[str], SpecError]) -> list[Any]:
    """A sweep's list of values, checked: plain values, none twice (as the case names write them)."""
    if not v:
        raise err("must list at least one value")
    if any(isinstance(x, (dict, list)) for x in v):
        raise err("must list plain values (numbers, strings, booleans)")
    twice = next((x for i, x in enumerate(v) if _fmt_value(x) in map(_fmt_value, v[:i])), None)
    if twice is not None:
        raise err(f"lists the value {_fmt_value(twice)} twice")
    return list(v)


def _grid_spec(v: dict, err: Callable[[str], SpecError]) -> tuple[str, float, float, int]:
    """(geomspace or linspace, first, last, num) of a grid table, checked."""
    kind = _grid_kind(v, err)
    ends = v[kind]
    if not isinstance(ends, list) or len(ends) != 2 or not all(_is_number(x) for x in ends):
        raise err(f"{kind} must be [first, last] numbers")
    num = _grid_num(v.get("num"), err)
    a, b = (convert(x, "float", lambda m: err(f"{kind}: {m}")) for x in ends)
    if kind == "geomspace" and not (a > 0 and b > 0):
        raise err("geomspace needs positive ends")
    return kind, a, b, num


def _grid_kind(v: dict, err: Callable[[str], SpecError]) -> str:
    """The grid table's one of geomspace or linspace (its keys checked)."""
    kinds = [k for k in ("geomspace", "linspace") if k in v]
    unknown = [k for k in v if k not in ("geomspace", "linspace", "num")]
    if unknown:
        raise err(f"unknown key '{unknown[0]}'{did_you_mean(unknown[0], ['geomspace', 'linspace', 'num'])}")
    if len(kinds) != 1:
        raise err("needs exactly one of geomspace or linspace")
    return kinds[0]


def _grid_num(num: Any, err: Callable[[str], SpecError]) -> int:
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise err(f"num must be an integer ≥ 1, got {num!r}")
    if num > MAX_SWEEP_CASES:        # refused before a single value is made: a grid this size is a typo
        raise err(f"num = {fmt_count(num)} makes more than {MAX_SWEEP_CASES:,} cases: sweep fewer values")
    return num


def _is_number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        short = f"{v:g}"
        return short if float(short) == v else repr(v)
    return str(v).lower() if isinstance(v, bool) else str(v)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"p": {"noise": [..]}} → {"p.noise": [..]} (TOML's unquoted dotted keys), stopping at grid helpers."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and not ({"geomspace", "linspace", "num"} & set(v)):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def expand_sweeps(raw_cases: list, raw_sweeps: Any, file: str) -> tuple[list[tuple[Any, Any]], dict]:
    """The [[case]] list with every swept base case replaced by its cases: [(raw case, origin)], origin
    (sweep index, {key: value}) or None; and {case name: {key: value}} of the swept cases."""
    if raw_sweeps is None:
        return [(c, None) for c in raw_cases], {}
    if not isinstance(raw_sweeps, list):
        raise SpecError(f"must be an array of tables ([[sweep]]), got {typename(raw_sweeps)}", file=file, key="sweep")
    by_name = {c.get("name"): c for c in raw_cases if isinstance(c, dict)}
    made: dict[str, list[tuple[Any, Any]]] = {}
    total = 0
    for i, sw in enumerate(raw_sweeps):
        where = f"sweep[{i + 1}]"
        base_name, values = _sweep_values(sw, where, by_name, file)
        total += math.prod(len(v) for v in values.values())
        if total > MAX_SWEEP_CASES:
            raise SpecError(f"the sweeps make {total:,}+ cases, more than {MAX_SWEEP_CASES:,}: sweep fewer values",
                            file=file, key=where)
        for combo in itertools.product(*values.values()):
            assigned = dict(zip(values, combo))
            raw = _swept_case(by_name[base_name], base_name, assigned, where, file)
            made.setdefault(base_name, []).append((raw, (i, assigned)))
    return _in_case_order(raw_cases, made, file)


def _sweep_values(sw: Any, where: str, by_name: dict, file: str) -> tuple[str, dict[str, list[Any]]]:
    """(base case name, {dotted key: its values}) of one [[sweep]] table, checked."""
    if not isinstance(sw, dict):
        raise SpecError(f"must be a table, got {typename(sw)}", file=file, key=where)
    base_name = sw.get("case")
    if not isinstance(base_name, str):
        raise SpecError("needs case = \"<name of a [[case]]>\"", file=file, key=f"{where}.case")
    if base_name not in by_name:
        raise SpecError(f"no [[case]] named '{base_name}'{did_you_mean(base_name, [n for n in by_name if n])}",
                        file=file, key=f"{where}.case")
    grid = _flatten({k: v for k, v in sw.items() if k != "case"})
    if not grid:
        raise SpecError("sweeps no key: add e.g. noise = [0.1, 0.3]", file=file, key=where)
    for key in grid:
        if key in ("name", "kind"):
            raise SpecError("cannot be swept (it names the case and its kind)", file=file, key=f"{where}.{key}")
    return base_name, {k: _grid_values(v, f"{where}.{k}", file) for k, v in grid.items()}


def _swept_case(base: dict, base_name: str, assigned: dict[str, Any], where: str, file: str) -> dict:
    """A copy of the base case with the swept (dotted) keys set, named "<base>[key=value;...]"."""
    raw = copy.deepcopy(base)
    for key, v in assigned.items():
        node = raw
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SpecError(f"'{part}' of case '{base_name}' is not a table", file=file, key=f"{where}.{key}")
        node[leaf] = v
    raw["name"] = f"{base_name}[" + ";".join(f"{k}={_fmt_value(v)}" for k, v in assigned.items()) + "]"
    return raw


def _in_case_order(raw_cases: list, made: dict[str, list[tuple[Any, Any]]],
                   file: str) -> tuple[list[tuple[Any, Any]], dict]:
    """Every swept base case replaced, in place, by its cases; a case name made twice is refused."""
    out, swept, seen = [], {}, set()
    for c in raw_cases:
        name = c.get("name") if isinstance(c, dict) else None
        for raw, origin in made.get(name, [(c, None)]) if name in made else [(c, None)]:
            if origin is not None:
                if raw["name"] in seen:
                    raise SpecError(f"makes the case '{raw['name']}' twice (two sweeps over the same values?)",
                                    file=file, key=f"sweep[{origin[0] + 1}]")
                seen.add(raw["name"])
                swept[raw["name"]] = origin[1]
            out.append((raw, origin))
    return out, swept
