"""The suite's own rules: CI allows only reviewed skips, and assertions can fail."""

import subprocess
import sys
import textwrap

from .conftest import skip_is_allowed


def test_allowed_skips_are_narrow():
    assert skip_is_allowed("shared data not present")
    assert skip_is_allowed("SST-2 dev (shared data) is not available")
    for reason in ("no chromium: apt-get install chromium", "Ray is not installed: pip install 'ray>=2.9'",
                   "torchrun is missing from this environment", "Playwright for Python is missing"):
        assert not skip_is_allowed(reason), reason


def _run_pytest(tmp_path, body: str, ci: str | None):
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pkg = tmp_path / "tests"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "conftest.py").write_text((root / "tests" / "conftest.py").read_text())
    (pkg / "allowed_skips.txt").write_text((root / "tests" / "allowed_skips.txt").read_text())
    (pkg / "test_x.py").write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(pkg)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_skip_off_the_list_fails_ci_only(tmp_path):
    body = """
        import pytest

        def test_a():
            pytest.skip("no chromium: apt-get install chromium")

        def test_b():
            pytest.skip("shared data not present")

        def test_c():
            assert 1 + 1 == 2
    """
    local = _run_pytest(tmp_path / "l", body, None) if (tmp_path / "l").mkdir() is None else None
    ci = _run_pytest(tmp_path / "c", body, "true") if (tmp_path / "c").mkdir() is None else None
    assert local.returncode == 0, local.stdout[-2000:]
    assert ci.returncode == 1, ci.stdout[-2000:]
    assert "skips that CI does not allow" in ci.stdout and "no chromium" in ci.stdout
    assert "test_b" not in ci.stdout.split("skips that CI does not allow")[1]


# A bound that a quantity obeys whatever the code computes: a Spearman or Pearson correlation lies in [-1, 1], a
# probability or a fraction in [0, 1]; an entropy, a norm, an absolute value, a length or a count is >= 0. Such a
# check passes for a wrong value too; assert the value instead (against a recomputation, or a threshold with its
# reason). Only constant bounds count, so `0 <= lo <= hi` or `x >= 0.95 * y` are not flagged.
_CONSTANT_RANGES = {(-1.0, 1.0), (0.0, 1.0)}
_NONNEG_CALLS = {"abs", "len", "sqrt", "exp", "norm", "vector_norm", "matrix_norm", "numel", "std", "var", "square",
                 "softmax", "entropy", "fabs", "hypot", "count"}
_NONNEG_WORDS = {"entropy", "entropies", "norm", "norms", "abs", "std", "len", "count", "counts", "distance",
                 "prob", "probs", "probability", "probabilities", "softmax"}
_MODULES = {"torch", "np", "numpy", "math"}
_PASS_THROUGH = {"float", "int", "bool", "item", "min", "max", "sum", "mean", "all", "any", "amin", "amax",
                 "median", "detach", "cpu", "double", "tolist"}


def _number(n) -> float | None:
    """The value of a numeric literal (``1``, ``-1.0``, ``1e-9``), else None."""
    import ast

    if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
        v = _number(n.operand)
        return None if v is None else (-v if isinstance(n.op, ast.USub) else v)
    if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool):
        return float(n.value)
    return None


def _words(name: str) -> set[str]:
    return set(name.lower().replace("-", "_").split("_"))


def _callee(call) -> str:
    import ast

    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _nonnegative(n, made_by: dict[str, str]) -> bool:
    """``n`` is >= 0 whatever its inputs: an absolute value, a norm, a length... (through float(), .item(), .min(),
    .sum() and the like), or named as one (``entropy``, ``x_norm``, ``d["max_abs"]``), or an attribute of a result
    of a function named so (``grad_norm(...).scores``)."""
    import ast

    n = _strip(n)
    if isinstance(n, ast.Call):
        name = _callee(n)
        return name in _NONNEG_CALLS or bool(_words(name) & {"norm", "abs", "entropy"})
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow) and _number(n.right) == 2.0:
        return True
    if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
        return bool(_words(n.slice.value) & _NONNEG_WORDS) or _nonnegative(n.value, made_by)
    if isinstance(n, ast.Subscript):
        return _nonnegative(n.value, made_by)
    if isinstance(n, ast.Attribute):
        if _words(n.attr) & _NONNEG_WORDS:
            return True
        root = n.value
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        return isinstance(root, ast.Name) and bool(_words(made_by.get(root.id, "")) & {"norm", "abs", "entropy"})
    if isinstance(n, ast.Name):
        return bool(_words(n.id) & _NONNEG_WORDS)
    return False


def _strip(n):
    """``n`` without the calls that keep its sign: ``float(x)``, ``x.item()``, ``x.max()``, ``torch.sum(x)``..."""
    import ast

    while isinstance(n, ast.Call) and _callee(n) in _PASS_THROUGH:
        f = n.func
        if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id in _MODULES):
            n = f.value  # x.max()
        elif n.args:
            n = n.args[0]  # float(x), torch.max(x)
        else:
            break
    return n


