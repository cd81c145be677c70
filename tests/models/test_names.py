"""One name per activation (issue 30): the Trace's fields and its accessor use the engine's site names, the old
names still work with a RenamedWarning (a DeprecationWarning) and give the very same tensors, one formatter makes
the parts' display names, and the docs' site table is the engine's."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from lenscope.errors import InputError, RenamedWarning
from lenscope.models.runtime.engine import Edit, capture
from lenscope.models.runtime.sites import (
    ALIASES,
    DISPLAY,
    LAYER_SITES,
    MODEL_SITES,
    NORM_SLOTS,
    PART_SITES,
    READ_ONLY,
    display_name,
    site_key,
)
from lenscope.models.runtime.trace import RENAMED, SITE_FIELDS, trace
from tests.conftest import get_model
from tests.tolerances import assert_same_computation

TEXT = "The cat sat on the mat because it was warm"
ROOT = Path(__file__).resolve().parents[2]


def _old(tr, name):
    """``getattr(tr, name)`` for an old name: exactly one RenamedWarning, pointing at this file."""
    with pytest.warns(RenamedWarning) as rec:
        value = getattr(tr, name)
    assert len(rec) == 1 and issubclass(rec[0].category, DeprecationWarning)
    assert rec[0].filename == __file__ and "deprecated" in str(rec[0].message)
    return value


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3", "mixtral", "bert"])
def test_site_reads_every_traced_site_by_its_engine_name(family):
    lm = get_model(f"tiny:{family}")
    tr = trace(lm, TEXT)
    cap = capture(lm, tr.input_ids[None], [(n, layer) for n in ("pattern", "resid_mid", "ln_attn.in")
                                           for layer in range(tr.n_layers)])
    for layer in range(tr.n_layers):
        assert_same_computation(tr.site("pattern", layer), cap["pattern", layer][0].to(tr.pattern.dtype),
                                why="the same forward, traced and captured")
        assert_same_computation(tr.site(f"resid_mid.{layer}"), cap["resid_mid", layer][0].float(),
                                why="the same forward, traced and captured")
        assert_same_computation(tr.site(("resid_mid", layer)), tr.resid_mid[layer], why="the same tensor, by its name")
        assert tr.site("pattern", layer) is not None and tr.site("ln_attn.in", layer).shape == tr.resid_pre[0].shape
    for name in SITE_FIELDS:
        assert tr.site(name) is getattr(tr, name)
    for name, value in tr.norms.items():
        assert tr.site(name) is value and name in LAYER_SITES + MODEL_SITES
    assert {f"{s}.in" for s in lm.anatomy.layers[0].norms()} <= set(tr.norms)
    if lm.anatomy.final_norm is None:
        assert tr.site("ln_final.in") is None
        assert_same_computation(tr.final_resid, tr.resid_post[-1], why="no final norm: the last state, copied")
    else:
        assert tr.site("ln_final.in") is tr.norms["ln_final.in"] is tr.final_resid
    with pytest.raises(InputError, match="does not hold the site 'q'"):
        tr.site("q", 0)
    with pytest.raises(InputError, match="unknown|does not hold"):
        tr.site("nonsense", 0)
    with pytest.raises(InputError, match="whole model"):
        tr.site("logits", 0)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_old_trace_names_warn_and_give_the_same_tensors(family):
    lm = get_model(f"tiny:{family}")
    for tr in (trace(lm, TEXT, pattern="keep"), trace(lm, TEXT, pattern="recompute")):
        assert _old(tr, "attn_probs") is tr.pattern
        assert _old(tr, "routing") is tr.routing_weights
        assert _old(tr, "final_in") is tr.norms["ln_final.in"] and _old(tr, "final_out") is tr.norms["ln_final.out"]
        for old, end in (("norm_in", ".in"), ("norm_out", ".out")):
            by_slot = _old(tr, old)
            assert set(by_slot) == set(lm.anatomy.layers[0].norms())
            assert all(by_slot[s] is tr.norms[s + end] for s in by_slot)
    assert set(RENAMED) == {"attn_probs", "routing", "final_in", "final_out", "norm_in", "norm_out"}
    with pytest.raises(AttributeError):
        tr.no_such_field  # noqa: B018


def test_old_trace_keyword_warns_and_gives_the_same_trace():
    lm = get_model("tiny:llama")
    new = trace(lm, TEXT, pattern="recompute")
    with pytest.warns(RenamedWarning, match="pattern="):
        old = trace(lm, TEXT, **{"attn_probs": "recompute"})
    assert type(old.pattern) is type(new.pattern)
    assert_same_computation(old.pattern.materialize(), new.pattern.materialize(),
                            why="the same call under its old and new names")
    with pytest.raises(TypeError, match="unexpected keyword"):
        trace(lm, TEXT, probs="keep")


def test_engine_aliases_warn_and_name_the_same_sites():
    lm = get_model("tiny:gpt2")
    ids = lm.tokenizer(TEXT, return_tensors="pt").input_ids
    for alias, site in ALIASES.items():
        with pytest.warns(RenamedWarning, match=f"'{alias}'") as rec:
            assert site_key((alias, 1)) == (site, 1)
        assert rec[0].filename == __file__
        with pytest.warns(RenamedWarning):
            assert Edit(alias, 1, torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 1)).site == site
        with pytest.warns(RenamedWarning) as rec:
            old = capture(lm, ids, [f"{alias}.1"])
        assert rec[0].filename == __file__  # the caller's line, not the engine's
        new = capture(lm, ids, [f"{site}.1"])
        assert_same_computation(old[site, 1], new[site, 1], why="the same capture under its old and new names")
    tr = trace(lm, TEXT)
    with pytest.warns(RenamedWarning):
        assert tr.site("mlp", 1) is not None
        assert_same_computation(tr.site("mlp", 1), tr.mlp_out[1], why="the same tensor, by its old name")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names warn nothing
        assert site_key(("resid_pre", 1)) == ("resid_pre", 1) and tr.site("mlp_out", 1) is not None
        assert trace(lm, TEXT, pattern="keep").pattern is not None


def test_the_library_uses_only_the_new_names():
    """Old Trace names appear in src only in the one mapping (RENAMED); a use at run time is an error inside
    lenscope (pyproject's filterwarnings)."""
    old = "|".join(RENAMED)
    pattern = re.compile(rf"\.({old})\b(?!\()|\battn_probs\b")  # attributes (not MoE.routing()), the keyword
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "src").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line) and not line.lstrip().startswith(("from ", "import "))
            # the one mapping of old names; verify's JSON keys (a file format, kept)
            and not line.startswith(("RENAMED = {", 'PATTERN_KEY, ROUTING_KEY = "attn_probs", "routing"'))]
    assert hits == []
    toml = (ROOT / "pyproject.toml").read_text()
    assert '"error::lenscope.errors.RenamedWarning:lenscope"' in toml
    tr = trace(get_model("tiny:gpt2"), TEXT)
    with pytest.raises(RenamedWarning):  # code of a lenscope module reading an old name
        exec(compile("tr.attn_probs", "some_method.py", "exec"), {"__name__": "lenscope.some_method", "tr": tr})
    with pytest.warns(RenamedWarning):  # a user's code: warned
        exec(compile("tr.attn_probs", "user_script.py", "exec"), {"__name__": "user_script", "tr": tr})


