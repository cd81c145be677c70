"""Compare two snapshots of ``benchmarks/snapshot_outputs.py`` (issue 17: numbers equal before and after to 1e-6).

    .venv/bin/python benchmarks/compare_snapshots.py before.json after.json [--rel 1e-6] [--abs 1e-6]
        [--preset issue-30] [--rename OLD=NEW ...] [--rename-entries GLOB] [--list-key name] [--explain REGEX=WHY ...]
        [--summary results.json --label-a TEXT --label-b TEXT]

Walks both files recursively. Two numbers are equal when ``|a - b| <= max(rel * max(|a|, |b|), abs)``
(``math.isclose``); everything else (strings, booleans, None, the non-finite markers "nan" / "inf", list
lengths, keys) must be identical. A key or list element present on one side only is a difference. Prints
every difference with its path and exits 1 if there is any, else prints a one-line summary and exits 0.

Renamed fields. ``--rename OLD=NEW`` (repeatable) moves, in every entry of A whose key matches
``--rename-entries`` (an fnmatch pattern, default ``*``), the value at path OLD to path NEW before comparing, so a
field that only changed its name is compared by value. A path is keys separated by ``/`` from the entry's top;
one ``*`` in OLD matches every key at that level and stands for the matched key in NEW (``norm_in/*=norms/*.in``
moves ``norm_in["ln_attn"]`` to ``norms["ln_attn.in"]``); a NEW ending in ``?`` drops a null value of A where B
has no such key (a field that was None is now absent). A rename whose OLD an entry lacks does nothing there; one
whose NEW A already holds is an error. Anything not renamed compares as before: a new field, a dropped one, a
renamed field whose value changed are differences.

Listings. ``--list-key FIELD`` compares a list whose elements are dicts that each hold FIELD, with distinct values,
as a dict by ``"FIELD=value"`` (``lenscope models --json`` by ``name``): a row added in the middle is then one
difference, not a shift of every row after it. Other lists compare by place.

Explained differences. ``--explain REGEX=WHY`` (repeatable; REGEX without "=") attaches WHY to every difference
line where REGEX matches (``re.search``; the first that matches); explained or not, a difference still makes the
exit status 1.

``--preset issue-30`` compares a snapshot of commit 23036ce (before issue 30) with one of a later commit: it adds
issue 30's renames of the Trace's fields to the engine's site names (RENAMES, as
``lenscope.models.runtime.trace.RENAMED``
lists them) on the ``python trace(...)`` entries, the explanations (EXPLAIN) of the null fields that issue 31 added
after it and of what its families added to ``lenscope models``, and a note (NOTES) on the numbers that moved
within the tolerance.

``--summary FILE`` writes the comparison as a results JSON (docs/design.md, "Numbers in the docs"): the files and
their labels, tolerances, entries and numbers compared, the largest absolute difference and the largest relative
one (over all numbers, and over numbers of magnitude at least ``--rel-floor``, 1e-3: near zero a relative
difference measures nothing), how many numbers (per entry) are not bit for bit equal, notes (the preset's NOTES
and ``--note``), each rename with the number of entries it applied to, every remaining difference with its
explanation, and the ``machine`` record of ``benchmarks/machine.py``.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import math
import re
import sys
from pathlib import Path

# issue 30 (one name per activation): the Trace's old field names -> the engine's site names, as paths in the
# snapshot's "python trace(...).norms" entries (lenscope.models.runtime.trace.RENAMED: norm_in / norm_out were dicts by
# norm slot of the ".in" / ".out" sites; final_in / final_out are None for encoders, which have no "ln_final" site)
RENAMES = {
    "issue-30": ("python trace(*", ["attn_probs=pattern", "routing=routing_weights", "norm_in/*=norms/*.in",
                                    "norm_out/*=norms/*.out", "final_in=norms/ln_final.in?",
                                    "final_out=norms/ln_final.out?"]),
}
_ISSUE_31 = ("a field issue 31 (encoder-decoder models; commits 452abf8, fb17945, after issue 30) added, None for "
             "models without an encoder-decoder stack: ")
_MODELS = re.escape('["lenscope models --json"]["json"]')
_NEW_FAMILIES = "gemma2|phi3|olmo2|stablelm|granite|smollm3"  # issue 31's families (merges 98e57c2, 2d80a5c)
_NEW_TINY = f"{_NEW_FAMILIES}|gemma3-multimodal|llama-rope-llama3|qwen3-yarn"
EXPLAIN = {  # (regex searched in a difference line, why)
    "issue-30": [
        (re.escape('["encoder"]: only in B: null'), _ISSUE_31 + "Trace.encoder / VerifyResult.encoder (the encoder's)"),
        (re.escape('["cross_out"]: only in B: null'), _ISSUE_31 + "Trace.cross_out (cross-attention's output)"),
        (re.escape('["cross_write"]: only in B: null'), _ISSUE_31 + "Trace.cross_write (what cross-attention adds)"),
        (re.escape('["cross_pattern"]: only in B: null'),
         _ISSUE_31 + "Trace.cross_pattern (cross-attention's probabilities)"),
        (_MODELS + rf'\["name=(tiny:)?({_NEW_TINY})"\]: only in B: ',
         "a family or tiny: model of issue 31's families (Gemma 2, Gemma 3 multimodal, Phi-3, OLMo 2, StableLM, "
         "Granite, SmolLM3, rope scaling; merges 98e57c2 and 2d80a5c after commit 23036ce) in lenscope models"),
        (_MODELS + r'\["name=gemma3"\]\["(description|model_types|tiny)"\]',
         "the gemma3 family also reads Gemma 3 multimodal (model type gemma3, tiny:gemma3-multimodal; issue 31's "
         "families, merge 98e57c2)"),
        (_MODELS + r'\["name=llama"\]\["(tiny|attention)"\]',
         "the llama family's rope-scaling tiny models (tiny:llama-rope-llama3, tiny:qwen3-yarn, a Qwen 3 with q/k "
         "norms; issue 31's families, merge 98e57c2) in its row of the listing"),
        (_MODELS + re.escape('["name=olmoe"]["attention"]')
         + r'(: length 3 in A, 4 in B|\[3\]: only in B: "q/k norms across heads")',
         "the listing names the scope of OLMoE's q/k norms (the switch qk_norm_across_heads shown since c3d926a, "
         "issue 31's families)"),
    ],
}
# where numbers within the tolerance are not bit for bit equal, and why (found by snapshots of single commits)
NOTES = {
    "issue-30": [
        "direct_logit_attribution(..., by_head=True): the per-head writes differ in float32 rounding only, from "
        "commit 49ac399 (issue 30's one head-write function: each head's output z times its W_O rows, "
        "algebra.head_writes, instead of the attention weights times the sources' value-output vectors, "
        "algebra.attention_parts); a snapshot of 49ac399 differs from one of its parent 23036ce there and nowhere "
        "else",
    ],
}


class RenameError(ValueError):
    pass


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


# --- renames --------------------------------------------------------------------------------------------------

def parse_rename(spec: str) -> tuple[list[str], list[str], bool]:
    """``OLD=NEW`` -> (OLD's keys, NEW's keys, whether NEW is optional)."""
    old, sep, new = spec.partition("=")
    optional = new.endswith("?")
    new = new.removesuffix("?")
    o, n = old.split("/"), new.split("/")
    if not sep or not old or not new or "" in o or "" in n:
        raise RenameError(f"rename {spec!r}: write OLD=NEW, each a path of keys separated by '/'")
    if old.count("*") > 1 or new.count("*") != old.count("*") or any("*" in k and k != "*" for k in o):
        raise RenameError(f"rename {spec!r}: OLD may hold one '*' as a whole key, and NEW then one '*'")
    return o, n, optional


def _get(d, keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return False, None
        d = d[k]
    return True, d


def _moves(entry, old: list[str]) -> list[tuple[list[str], str | None]]:
    """The concrete paths OLD matches in ``entry``, each with the key its '*' matched."""
    if "*" not in old:
        return [(old, None)] if _get(entry, old)[0] else []
    i = old.index("*")
    found, parent = _get(entry, old[:i])
    if not found or not isinstance(parent, dict):
        return []
    return [([*old[:i], k, *old[i + 1:]], k) for k in list(parent) if _get(parent[k], old[i + 1:])[0]]


def _pop(entry: dict, keys: list[str]):
    """Remove and return the value at ``keys``, and the dicts that held only it (``norm_in`` once every slot moved)."""
    nodes = [entry]
    for k in keys[:-1]:
        nodes.append(nodes[-1][k])
    value = nodes[-1].pop(keys[-1])
    for depth in range(len(keys) - 1, 0, -1):
        if nodes[depth]:
            break
        nodes[depth - 1].pop(keys[depth - 1])
    return value


def apply_renames(a: dict, b: dict, renames: list[str], entries: str = "*") -> dict[str, list[str]]:
    """Move A's renamed values to their new paths, in place, in A's entries matching ``entries``; returns, per
    rename, the entries it applied to."""
    applied: dict[str, list[str]] = {}
    rules = [(spec, *parse_rename(spec)) for spec in renames]
    for key, entry in a.items():
        if not fnmatch.fnmatchcase(key, entries) or not isinstance(entry, dict):
            continue
        other = b.get(key) if isinstance(b, dict) else None
        for spec, old, new, optional in rules:
            for path, star in _moves(entry, old):
                target = [k.replace("*", star) if star is not None else k for k in new]
                value = _pop(entry, path)
                if optional and value is None and not _get(other, target)[0]:
                    applied.setdefault(spec, []).append(key)
                    continue
                node = entry
                for k in target[:-1]:
                    node = node.setdefault(k, {})
                    if not isinstance(node, dict):
                        raise RenameError(f"rename {spec!r} in {key!r}: {'/'.join(target)} runs through a value")
                if target[-1] in node:
                    raise RenameError(f"rename {spec!r} in {key!r}: A already holds {'/'.join(target)}")
                node[target[-1]] = value
                if key not in applied.get(spec, []):
                    applied.setdefault(spec, []).append(key)
    return applied


# --- the comparison -------------------------------------------------------------------------------------------

def new_stats() -> dict:
    return {"numbers": 0, "max_abs": 0.0, "max_abs_at": None, "max_rel": 0.0, "max_rel_at": None,
            "max_rel_above_floor": 0.0, "max_rel_above_floor_at": None, "not_identical": 0,
            "entries_not_identical": {}}


def _keyed(x: list, key: str | None) -> dict | None:
    """A list of dicts that each hold ``key``, with distinct values, as a dict by ``"key=value"``; else None."""
    if key is None or not x or not all(isinstance(v, dict) and key in v for v in x):
        return None
    out = {f"{key}={v[key]}": v for v in x}
    return out if len(out) == len(x) else None


def compare(a, b, rel: float = 1e-6, abs_: float = 1e-6, path: list | None = None, diffs: list | None = None,
            stats: dict | None = None, rel_floor: float = 1e-3, list_key: str | None = None) -> list[str]:
    """Every difference between ``a`` and ``b`` as a line ``PATH: ...``."""
    path = [] if path is None else path
    diffs = [] if diffs is None else diffs
    stats = new_stats() if stats is None else stats
    where = _path(path)
    if isinstance(a, list) and isinstance(b, list):  # rows named by list_key compare by name, not by place
        ka, kb = _keyed(a, list_key), _keyed(b, list_key)
        if ka is not None and kb is not None:
            a, b = ka, kb
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() - b.keys():
            diffs.append(f"{_path([*path, k])}: only in A: {_short(a[k])}")
        for k in b.keys() - a.keys():
            diffs.append(f"{_path([*path, k])}: only in B: {_short(b[k])}")
        for k in sorted(a.keys() & b.keys()):
            compare(a[k], b[k], rel, abs_, [*path, k], diffs, stats, rel_floor, list_key)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            diffs.append(f"{where}: length {len(a)} in A, {len(b)} in B")
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, rel, abs_, [*path, i], diffs, stats, rel_floor, list_key)
        for i in range(len(b), len(a)):
            diffs.append(f"{_path([*path, i])}: only in A: {_short(a[i])}")
        for i in range(len(a), len(b)):
            diffs.append(f"{_path([*path, i])}: only in B: {_short(b[i])}")
    elif _is_number(a) and _is_number(b):
        stats["numbers"] += 1
        d = abs(a - b)
        scale = max(abs(a), abs(b))
        if d > 0:  # within tolerance or not: where the numbers are not bit for bit the same
            stats["not_identical"] += 1
            entry = path[0] if path else ""
            stats["entries_not_identical"][entry] = stats["entries_not_identical"].get(entry, 0) + 1
        if d > stats["max_abs"]:
            stats["max_abs"], stats["max_abs_at"] = d, where
        if scale > 0 and d / scale > stats["max_rel"]:
            stats["max_rel"], stats["max_rel_at"] = d / scale, where
        if scale >= rel_floor and d / scale > stats["max_rel_above_floor"]:
            stats["max_rel_above_floor"], stats["max_rel_above_floor_at"] = d / scale, where
        if not math.isclose(a, b, rel_tol=rel, abs_tol=abs_):
            diffs.append(f"{where}: {a!r} in A, {b!r} in B (abs {d:.3g}, rel {d / scale:.3g})")
    elif type(a) is not type(b) or a != b:
        diffs.append(f"{where}: {_short(a)} in A, {_short(b)} in B")
    return diffs


def explain(line: str, explanations: list[tuple[str, str]]) -> str | None:
    return next((why for pattern, why in explanations if re.search(pattern, line)), None)


def _pair(spec: str, what: str) -> tuple[str, str]:
    pattern, sep, why = spec.partition("=")
    if not sep or not pattern or not why:
        raise SystemExit(f"error: {what} {spec!r}: write REGEX=WHY")
    try:
        re.compile(pattern)
    except re.error as e:
        raise SystemExit(f"error: {what} {spec!r}: {pattern!r} is not a regular expression ({e})") from None
    return pattern, why


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="snapshot A (before)")
    ap.add_argument("b", help="snapshot B (after)")
    ap.add_argument("--rel", type=float, default=1e-6, help="relative tolerance (default 1e-6)")
    ap.add_argument("--abs", dest="abs_", type=float, default=1e-6, help="absolute tolerance (default 1e-6)")
    ap.add_argument("--preset", choices=sorted(RENAMES), help="a named set of renames and explanations")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="move A's value at path OLD to path NEW before comparing (repeatable; see the docstring)")
    ap.add_argument("--rename-entries", default="*", metavar="GLOB",
                    help="the entries --rename applies to (fnmatch on the entry's key; default every entry)")
    ap.add_argument("--explain", action="append", default=[], metavar="REGEX=WHY",
                    help="the explanation of every difference line REGEX matches (repeatable)")
    ap.add_argument("--list-key", metavar="FIELD",
                    help="compare lists of dicts that each hold FIELD (distinct) by FIELD's value, not by place")
    ap.add_argument("--note", action="append", default=[], metavar="TEXT",
                    help="a note for the summary (e.g. why numbers within the tolerance moved; repeatable)")
    ap.add_argument("--summary", metavar="FILE", help="write the comparison as a results JSON")
    ap.add_argument("--label-a", default="", help="what snapshot A is (for --summary)")
    ap.add_argument("--label-b", default="", help="what snapshot B is (for --summary)")
    ap.add_argument("--rel-floor", type=float, default=1e-3,
                    help="the smallest magnitude whose relative difference the summary reports separately")
    args = ap.parse_args(argv)
    with open(args.a) as f:
        a = json.load(f)
    with open(args.b) as f:
        b = json.load(f)
    a_original = copy.deepcopy(a) if args.summary else None
    renames: list[dict] = []
    explanations = [_pair(s, "--explain") for s in args.explain]
    try:
        if args.preset:
            entries, rules = RENAMES[args.preset]
            renames += [{"rename": r, "entries_glob": entries, "applied_to": n}
                        for r, n in _applied(a, b, rules, entries).items()]
            explanations += EXPLAIN.get(args.preset, [])
        if args.rename:
            renames += [{"rename": r, "entries_glob": args.rename_entries, "applied_to": n}
                        for r, n in _applied(a, b, args.rename, args.rename_entries).items()]
    except RenameError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stats = new_stats()
    diffs = compare(a, b, args.rel, args.abs_, stats=stats, rel_floor=args.rel_floor, list_key=args.list_key)
    for line in diffs:
        why = explain(line, explanations)
        print(line if why is None else f"{line}   [{why}]")
    n_entries = len(a.keys() | b.keys()) if isinstance(a, dict) and isinstance(b, dict) else 1
    n_explained = sum(explain(line, explanations) is not None for line in diffs)
    summary = (f"{len(diffs)} difference(s) ({n_explained} explained); {n_entries} entries, {stats['numbers']} "
               f"numbers compared (rel {args.rel:g} / abs {args.abs_:g}); largest difference abs "
               f"{stats['max_abs']:.3g}, rel {stats['max_rel']:.3g} ({stats['max_rel_above_floor']:.3g} over numbers "
               f"of magnitude >= {args.rel_floor:g})")
    print(summary, file=sys.stderr if diffs else sys.stdout)
    if args.summary:
        write_summary(args, argv, a_original, a, b, renames, explanations, diffs, stats, n_entries)
    return 1 if diffs else 0


def _applied(a, b, rules, entries) -> dict[str, int]:
    """Apply ``rules`` to A; the number of entries each applied to (every rule listed, 0 where none)."""
    done = apply_renames(a, b, rules, entries)
    return {r: len(done.get(r, [])) for r in rules}


def write_summary(args, argv, a_original, a, b, renames, explanations, diffs, stats, n_entries) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import record

    both = a.keys() & b.keys() if isinstance(a, dict) and isinstance(b, dict) else set()
    rows = [{"difference": line, "explanation": explain(line, explanations)} for line in diffs]
    by_why: dict[str, int] = {}
    for r in rows:
        by_why[r["explanation"] or "(unexplained)"] = by_why.get(r["explanation"] or "(unexplained)", 0) + 1
    out = {
        "a": {"file": args.a, "label": args.label_a, "entries": len(a_original) if isinstance(a, dict) else 1},
        "b": {"file": args.b, "label": args.label_b, "entries": len(b) if isinstance(b, dict) else 1},
        "tolerance": {"rel": args.rel, "abs": args.abs_},
        "list_key": args.list_key,
        "entries": n_entries,
        "entries_compared": len(both),
        "entries_only_in_a": sorted(a.keys() - b.keys()) if both else [],
        "entries_only_in_b": sorted(b.keys() - a.keys()) if both else [],
        "numbers_compared": stats["numbers"],
        "max_abs_difference": stats["max_abs"],
        "max_abs_difference_at": stats["max_abs_at"],
        "max_rel_difference": stats["max_rel"],
        "max_rel_difference_at": stats["max_rel_at"],
        "rel_floor": args.rel_floor,
        "max_rel_difference_above_floor": stats["max_rel_above_floor"],
        "max_rel_difference_above_floor_at": stats["max_rel_above_floor_at"],
        "numbers_not_identical": stats["not_identical"],
        "entries_not_identical": stats["entries_not_identical"],
        "notes": NOTES.get(args.preset, []) + args.note,
        "renames": renames,
        "differences": len(diffs),
        "differences_explained": sum(r["explanation"] is not None for r in rows),
        "differences_unexplained": sum(r["explanation"] is None for r in rows),
        "differences_by_explanation": by_why,
        "difference_list": rows,
        "equal": not diffs,
        "machine": record([str(Path(__file__).relative_to(Path.cwd())) if Path(__file__).is_relative_to(Path.cwd())
                           else __file__, *argv]),
    }
    path = Path(args.summary)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"-> {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
