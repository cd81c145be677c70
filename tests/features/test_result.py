"""The features of a prompt: one forward pass, the strongest latents per token, against the dictionary applied to
the captured site."""

from __future__ import annotations

import pytest
import torch

from lenscope.errors import InputError
from lenscope.features.dictionaries.result import FeatureActivations, active_features
from lenscope.models.dictionaries.dictionary import Dictionary
from lenscope.models.runtime.engine import capture
from tests.conftest import get_model
from tests.tolerances import assert_same_ints

TEXT = "The cat sat on the mat because it was warm"


def test_active_features_are_the_dictionarys_latents(tmp_path):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    D1 = Dictionary.init(d, 3 * d, kind="topk", k=5, site="resid_post.1", seed=1)
    D2 = Dictionary.init(d, 2 * d, kind="jumprelu", site="mlp_out.0", role="transcoder", seed=2, threshold=0.05)
    fa = active_features(lm, TEXT, [D1, D2], top=8)
    ids = lm.tokenizer(TEXT, return_tensors="pt").input_ids
    cap = capture(lm, ids, ["resid_post.1", "ln_mlp.out.0"])
    for j, (D, site) in enumerate([(D1, "resid_post.1"), (D2, "ln_mlp.out.0")]):
        z = D.encode(cap[site][0].float())
        assert_same_ints(fa.l0[j], (z > 0).sum(-1))
        for p in range(ids.shape[1]):
            want = sorted(((float(v), i) for i, v in enumerate(z[p].tolist()) if v > 0), reverse=True)[:8]
            got = [(v, i) for _, i, v in fa.active(p, D.site)]
            assert [i for _, i in got] == [i for _, i in want]
            assert torch.allclose(torch.tensor([v for v, _ in got]), torch.tensor([v for v, _ in want]), atol=1e-5)
    assert int(fa.l0[0].max()) <= 5
    df = fa.to_frame()
    assert len(df) == int((fa.ids >= 0).sum()) and set(df.site) <= {"resid_post.1", "mlp_out.0"}
    fa.save(tmp_path / "f.safetensors")
    back = FeatureActivations.load(tmp_path / "f.safetensors")
    assert_same_ints(back.ids, fa.ids)
    assert back.tokens == fa.tokens and back.sites == fa.sites
    with pytest.raises(InputError, match="no dictionary"):
        active_features(lm, TEXT, [])
