"""Directions: each method against its definition on states read by a plain hook, the scale convention, the folder
(save / load, JSON fields), and the refusals (another model, the wrong width, bad layers, positions, pairs)."""

import json

import pytest
import torch

from lenscope.data.steering import SteeringPair, data_hash, read_steering_pairs
from lenscope.errors import InputError
from lenscope.lenses.lenses import fingerprint
from lenscope.steering import METHODS, Direction, build_direction

from ..conftest import get_model
from ..tolerances import assert_same_computation
from .helpers import PAIRS, blocks


def _states(lm, texts, layer, position=-1):
    """The input of block ``layer`` at ``position`` of each text, read by a plain forward pre-hook (float64)."""
    out = []
    block = blocks(lm.model, lm.anatomy.n_layers)[layer]

    def grab(mod, args, kwargs):
        out.append((args[0] if args else kwargs["hidden_states"])[0, position].double())

    h = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            for t in texts:
                lm.model(lm.tokenizer(t, return_tensors="pt")["input_ids"])
    finally:
        h.remove()
    return torch.stack(out)


# pairs that differ from their first token on (a position other than the last one reads a difference)
EARLY = [("happy cats sleep well", "sad dogs run off"), ("good food", "bad weather"), ("glad we came", "angry at all"),
         ("nice to see", "awful to hear")]


@pytest.mark.parametrize("position", [-1, 1])
def test_every_method_against_its_definition(tiny_decoder, position):
    lm = tiny_decoder
    layer = lm.anatomy.n_layers - 1
    pairs = PAIRS if position == -1 else EARLY
    pos = _states(lm, [p for p, _ in pairs], layer, position)
    neg = _states(lm, [n for _, n in pairs], layer, position)
    D = pos - neg
    mean = D.mean(0)
    # float32 states, differences of O(1) values: 1e-5 relative to the vector's norm
    tol = 1e-5

    def close(v, ref):
        return float((v.double() - ref).norm()) <= tol * float(ref.norm()) + 1e-7

    md = build_direction(lm, pairs, "mean-diff", layer, position=position)
    assert close(md.vector, mean)  # the mean difference itself
    aa = build_direction(lm, pairs, "actadd", layer, position=position)
    assert close(aa.vector, D[0]) and aa.n_pairs == 1 and "first" in aa.notes[0]
    pc = build_direction(lm, pairs, "pca", layer, position=position)
    top = torch.linalg.eigh(D.T @ D).eigenvectors[:, -1]  # the first component of the uncentred differences
    u = pc.vector.double() / pc.vector.norm()
    assert abs(float(u @ top)) == pytest.approx(1, abs=1e-5)
    assert close(pc.vector, (mean @ u) * u)  # scaled to the mean difference's component
    assert float(pc.vector.double() @ mean) > 0
    pr = build_direction(lm, pairs, "probe", layer, position=position)
    from sklearn.linear_model import LogisticRegression

    X = torch.cat([pos, neg]).numpy()
    y = [1] * 4 + [0] * 4
    clf = LogisticRegression(C=1.0, max_iter=5000).fit(X, y)
    w = torch.tensor(clf.coef_[0])
    w = w / w.norm()
    assert close(pr.vector, (mean @ w) * w)
    assert pr.stats["accuracy"] == clf.score(X, y) >= 0.5
    for d in (md, aa, pc, pr):
        assert d.layer == layer and d.site_name == f"resid_pre.{layer}" and d.position == position
        assert d.stats["norm"] == pytest.approx(float(d.vector.norm()), rel=1e-6)
        # its definition, over the pairs the direction was built from (actadd: the first)
        assert_same_computation(d.stats["agreement"], float(((D[: d.n_pairs] @ d.vector.double()) > 0).double().mean()),
                                why="a share of positive signs: a count over a count, exact")
        assert d.fingerprint == fingerprint(lm.anatomy) and d.data_hash == data_hash(
            [SteeringPair(p, n) for p, n in pairs])
    assert set(METHODS) == {"actadd", "mean-diff", "pca", "probe"}


def test_folder_round_trip_and_json(tmp_path):
    lm = get_model("tiny:llama")
    d = build_direction(lm, PAIRS, "pca", 1)
    d.save(tmp_path / "dir")
    cfg = json.loads((tmp_path / "dir" / "direction.json").read_text())
    need = {"model", "fingerprint", "site", "method", "data_hash", "d_model", "position", "n_pairs", "stats"}
    assert need <= set(cfg)
    assert cfg["site"] == "resid_pre.1" and cfg["method"] == "pca" and cfg["fingerprint"] == fingerprint(lm.anatomy)
    e = Direction.load(tmp_path / "dir")
    assert_same_computation((e.vector, e.config()), (d.vector, d.config()), why="saved and read back")
    assert Direction.load(tmp_path / "dir" / "direction.json").layer == 1  # a file of the folder works too
    assert e.check(lm) == [1] and e.check(lm, [0, 1, 0]) == [0, 1]


def test_refusals(tmp_path):
    lm, other = get_model("tiny:llama"), get_model("tiny:qwen2")
    d = build_direction(lm, PAIRS, "mean-diff", 0)
    with pytest.raises(InputError, match="built on 'tiny:llama'"):
        d.check(other)
    wide = Direction(torch.zeros(lm.anatomy.d_model + 1), lm.name, d.fingerprint, 0, "mean-diff")
    with pytest.raises(InputError, match="width"):
        wide.check(lm)
    for bad in (lm.anatomy.n_layers, -1, "1"):
        with pytest.raises(InputError, match="outside"):
            d.check(lm, [bad])
    with pytest.raises(InputError, match="outside"):
        build_direction(lm, PAIRS, "mean-diff", 99)
    with pytest.raises(InputError, match="unknown method"):
        build_direction(lm, PAIRS, "svd", 0)
    with pytest.raises(InputError, match="at least 2 pairs"):
        build_direction(lm, PAIRS[:1], "pca", 0)
    with pytest.raises(InputError, match="row 2: position 9 is outside"):
        build_direction(lm, [("the cat sat on the mat and more", "a b"), ("x", "y")], "mean-diff", 0, position=9)
    with pytest.raises(InputError, match="do not differ"):
        build_direction(lm, [("the cat", "the dog")], "mean-diff", 0, position=0)
    with pytest.raises(InputError, match="row 1: the text is empty"):
        build_direction(lm, [("", "x")], "mean-diff", 0)
    (tmp_path / "broken").mkdir()
    with pytest.raises(InputError, match="not a steering direction"):
        Direction.load(tmp_path / "broken")
    d.save(tmp_path / "d")
    (tmp_path / "d" / "direction.json").write_text("{not json")
    with pytest.raises(InputError, match="cannot read"):
        Direction.load(tmp_path / "d")


def test_pairs_csv(tmp_path):
    p = tmp_path / "pairs.csv"
    p.write_text('positive,negative,topic\n"good, fine",bad,x\n\nhappy,sad,y\n')
    pairs = read_steering_pairs(p)
    assert [(x.positive, x.negative, x.row) for x in pairs] == [("good, fine", "bad", 1), ("happy", "sad", 2)]
    assert pairs[0].meta == {"topic": "x"}
    for text, msg in [("positive\nhappy\n", "no column 'negative'"), ("positive,negative\nhappy, \n", "row 1"),
                      ("positive,negative\n", "no rows"), ("", "empty"), ("positive,negative\na,b,c\n", "row 1: 3")]:
        p.write_text(text)
        with pytest.raises(InputError, match=msg):
            read_steering_pairs(p)
    with pytest.raises(InputError, match="no such file"):
        read_steering_pairs(tmp_path / "missing.csv")
