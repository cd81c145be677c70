"""Compare two snapshots of ``benchmarks/snapshot_outputs.py`` (issue 17: numbers equal before and after to 1e-6).

    .venv/bin/python benchmarks/compare_snapshots.py before.json after.json [--rel 1e-6] [--abs 1e-6]

Walks both files recursively. Two numbers are equal when ``|a - b| <= max(rel * max(|a|, |b|), abs)``
(``math.isclose``); everything else (strings, booleans, None, the non-finite markers "nan" / "inf", list
lengths, keys) must be identical. A key or list element present on one side only is a difference. Prints
every difference with its path and exits 1 if there is any, else prints a one-line summary and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _path(parts: list) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f"[{json.dumps(p)}]"
    return out


def _short(x, n: int = 120) -> str:
    s = json.dumps(x, sort_keys=True)
    return s if len(s) <= n else s[: n - 3] + "..."


def compare(a, b, rel: float = 1e-6, abs_: float = 1e-6, path: list | None = None, diffs: list | None = None,
            stats: dict | None = None) -> list[str]:
    """Every difference between ``a`` and ``b`` as a line ``PATH: ...``."""
    path = [] if path is None else path
    diffs = [] if diffs is None else diffs
    stats = {"numbers": 0, "max_abs": 0.0, "max_rel": 0.0} if stats is None else stats
    where = _path(path)
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() - b.keys():
            diffs.append(f"{_path([*path, k])}: only in A: {_short(a[k])}")
        for k in b.keys() - a.keys():
            diffs.append(f"{_path([*path, k])}: only in B: {_short(b[k])}")
        for k in sorted(a.keys() & b.keys()):
            compare(a[k], b[k], rel, abs_, [*path, k], diffs, stats)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            diffs.append(f"{where}: length {len(a)} in A, {len(b)} in B")
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, rel, abs_, [*path, i], diffs, stats)
        for i in range(len(b), len(a)):
            diffs.append(f"{_path([*path, i])}: only in A: {_short(a[i])}")
        for i in range(len(a), len(b)):
            diffs.append(f"{_path([*path, i])}: only in B: {_short(b[i])}")
    elif _is_number(a) and _is_number(b):
        stats["numbers"] += 1
        d = abs(a - b)
        scale = max(abs(a), abs(b))
        stats["max_abs"] = max(stats["max_abs"], d)
        if scale > 0:
            stats["max_rel"] = max(stats["max_rel"], d / scale)
        if not math.isclose(a, b, rel_tol=rel, abs_tol=abs_):
            diffs.append(f"{where}: {a!r} in A, {b!r} in B (abs {d:.3g}, rel {d / scale:.3g})")
    elif type(a) is not type(b) or a != b:
        diffs.append(f"{where}: {_short(a)} in A, {_short(b)} in B")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="snapshot A (before)")
    ap.add_argument("b", help="snapshot B (after)")
    ap.add_argument("--rel", type=float, default=1e-6, help="relative tolerance (default 1e-6)")
    ap.add_argument("--abs", dest="abs_", type=float, default=1e-6, help="absolute tolerance (default 1e-6)")
    args = ap.parse_args(argv)
    with open(args.a) as f:
        a = json.load(f)
    with open(args.b) as f:
        b = json.load(f)
    stats = {"numbers": 0, "max_abs": 0.0, "max_rel": 0.0}
    diffs = compare(a, b, args.rel, args.abs_, stats=stats)
    for line in diffs:
        print(line)
    n_entries = len(a.keys() | b.keys()) if isinstance(a, dict) and isinstance(b, dict) else 1
    summary = (f"{len(diffs)} difference(s); {n_entries} entries, {stats['numbers']} numbers compared "
               f"(rel {args.rel:g} / abs {args.abs_:g}); largest difference abs {stats['max_abs']:.3g}, "
               f"rel {stats['max_rel']:.3g}")
    print(summary, file=sys.stderr if diffs else sys.stdout)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
