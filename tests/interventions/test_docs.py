"""docs/interventions.md: its Python example runs as written (on the embedded smollm2)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_interventions_doc_python_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "interventions.md").read_text(), flags=re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "interventions.md", "exec"), {})
    assert (tmp_path / "out" / "ioi-heads.safetensors").exists()