def test_display_names():
    cases = {("embed",): "embed", ("logits",): "logits", ("head", 3, 2): "L3H2", ("mlp", 3): "L3.mlp",
             ("attn", 3): "L3.attn", ("q", 3, 2): "L3H2.q", ("k", 0, 1): "L0H1.k", ("v", 2, 0): "L2H0.v",
             ("kv.k", 1, 0): "L1KV0.k", ("kv.v", 1, 1): "L1KV1.v", ("resid", 4): "L4.resid", ("layer", 5): "L5",
             ("dla.head", 3, 2): "L3.H2", ("dla.attn_bias", 3): "L3.attn_bias",
             ("attn_out", 3): "L3.attn", ("mlp_out", 3): "L3.mlp", ("resid_pre", 3): "L3.resid"}
    for args, name in cases.items():
        assert display_name(*args) == name
    assert display_name("head", 1, 2, pos=3) == "L1H2@3" and display_name("mlp", 3, pos=0) == "L3.mlp@0"
    assert display_name("mlp", 3, expert=1) == "L3.E1.mlp" == display_name("expert_out", 3, expert=1)
    assert display_name("neuron", 2, unit=17) == "L2.N17"
    assert set(PART_SITES.values()) <= set(LAYER_SITES)
    with pytest.raises(KeyError):
        display_name("nonsense", 1)
    assert len(DISPLAY) == len(set(DISPLAY.values()))  # one name per part


def _expand(names: list[str]) -> set[str]:
    out = set()
    for n in names:
        out |= {n.replace("<slot>", s) for s in NORM_SLOTS + ("ln_final",)} if "<slot>" in n else {n}
    return out


def _check_table(rows: list[tuple[list[str], str]], where: str):
    """Every row's names and its edit column against the engine's table: each site listed once."""
    seen: dict[str, bool] = {}
    for names, edit in rows:
        assert edit.startswith(("yes", "no")), (where, names, edit)
        for name in _expand(names):
            assert name not in seen, (where, name)
            seen[name] = edit.startswith("yes")
    engine = {n: n not in READ_ONLY for n in LAYER_SITES + MODEL_SITES}
    assert seen == engine, where


def test_design_docs_site_table_is_the_engines():
    lines = (ROOT / "docs" / "design.md").read_text().splitlines()
    start = lines.index("| site | shape | edit | what |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[2]))
    _check_table(rows, "docs/design.md")


def test_sites_docstring_table_is_the_engines():
    import lenscope.models.runtime.sites as sites

    lines = sites.__doc__.splitlines()
    rule = [i for i, line in enumerate(lines) if line.startswith("====")]
    rows = []
    for line in lines[rule[1] + 1: rule[2]]:
        if line[:24].strip():
            rows.append((re.findall(r"``([^`]+)``", line[:24]), line[48:56].strip()))
    _check_table(rows, "lenscope.models.runtime.sites")
