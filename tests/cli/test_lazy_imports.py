"""The command line answers ``--help`` and usage errors without importing torch or transformers: command modules
import only typer and the standard library at module level, and ``import lenscope`` loads its torch-heavy public
names on first use. Checked in a fresh interpreter (this test process has torch loaded already); no timing."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import sys
from typer.main import get_command
from typer.testing import CliRunner

from lenscope.cli import app

def paths(cmd, pre):
    yield pre
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from paths(sub, pre + [name])

runner = CliRunner()
n = 0
for p in paths(get_command(app), []):
    res = runner.invoke(app, p + ["--help"])
    assert res.exit_code == 0, (p, res.output)
    n += 1
res = runner.invoke(app, ["explain", "--no-such-option"])
assert res.exit_code == 2, res.output
res = runner.invoke(app, ["no-such-command"])
assert res.exit_code == 2, res.output
heavy = sorted(m for m in ("torch", "transformers", "sklearn", "matplotlib") if m in sys.modules)
print(n, heavy)
"""


def test_help_and_usage_errors_do_not_import_torch():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    n, heavy = out.stdout.split(" ", 1)
    assert int(n) > 10  # every command and group was asked for its help
    assert heavy.strip() == "[]", f"--help imported {heavy.strip()}"


def test_python_m_lenscope_help_does_not_import_torch():
    code = ("import runpy, sys\nsys.argv = ['lenscope', '--help']\ntry:\n    runpy.run_module('lenscope', "
            "run_name='__main__')\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False False"


def test_public_names_still_load_on_first_use():
    code = ("import sys, lenscope\nassert 'torch' not in sys.modules\n"
            "assert set(lenscope.__all__) <= set(dir(lenscope))\n"
            "from lenscope import load, trace, explain, Anatomy\nimport lenscope.models.loading.load as L\n"
            "assert lenscope.load is L.load and callable(explain) and callable(trace)\n"
            "assert lenscope.__version__\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
