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


def _asserts_that_cannot_fail(source: str) -> list[tuple[int, str]]:
    """Assertions that pass whatever the code under test does: a check written into the assertion's message
    (``assert a, b == c`` never evaluates ``b == c`` when ``a`` holds), a constant or a non-empty tuple as the
    test, or an expression compared with itself."""
    import ast

    bad = []
    for n in ast.walk(ast.parse(source)):
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
    return bad


def test_the_checker_finds_asserts_that_cannot_fail():
    src = ("def t(r, x):\n    assert r.ok, r.out and x == 2\n    assert (x, 'why')\n"
           "    assert x == x\n    assert x == 2, x\n")
    assert [ln for ln, _ in _asserts_that_cannot_fail(src)] == [2, 3, 4]


def test_no_assert_in_the_suite_cannot_fail():
    from pathlib import Path

    found = []
    for p in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        found += [f"{p.name}:{ln}: {why}" for ln, why in _asserts_that_cannot_fail(p.read_text())]
    assert not found, found
