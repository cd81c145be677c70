"""The explainer hook (lenscope.evaluate.explanations): the explanation is the explainer's own greedy continuation
of the prompt; every inactive text is silent when run on its own (checked by a plain capture and the dictionary
applied by hand); the detection score is the AUROC of the judge's answers worked out pair by pair; the scores are
kept in labels.json; ``dict label --explain`` runs it and refuses bad input in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.data.corpus import token_batches
from lenscope.errors import InputError
from lenscope.evaluate.explanations import (
    JUDGE,
    WRITE,
    context_text,
    explain_features,
    judge,
    pick_features,
    save_explanations,
)
from lenscope.features.dictionaries.cards import feature_cards
from lenscope.features.dictionaries.labels import cached_labels, load_labels
from lenscope.generation.run import decode
from lenscope.models.dictionaries.dictionary import save_dictionaries
from lenscope.models.loading.load import encode
from lenscope.models.loading.summary import fingerprint
from lenscope.models.runtime.engine import run
from tests.conftest import get_model
from tests.features.test_cards import corpus, random_dict

ANSWERS = ("Y", "N")  # the tiny tokenizer spells " Yes" in several tokens
SEQ, TOKENS = 24, 2000
CTX = (4, 1)  # short contexts: the tiny model reads 128 tokens


def _setup(tmp_path):
    """A JumpReLU dictionary whose thresholds are each feature's 90th percentile on the text: sparse features, so
    that texts on which a feature is silent exist."""
    lm = get_model("tiny:llama")
    D = random_dict(lm.anatomy.d_model, 24, kind="jumprelu", site="resid_post.1", seed=4)
    D.model, D.fingerprint = lm.name, fingerprint(lm.anatomy)
    data = corpus(tmp_path)
    ids = torch.cat(list(token_batches(lm.tokenizer, data, seq_len=SEQ, batch_size=8, part="heldout",
                                       max_sequences=TOKENS // SEQ)))
    h = run(lm, ids, capture=[D.site]).captured[D.site].flatten(0, 1)
    pre = (h - D.b_dec) @ D.W_enc + D.b_enc  # an SAE reads x - b_dec
    D.threshold = pre.quantile(0.9, dim=0).clamp(min=0.0).contiguous()
    return lm, D, data


def _brute_latent_max(lm, D, text, f):
    """The feature's largest latent over a text run on its own: a plain capture and the dictionary by hand."""
    h = run(lm, encode(lm, text)[None], capture=[D.site]).captured[D.site][0].double()
    z = D.encode(h.float()).double()
    return float(z[:, f].max())


def test_context_text_marks_the_centre_and_drops_outside_tokens():
    assert context_text([None, "a", " b", "c"], 2) == "a<< b>>c"
    assert context_text([None, "a", " b"]) == "a b"


