"""Feature labels (lenscope.features.dictionaries.labels): each label equals one worked out by brute force from the
feature's card, over every feature of two dictionaries read in one pass and in chunks; dead features say so; the
cache round-trips and is read back; the graph's JSON and circuit-tracer export carry the labels; ``dict label``,
``features`` and ``dict show`` show them."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.errors import InputError
from lenscope.features.dictionaries.cards import feature_cards
from lenscope.features.dictionaries.labels import (
    DEAD,
    LABELS_FILE,
    cached_labels,
    feature_labels,
    labels_for,
    load_labels,
    save_labels,
    show_token,
)
from lenscope.features.graphs.export import circuit_tracer_json
from lenscope.features.graphs.graph import attribution_graph
from lenscope.models.dictionaries.dictionary import save_dictionaries
from lenscope.models.loading.summary import fingerprint
from tests.conftest import get_model
from tests.features.test_cards import corpus, random_dict

SEQ, TOKENS, TOP = 24, 3000, 5


def _dicts(lm):
    d = lm.anatomy.d_model
    ds = [random_dict(d, 3 * d, kind="jumprelu", role="transcoder", site="mlp_out.0", seed=3),
          random_dict(d, 40, kind="topk", site="resid_post.1", seed=4)]
    ds[0].b_enc[:3] = -1e4  # three features that never fire
    for D in ds:
        D.model, D.fingerprint = lm.name, fingerprint(lm.anatomy)
    return ds


def _brute_label(card) -> str:
    """The label written out from the card: the centre tokens counted, ties to the larger activation."""
    if card.active == 0:
        return DEAD
    centres = [c["tokens"][c["center"]] for c in card.contexts()]  # largest first
    best = sorted(set(centres), key=lambda t: (-centres.count(t), centres.index(t)))[0]

    names = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}

    def q(t):
        return "'" + "".join(names.get(c, f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c) for c in t) + "'"

    return f"{q(best)} → {q(card.promoted[0])}"


def test_every_label_is_its_cards_in_one_pass_and_in_chunks(tmp_path):
    lm = get_model("tiny:llama")
    ds = _dicts(lm)
    data = corpus(tmp_path)
    doc = feature_labels(lm, ds, data, tokens=TOKENS, top=TOP, seq_len=SEQ, batch_size=2, chunk=7, progress=False)
    assert doc["tokens"] > 0 and doc["data"] == str(data) and doc["top"] == TOP and doc["code_version"]
    for D in ds:
        cards = feature_cards(lm, D, range(D.width), data, tokens=TOKENS, top=TOP, seq_len=SEQ, batch_size=2)
        rec = doc["dictionaries"][D.site]
        assert rec["width"] == D.width == len(rec["label"])
        assert rec["label"] == [_brute_label(c) for c in cards]
        assert rec["promoted"] == [c.promoted[0] for c in cards]
        assert rec["suppressed"] == [c.suppressed[0] for c in cards]
        assert rec["density"] == pytest.approx([c.density for c in cards])
        assert all(c.tokens_seen == doc["tokens"] for c in cards)
    dead = doc["dictionaries"]["mlp_out.0"]["label"][:3]
    assert dead == [DEAD] * 3
    assert all(sum(lab != DEAD for lab in r["label"]) >= 5 for r in doc["dictionaries"].values())


def test_show_token_escapes_and_memory_is_refused_in_one_line(tmp_path):
    assert show_token(" Paris") == "' Paris'"
    assert show_token("a\nb\t\\\x07") == "'a\\nb\\t\\\\\\x07'"
    lm = get_model("tiny:llama")
    with pytest.raises(InputError, match="memory budget"):
        feature_labels(lm, _dicts(lm), corpus(tmp_path), tokens=TOKENS, max_memory="1kB", progress=False)


def test_the_cache_round_trips_and_is_read_back(tmp_path, monkeypatch):
    lm = get_model("tiny:llama")
    ds = _dicts(lm)
    folder = save_dictionaries(ds, tmp_path / "d")
    data = corpus(tmp_path)
    kw = dict(tokens=TOKENS, top=TOP, seq_len=SEQ, batch_size=2, progress=False)
    doc, computed = cached_labels(lm, ds, folder, data, **kw)
    assert computed and (folder / LABELS_FILE).is_file()
    assert load_labels(folder) == json.loads(json.dumps(doc))
    assert labels_for(folder) == {s: r["label"] for s, r in doc["dictionaries"].items()}
    assert labels_for(tmp_path) == {} and load_labels(tmp_path) is None

    def boom(*a, **k):
        raise AssertionError("computed again")

    import lenscope.features.dictionaries.labels as labels_mod

    monkeypatch.setattr(labels_mod, "feature_labels", boom)
    again, computed = cached_labels(lm, ds, folder, data, **kw)
    assert not computed and again == load_labels(folder)
    with pytest.raises(AssertionError, match="computed again"):  # another token budget: computed again
        cached_labels(lm, ds, folder, data, **{**kw, "tokens": TOKENS + 1})
    # one site saved on its own keeps the other's labels beside it (same source)
    one = {**doc, "dictionaries": {"resid_post.1": doc["dictionaries"]["resid_post.1"]}}
    save_labels(one, folder)
    assert set(load_labels(folder)["dictionaries"]) == {"mlp_out.0", "resid_post.1"}
    (folder / LABELS_FILE).write_text("{")
    with pytest.raises(InputError, match="not valid JSON"):
        load_labels(folder)


def _graph_setup(tmp_path):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    ds = [random_dict(d, 40, kind="topk", role="transcoder", site="mlp_out.0", seed=1, k=5),
          random_dict(d, 40, kind="jumprelu", role="transcoder", site="mlp_out.1", seed=2)]
    for D in ds:
        D.model, D.fingerprint = lm.name, fingerprint(lm.anatomy)
    folder = save_dictionaries(ds, tmp_path / "tc")
    data = corpus(tmp_path)
    return lm, ds, folder, data


def test_graph_json_and_export_carry_the_labels(tmp_path):
    lm, ds, folder, data = _graph_setup(tmp_path)
    g = attribution_graph(lm, "The cat sat on the mat", ds, progress=False)
    plain = g.to_dict(node_threshold=1.0, edge_threshold=1.0)
    assert all("label" not in n for n in plain["nodes"])  # no labels: the JSON as before
    ct = circuit_tracer_json(g, node_threshold=1.0, edge_threshold=1.0)
    assert all(n["clerp"] == "" for n in ct["nodes"] if n["feature_type"] == "cross layer transcoder")
    cached_labels(lm, ds, folder, data, tokens=TOKENS, top=TOP, seq_len=SEQ, batch_size=2, progress=False)
    labels = labels_for(folder)
    out = g.to_dict(node_threshold=1.0, edge_threshold=1.0, labels=labels)
    feats = [n for n in out["nodes"] if n["kind"] == "feature"]
    assert feats and all(n["label"] == labels[f"mlp_out.{n['layer']}"][n["feature"]] for n in feats)
    assert all("label" not in n for n in out["nodes"] if n["kind"] != "feature")
    assert [{k: v for k, v in n.items() if k != "label"} for n in out["nodes"]] == plain["nodes"]
    ct = circuit_tracer_json(g, node_threshold=1.0, edge_threshold=1.0, labels=labels)
    cf = [n for n in ct["nodes"] if n["feature_type"] == "cross layer transcoder"]
    by = {(n["layer"], n["feature"]): n["label"] for n in feats}
    assert cf and all(n["clerp"] == labels[f"mlp_out.{n['layer']}"][int(n["jsNodeId"].split("_")[1].split("-")[0])]
                      for n in cf)
    assert by  # the same nodes carry the same labels in both


runner = CliRunner()


def test_dict_label_cli_then_graph_features_and_dict_show_show_them(tmp_path):
    lm, ds, folder, data = _graph_setup(tmp_path)
    args = ["dict", "label", str(folder), "--model", "tiny:llama", "--data", str(data), "--tokens", str(TOKENS),
            "--top", str(TOP), "--seq-len", str(SEQ), "--json"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["computed"] and set(doc["dictionaries"]) == {"mlp_out.0", "mlp_out.1"}
    assert len(doc["dictionaries"]["mlp_out.1"]["label"]) == 40
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and not json.loads(r.stdout)["computed"]  # read back
    labels = labels_for(folder)
    r = runner.invoke(app, ["graph", "The cat sat on the mat", "--model", "tiny:llama", "--dict", str(folder),
                            "--json", "--no-heads", "--export-circuit-tracer", str(tmp_path / "ct.json")])
    assert r.exit_code == 0, r.output
    feats = [n for n in json.loads(r.stdout)["nodes"] if n["kind"] == "feature"]
    assert feats and all(n["label"] == labels[f"mlp_out.{n['layer']}"][n["feature"]] for n in feats)
    ct = json.loads((tmp_path / "ct.json").read_text())
    assert all(n["clerp"] for n in ct["nodes"] if n["feature_type"] == "cross layer transcoder")
    r = runner.invoke(app, ["features", "The cat sat", "--model", "tiny:llama", "--dict", str(folder), "--json"])
    assert r.exit_code == 0, r.output
    active = json.loads(r.stdout)["active"]
    assert active and all(a["label"] == labels[a["site"]][a["feature"]] for a in active)
    r = runner.invoke(app, ["dict", "show", "--model", "tiny:llama", "--dict", str(folder), "--site", "mlp_out.1",
                            "--feature", "4", "--data", str(data), "--tokens", "500", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["label"] == labels["mlp_out.1"][4]
    bad = runner.invoke(app, ["dict", "label", str(folder), "--model", "tiny:llama", "--data", str(data),
                              "--top", "0"])
    assert bad.exit_code == 2 and "--top must be at least 1" in bad.stderr
    assert torch.is_tensor(ds[0].W_dec)
