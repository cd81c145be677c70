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