def test_explanations_and_detection_by_hand(tmp_path):
    lm, D, data = _setup(tmp_path)
    alive = [c.active > 0 for c in feature_cards(lm, D, range(D.width), data, tokens=TOKENS, top=1)]
    feats = pick_features(D.width, 3, seed=1, alive=alive)
    assert feats == sorted(feats) and len(set(feats)) == 3 and all(alive[f] for f in feats)
    assert pick_features(D.width, 3, seed=1, alive=alive) == feats  # drawn with the seed
    r = explain_features(lm, D, feats, data, shown=2, n_test=3, tokens=TOKENS, answers=ANSWERS, max_new_tokens=4,
                         context=CTX, progress=False)
    cards = feature_cards(lm, D, feats, data, tokens=TOKENS, top=5, context=CTX)
    for j, c in enumerate(cards):
        # the explanation: the explainer's own greedy continuation of the prompt, its first line
        texts = "\n".join(f"{i + 1}. {context_text(t, c.center)}" for i, t in enumerate(c.context_tokens[:2]))
        ids = encode(lm, WRITE.format(texts=texts))
        cont = lm.tokenizer.decode(decode(lm, ids, 4)[ids.numel():].tolist(), skip_special_tokens=True)
        assert r.explanations[j] == (cont.strip().split("\n")[0].strip().rstrip(".") or "(nothing)")
        assert r.n_active[j] == len(c.context_tokens[2:])
    # the score: the AUROC of the judge's answers, worked out pair by pair, from a re-drawn inactive set
    j = next(i for i, s in enumerate(r.detection) if s is not None)
    pos = [context_text(t) for t in cards[j].context_tokens[2:]]
    others = [context_text(t) for i, c in enumerate(cards) if i != j for t in c.context_tokens[2:]]
    silent = [t for t in others if _brute_latent_max(lm, D, t, feats[j]) <= 0]
    assert r.n_inactive[j] == min(3, len(silent))
    yes, no = (lm.tokenizer.encode(a, add_special_tokens=False)[0] for a in ANSWERS)
    score = {}
    for t in pos + silent:
        logits = run(lm, encode(lm, JUDGE.format(explanation=r.explanations[j], text=t))[None]).logits[0, -1]
        score[t] = float(logits[yes] - logits[no])
    assert judge(lm, r.explanations[j], pos[:1], ANSWERS).tolist() == pytest.approx([score[pos[0]]], rel=1e-5,
                                                                                    abs=1e-5)
    # every inactive text the AUROC could use is silent; the AUROC lies between the ones of the best and worst pick
    a = np.array([score[t] for t in pos])
    pair = [float(np.mean([(x > score[t]) + 0.5 * (x == score[t]) for x in a])) for t in silent]
    lo, hi = np.mean(sorted(pair)[:r.n_inactive[j]]), np.mean(sorted(pair)[-r.n_inactive[j]:])
    assert lo - 1e-12 <= r.detection[j] <= hi + 1e-12
    # accuracy: the positives the sign puts right (known) plus as many inactive ones as the draw allows
    n_neg = r.n_inactive[j]
    right = r.accuracy[j] * (len(pos) + n_neg) - sum(score[t] > 0 for t in pos)
    quiet_right = sum(score[t] <= 0 for t in silent)
    assert right == pytest.approx(round(right), abs=1e-9)
    assert max(0, n_neg - (len(silent) - quiet_right)) <= round(right) <= min(n_neg, quiet_right)
    d = r.to_dict()
    assert d["site"] == D.site and [x["feature"] for x in d["features"]] == feats


def test_saved_beside_the_labels_and_cli(tmp_path):
    lm, D, data = _setup(tmp_path)
    folder = tmp_path / "dict"
    save_dictionaries([D], folder)
    with pytest.raises(InputError, match="dict label first"):
        save_explanations(explain_features(lm, D, [0, 1], data, shown=2, n_test=2, tokens=TOKENS, answers=ANSWERS,
                                           max_new_tokens=2, context=CTX, progress=False), folder)
    with pytest.raises(InputError, match="tokens"):
        explain_features(lm, D, [0, 1], data, tokens=TOKENS)  # " Yes" is several tokens in the tiny vocabulary
    with pytest.raises(InputError, match="at least 2 features"):
        explain_features(lm, D, [0], data, answers=ANSWERS)
    cached_labels(lm, [D], folder, data, tokens=TOKENS, top=4, seq_len=SEQ, progress=False)
    live = [f for f, lab in enumerate(load_labels(folder)["dictionaries"][D.site]["label"]) if lab != "dead"]
    r = explain_features(lm, D, live[:2], data, shown=2, n_test=2, tokens=TOKENS, answers=ANSWERS,
                         max_new_tokens=2, context=CTX, progress=False)
    save_explanations(r, folder)
    got = load_labels(folder)["dictionaries"][D.site]["explanations"]
    assert got[str(live[0])]["text"] == r.explanations[0] and got[str(live[0])]["explainer"] == lm.name
    res = CliRunner().invoke(app, ["dict", "label", str(folder), "--data", str(data), "--model", "tiny:llama",
                                   "--tokens", str(TOKENS), "--top", "4", "--seq-len", str(SEQ), "--explain", "1",
                                   "--json"])
    assert res.exit_code == 2 and "at least 2 features" in res.output
    res = CliRunner().invoke(app, ["dict", "label", str(folder), "--data", str(data), "--model", "tiny:llama",
                                   "--tokens", str(TOKENS), "--top", "4", "--seq-len", str(SEQ), "--explain", "2",
                                   "--json"])
    assert res.exit_code == 2 and "tokens" in res.output  # the tiny judge cannot answer " Yes" in one token
    assert json.loads((folder / "labels.json").read_text())["dictionaries"][D.site]["explanations"] == got
