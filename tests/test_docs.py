"""The Python examples of the README and of the docs pages run as written (on the embedded default model)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.slow
def test_readme_python_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").symlink_to(ROOT / "src")  # the examples read files relative to the repository root
    blocks = python_blocks(ROOT / "README.md")
    assert blocks
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "out" / "paris.safetensors").exists()
    assert (tmp_path / "out" / "report.html").stat().st_size > 100_000


@pytest.mark.slow
@pytest.mark.parametrize("page", ["attribution.md", "circuits.md", "design.md", "encoder-decoder.md", "features.md",
                                  "graphs.md", "lenses.md", "moe.md", "report.md"])
def test_docs_python_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").symlink_to(ROOT / "src")  # the examples read files relative to the repository root
    blocks = python_blocks(ROOT / "docs" / page)
    assert blocks
    for code in blocks:
        exec(compile(code, page, "exec"), {})


def test_readme_lists_every_model_type_by_kind():
    """The README's table of model types is the families' own list: every type lenscope reads, under its kind
    (mixture of experts: the families whose tiny models have expert blocks)."""
    from lenscope.models.families import family_rows, supported_model_types

    text = (ROOT / "README.md").read_text()
    table = {m.group(1): re.findall(r"`([a-z0-9_]+)`", m.group(2))
             for m in re.finditer(r"^\| (decoder|mixture of experts|encoder|encoder-decoder) \| (.*) \|$", text, re.M)}
    want: dict[str, list[str]] = {}
    for row in family_rows():
        kind = "mixture of experts" if row["moe"] else row["kind"]
        want.setdefault(kind, []).extend(row["model_types"])
    assert {k: sorted(v) for k, v in table.items()} == {k: sorted(v) for k, v in want.items()}
    assert sorted(t for v in table.values() for t in v) == supported_model_types()
