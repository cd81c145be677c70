"""benchmarks/compare_snapshots.py: renamed fields compare by value; anything else stays a difference."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("compare_snapshots", ROOT / "benchmarks" / "compare_snapshots.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cs = _load()

# a trace entry before issue 30 (old field names) and after it (site names), an encoder without a final norm
BEFORE = {
    "python trace(tiny:x, IOI).norms": {
        "attn_probs": {"norm": 2.0}, "routing": None, "final_in": {"norm": 3.0}, "final_out": {"norm": 4.0},
        "norm_in": {"ln_attn": {"norm": 5.0}, "ln_mlp": {"norm": 6.0}}, "norm_out": {"ln_attn": {"norm": 7.0}},
        "embed": {"norm": 1.0}},
    "python trace(tiny:enc, IOI).norms": {"attn_probs": {"norm": 2.0}, "final_in": None, "final_out": None},
    "python other(tiny:x)": {"attn_probs": 1.0},
}
AFTER = {
    "python trace(tiny:x, IOI).norms": {
        "pattern": {"norm": 2.0}, "routing_weights": None, "embed": {"norm": 1.0},
        "norms": {"ln_final.in": {"norm": 3.0}, "ln_final.out": {"norm": 4.0}, "ln_attn.in": {"norm": 5.0},
                  "ln_mlp.in": {"norm": 6.0}, "ln_attn.out": {"norm": 7.0}}},
    "python trace(tiny:enc, IOI).norms": {"pattern": {"norm": 2.0}},
    "python other(tiny:x)": {"attn_probs": 1.0},
}


def _run(tmp_path, a, b, *args):
    pa, pb, ps = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "s.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    rc = cs.main([str(pa), str(pb), *args, "--summary", str(ps)])
    return rc, json.loads(ps.read_text())


def test_issue_30_renames_compare_by_value(tmp_path):
    rc, s = _run(tmp_path, BEFORE, AFTER, "--preset", "issue-30")
    assert rc == 0 and s["equal"] and s["differences"] == 0
    assert s["numbers_compared"] == 9  # every renamed number compared, none dropped
    applied = {r["rename"]: r["applied_to"] for r in s["renames"]}
    assert applied["attn_probs=pattern"] == 2 and applied["norm_out/*=norms/*.out"] == 1
    assert applied["final_in=norms/ln_final.in?"] == 2  # the encoder's null dropped, B having no such site
    assert s["machine"]["command"].startswith("python ") and "compare_snapshots.py" in s["machine"]["command"]


def test_without_renames_the_old_names_are_differences(tmp_path):
    rc, s = _run(tmp_path, BEFORE, AFTER)
    assert rc == 1 and s["differences_unexplained"] == s["differences"] > 0
    assert any('["attn_probs"]: only in A' in r["difference"] for r in s["difference_list"])


def test_a_renamed_value_that_changed_is_a_difference(tmp_path):
    after = json.loads(json.dumps(AFTER))
    after["python trace(tiny:x, IOI).norms"]["norms"]["ln_mlp.in"]["norm"] = 6.1
    after["python trace(tiny:x, IOI).norms"]["norms"]["ln_mlp.out"] = {"norm": 0.0}  # a site the old trace lacked
    rc, s = _run(tmp_path, BEFORE, after, "--preset", "issue-30")
    assert rc == 1 and s["differences"] == 2
    lines = [r["difference"] for r in s["difference_list"]]
    assert any('["norms"]["ln_mlp.in"]["norm"]: 6.0 in A, 6.1 in B' in x for x in lines)
    assert any('["norms"]["ln_mlp.out"]: only in B' in x for x in lines)
    assert s["max_abs_difference"] == pytest.approx(0.1)
    assert s["numbers_not_identical"] == 1 and s["entries_not_identical"] == {"python trace(tiny:x, IOI).norms": 1}


def test_numbers_within_the_tolerance_are_equal_but_counted(tmp_path):
    rc, s = _run(tmp_path, {"e": [1.0, 2.0]}, {"e": [1.0 + 1e-9, 2.0]})
    assert rc == 0 and s["equal"] and s["numbers_not_identical"] == 1
    assert s["max_abs_difference"] == pytest.approx(1e-9) and s["max_abs_difference_at"] == '["e"][0]'


def test_a_null_that_b_holds_as_a_value_is_a_difference(tmp_path):
    after = json.loads(json.dumps(AFTER))
    after["python trace(tiny:enc, IOI).norms"]["norms"] = {"ln_final.in": {"norm": 1.0}}
    rc, s = _run(tmp_path, BEFORE, after, "--preset", "issue-30")
    lines = [r["difference"] for r in s["difference_list"]]
    assert rc == 1 and lines == ['["python trace(tiny:enc, IOI).norms"]["norms"]["ln_final.in"]: null in A, '
                                 '{"norm": 1.0} in B']


def test_rename_option_explanations_and_entry_glob(tmp_path):
    a = {"python f(x)": {"old": [1.0, 2.0], "gone": 1}, "python g(x)": {"old": 3.0}}
    b = {"python f(x)": {"new": [1.0, 2.0]}, "python g(x)": {"old": 3.0}}
    rc, s = _run(tmp_path, a, b, "--rename", "old=new", "--rename-entries", "python f(*",
                 "--explain", r'\["gone"\]: only in A=dropped on purpose')
    assert rc == 1 and s["differences"] == 1 and s["differences_explained"] == 1
    assert s["difference_list"][0]["explanation"] == "dropped on purpose"
    assert s["numbers_compared"] == 3  # g's "old" was not renamed: the glob names f only


@pytest.mark.parametrize("spec", ["old", "=new", "a/*/*=b/*/*", "a=b/*", "a/x*=b/*", "a//b=c"])
def test_bad_renames_are_refused(spec):
    with pytest.raises(cs.RenameError):
        cs.parse_rename(spec)


def test_a_rename_onto_an_existing_key_is_refused(tmp_path):
    a = {"python f(x)": {"old": 1.0, "new": 2.0}}
    pa = tmp_path / "a.json"
    pa.write_text(json.dumps(a))
    assert cs.main([str(pa), str(pa), "--rename", "old=new"]) == 2


def test_list_key_compares_named_rows_by_name(tmp_path):
    a = {"models": [{"name": "a", "n": 1.0}, {"name": "c", "n": 3.0}]}
    b = {"models": [{"name": "a", "n": 1.0}, {"name": "b", "n": 2.0}, {"name": "c", "n": 3.0}]}
    rc, s = _run(tmp_path, a, b, "--list-key", "name")
    assert rc == 1 and [r["difference"] for r in s["difference_list"]] == [
        '["models"]["name=b"]: only in B: {"n": 2.0, "name": "b"}']
    rc, s = _run(tmp_path, a, b)  # by place: the inserted row shifts the ones after it
    assert rc == 1 and s["differences"] == 4  # the length, row 1's name and n, row 2 only in B