def _bound_that_holds_anyway(test, made_by: dict[str, str]) -> str | None:
    """Why the comparison ``test`` holds for any value of its quantity, or None."""
    import ast

    while isinstance(test, ast.Call) and _callee(test) in ("all", "any", "bool") and test.args:
        test = test.args[0]  # torch.all(x >= 0), bool(x >= 0)
    if isinstance(test, ast.Call) and _callee(test) in ("all", "any") and isinstance(test.func, ast.Attribute):
        test = test.func.value  # (x >= 0).all()
    if not isinstance(test, ast.Compare):
        return None
    ops, items = test.ops, [test.left, *test.comparators]
    up = all(isinstance(o, (ast.Lt, ast.LtE)) for o in ops)
    down = all(isinstance(o, (ast.Gt, ast.GtE)) for o in ops)
    if len(ops) == 2 and (up or down):
        lo, hi = _number(items[0]), _number(items[2])
        if down:
            lo, hi = hi, lo
        if (lo, hi) in _CONSTANT_RANGES:
            return f"a range every correlation or probability lies in ({lo:g}..{hi:g})"
    if len(ops) == 1:
        op, a, b = ops[0], items[0], items[1]
        if isinstance(op, (ast.Lt, ast.LtE)):
            op, a, b = (ast.GtE() if isinstance(op, ast.LtE) else ast.Gt()), b, a
        bound = _number(b)
        if (isinstance(op, ast.GtE) and bound is not None and bound <= 0.0) or \
                (isinstance(op, ast.Gt) and bound is not None and bound < 0.0):
            if _nonnegative(a, made_by):
                return "a lower bound of 0 on a quantity that cannot be negative"
    return None


def _asserts_that_cannot_fail(source: str) -> list[tuple[int, str]]:
    """Assertions that pass whatever the code under test does: a check written into the assertion's message
    (``assert a, b == c`` never evaluates ``b == c`` when ``a`` holds), a constant or a non-empty tuple as the
    test, an expression compared with itself, or a bound the quantity obeys anyway (a correlation in [-1, 1], a
    probability in [0, 1], an entropy, norm or absolute value >= 0; also as one operand of ``and``)."""
    import ast

    tree = ast.parse(source)
    made_by: dict[str, str] = {}  # name -> the function whose result it was assigned (x = grad_norm(...))
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    made_by[t.id] = _callee(n.value)
    bad = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Assert):
            continue
        if n.msg is not None and isinstance(n.msg, (ast.Compare, ast.BoolOp)):
            bad.append((n.lineno, "a check in the message"))
        if isinstance(n.test, ast.Constant) or (isinstance(n.test, ast.Tuple) and n.test.elts):
            bad.append((n.lineno, "a constant test"))
        if (isinstance(n.test, ast.Compare) and len(n.test.ops) == 1
                and isinstance(n.test.ops[0], (ast.Eq, ast.LtE, ast.GtE, ast.Is))):
            if ast.dump(n.test.left) == ast.dump(n.test.comparators[0]):
                bad.append((n.lineno, "an expression compared with itself"))
        parts = n.test.values if isinstance(n.test, ast.BoolOp) and isinstance(n.test.op, ast.And) else [n.test]
        for part in parts:
            why = _bound_that_holds_anyway(part, made_by)
            if why:
                bad.append((n.lineno, why))
    return bad


def test_the_checker_finds_asserts_that_cannot_fail():
    src = ("def t(r, x):\n    assert r.ok, r.out and x == 2\n    assert (x, 'why')\n"
           "    assert x == x\n    assert x == 2, x\n")
    assert [ln for ln, _ in _asserts_that_cannot_fail(src)] == [2, 3, 4]


def test_the_checker_finds_bounds_that_hold_anyway():
    """Each line below holds for any value of its quantity (lines 2-12) and is flagged; the real checks after
    them (lines 13-20: a threshold, bounds that are not constant, a sign that can be wrong) are not."""
    src = """def t(c, s, x, y, tr, lm):
    assert -1.0 <= c["spearman"] <= 1.0 and len(x) == 3
    assert 0 < s["prob"] <= 1 and s["entropy"] >= 0
    assert 1 >= float(x) >= 0
    assert torch.all(tr.entropy >= 0)
    assert (x.abs() >= 0).all()
    assert float(x.norm()) >= 0.0 and abs(y) >= 0
    assert len(x) >= 0 and c["max_abs"] >= 0
    g = grad_norm(lm, x)
    assert bool((g.scores >= 0).all())
    assert x_norm > -1e-9
    assert (x ** 2).sum() >= 0
    assert c["spearman"] > 0.5 and -1 <= float(x) <= 0.5
    assert 0 <= c["median"] <= c["max"] and x >= 0.95 * y
    assert float(x.sum()) >= 0 and (y >= 0).all()
    assert float(x.abs().max()) > 1e-4 and x.norm() >= 2.0
    assert 0.2 <= s["lo"] and s["hi"] <= 1.0
    v = attribution(lm, x)
    assert (v.scores >= 0).all()
    assert x.min() >= -1
"""
    found = _asserts_that_cannot_fail(src)
    assert sorted({ln for ln, _ in found}) == [2, 3, 4, 5, 6, 7, 8, 10, 11, 12], found
    assert len(found) == 13  # both flagged operands of lines 3, 7 and 8 count


def test_no_assert_in_the_suite_cannot_fail():
    from pathlib import Path

    found = []
    for p in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        found += [f"{p.name}:{ln}: {why}" for ln, why in _asserts_that_cannot_fail(p.read_text())]
    assert not found, found


def test_no_merge_conflict_markers_in_tracked_files():
    """A merge left no conflict markers behind (git's ``<<<<<<< ``, ``>>>>>>> ``, a bare ``=======`` between them)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in files:
        path = root / name
        if path.suffix not in {".py", ".md", ".js", ".css", ".html", ".toml", ".txt", ".sh", ".cfg", ".yml", ""}:
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{name}:{i + 1}" for i, ln in enumerate(lines) if ln.startswith(("<<<<<<< ", ">>>>>>> "))]
    assert not found, found
