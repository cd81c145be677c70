"""The mixing study (lenscope/sweeps/mixing_study.py): resumable over a dataset, refusing another study's files,
its dataset loaders."""

import json

import pytest

from lenscope.errors import InputError
from lenscope.sweeps.mixing_study import MixingStudy, load_sentences, mixing_study

from ..conftest import get_model
from ..tolerances import assert_same_computation


def test_study_resumes_to_the_same_result(tmp_path):
    lm = get_model("tiny:gpt2")
    sents = ["the cat sat on the mat", "a dog ran in the park today", "it rained", "x",
             "the keys to the cabinet are here"]
    full = mixing_study(lm, sents, tmp_path / "a", dataset="t", progress=False)
    assert full.n_sentences + full.skipped == 5 and full.skipped >= 1  # "x" is too short
    mixing_study(lm, sents[:2], tmp_path / "b", dataset="t", progress=False)  # an "interrupted" run...
    state = json.loads((tmp_path / "b" / "state.json").read_text())
    state["meta"]["n"] = 5  # ...of the same study, stopped after two sentences
    (tmp_path / "b" / "state.json").write_text(json.dumps(state))
    with (tmp_path / "b" / "records.jsonl").open("a") as f:
        f.write('{"index": 2, "half-written')  # a record the crash left unfinished (state says done=2)
    resumed = mixing_study(lm, sents, tmp_path / "b", dataset="t", resume=True, progress=False)
    assert_same_computation(resumed.to_dict(), full.to_dict(), why="each sentence run alone by the same calls; the "
                            "first two read back")
    full.save(tmp_path / "a")
    back = MixingStudy.load(tmp_path / "a")
    assert_same_computation((back.cc, back.top_pairs), (full.cc, full.top_pairs), why="saved and read back")
    for f in ("layers.csv", "ff_amp_top_pairs.csv", "contextualization.png", "ff_norms.png", "gamma.png"):
        assert (tmp_path / "a" / f).stat().st_size > 100
    L = lm.anatomy.n_layers
    assert len(full.cc_ff) == L
    # cc_ff is the mean over sentences of 1 - Spearman(pre-FF map, post-FF map), recomputed here from the
    # public maps of each sentence (sentences of fewer than 3 tokens are skipped by the study)
    from lenscope.mixing.analysis import contextualization_change, pre_post_ff
    from lenscope.mixing.maps import context_mixing

    pre, post = pre_post_ff(lm.anatomy.placement)
    per = []
    for s in sents:
        m = context_mixing(lm, s, [pre, post])
        if m[pre].maps.shape[1] >= 3:
            per.append([contextualization_change(m[pre].maps[k].double(), m[post].maps[k].double()) for k in range(L)])
    assert len(per) == full.n_sentences
    assert full.cc_ff == pytest.approx([sum(c[k] for c in per) / len(per) for k in range(L)], abs=1e-6)
    assert all(p["i"] != p["j"] for ps in full.top_pairs for p in ps)


def test_resume_refuses_another_study(tmp_path):
    lm = get_model("tiny:gpt2")
    mixing_study(lm, ["the cat sat on the mat"], tmp_path, dataset="t", progress=False)
    with pytest.raises(InputError, match="same model"):
        mixing_study(lm, ["the cat sat on the mat", "another one here"], tmp_path, dataset="t", resume=True,
                     progress=False)


def test_datasets(tmp_path, monkeypatch):
    """The loaders, on a small copy of the shared data layout (LENSCOPE_DATA), so the test runs wherever the
    repository is cloned; the real files are checked by test_real_shared_data when they are present."""
    root = tmp_path / "data"
    (root / "sst2").mkdir(parents=True)
    (root / "wikitext2").mkdir()
    (root / "sst2" / "dev.tsv").write_text("sentence\tlabel\nit 's a charming journey . \t1\nbleak \t0\n")
    (root / "wikitext2" / "wiki.test.raw").write_text(
        " = Heading = \n\n Robert Boulter is an English film , television and theatre actor . He had a guest @-@ "
        "starring role on the television series The Bill in 2000 . Short one .\n")
    monkeypatch.setenv("LENSCOPE_DATA", str(root))
    assert load_sentences("sst2") == ("sst2", ["it 's a charming journey .", "bleak"])
    name, w = load_sentences("wikitext")
    assert w == ["Robert Boulter is an English film , television and theatre actor .",
                 "He had a guest-starring role on the television series The Bill in 2000 ."]
    monkeypatch.setenv("LENSCOPE_DATA", str(tmp_path / "nowhere"))
    monkeypatch.chdir(tmp_path)
    import lenscope.data.shared as study

    # a package path whose parents hold no shared/ (tmp_path's parents may: a clone in /tmp with shared/ beside it)
    monkeypatch.setattr(study, "__file__", str(tmp_path / "a" / "b" / "c" / "d" / "e" / "pkg" / "study.py"))
    with pytest.raises(InputError, match="LENSCOPE_DATA"):
        load_sentences("sst2")
    f = tmp_path / "mine.txt"
    f.write_text("first sentence here\n\n second one \n")
    assert load_sentences(str(f)) == ("mine.txt", ["first sentence here", "second one"])
    f.write_text("\n\n")
    with pytest.raises(InputError, match="no sentences"):
        load_sentences(str(f))
    with pytest.raises(InputError, match="neither"):
        load_sentences("nonexistent-dataset")
    with pytest.raises(InputError, match="at least 1"):
        load_sentences("sst2", limit=0)


def test_real_shared_data():
    from lenscope.data.shared import shared_data_dir

    if shared_data_dir() is None or not (shared_data_dir() / "sst2" / "dev.tsv").exists():
        pytest.skip("the shared data folder (../shared/data or LENSCOPE_DATA) is not next to this clone")
    name, s = load_sentences("sst2", limit=7)
    assert name == "sst2" and len(s) == 7 and s[0].startswith("it 's a charming")
    name, w = load_sentences("wikitext", limit=5)
    assert len(w) == 5 and all(6 <= len(x.split()) <= 40 and not x.startswith("=") for x in w)
