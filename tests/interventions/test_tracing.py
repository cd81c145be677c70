"""Causal tracing: the batched trace equals one forward pass per (sample, restoration); restoring the clean
embeddings gives p_clean exactly; subject spans from offsets; the noise scale comes from the corpus."""

import pytest
import torch

from lenscope.errors import InputError
from lenscope.interventions import CausalTrace, Edit, causal_trace, embedding_std, run, subject_positions
from lenscope.interventions.tracing import window_layers
from lenscope.models.families import family_for
from lenscope.models.loading.load import encode, resolve_token
from lenscope.models.runtime.sites import PART_SITES

from ..conftest import get_model, module_output, with_module_output
from ..tolerances import assert_same_computation

PROMPT = "The capital of France is"


def test_subject_positions_from_offsets():
    lm = get_model("tiny:gpt2")
    toks = lm.tokenizer.convert_ids_to_tokens(encode(lm, PROMPT))
    pos = subject_positions(lm, PROMPT, "France")
    assert [toks[p] for p in pos] == ["ĠFr", "an", "ce"]
    assert subject_positions(lm, PROMPT, "capital") == [1]  # " capital" is one token with its space
    assert subject_positions(lm, PROMPT, "Fr") == [3]  # a part of a token selects that token
    with pytest.raises(InputError, match="does not occur"):
        subject_positions(lm, PROMPT, "Germany")
    with pytest.raises(InputError, match="empty"):
        subject_positions(lm, PROMPT, " ")


def test_embedding_std_from_corpus(tmp_path):
    lm = get_model("tiny:llama")
    std = embedding_std(lm)
    text = open(lenscope_corpus()).read()
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    # the tiny model has no positional embedding added before block 0: the state is the token embedding
    ref = lm.anatomy.embed.W_E[torch.tensor(ids)].float().std()
    assert std == pytest.approx(float(ref), rel=1e-4)
    other = tmp_path / "c.txt"
    other.write_text("France France France capital capital of of is")
    assert embedding_std(lm, other) != pytest.approx(std, rel=1e-3)
    with pytest.raises(InputError, match="no such corpus"):
        embedding_std(lm, tmp_path / "missing.txt")


def lenscope_corpus():
    from lenscope.interventions.tracing import DEFAULT_CORPUS

    return DEFAULT_CORPUS


def one_row_prob(lm, ids, subj, eps, restore, clean, window, tid):
    """P(target) for one noise sample and one restoration, with hooks written for this test."""
    hooks = family_for(lm.model).hooks(lm.model).layers
    L = len(hooks)
    kind, layer, pos = restore
    hs = []

    def block_pre(i):
        def f(mod, args, kwargs):
            x = (args[0] if args else kwargs["hidden_states"]).clone()
            if i == 0:
                x[0, subj] += eps
            if kind == "resid" and i == layer:
                x[0, pos] = clean["resid"][i][pos]
            if args:
                return (x,) + args[1:], kwargs
            kwargs["hidden_states"] = x
            return args, kwargs

        return f

    def out_hook(name, i):
        def f(mod, args, out):
            o = module_output(out)
            shape = o.shape  # OPT's MLP sees (batch * pos, d)
            o = o.clone().reshape(1, ids.numel(), -1)
            o[0, pos] = clean[name][i][pos]
            return with_module_output(out, o.reshape(shape))

        return f

    for i, lh in enumerate(hooks):
        hs.append(lh.block.register_forward_pre_hook(block_pre(i), with_kwargs=True))
    if kind in ("mlp", "attn"):
        for i in window_layers(layer, window, L):
            mod = hooks[i].mlp_out if kind == "mlp" else hooks[i].attn_out
            hs.append(mod.register_forward_hook(out_hook(kind, i)))
    try:
        with torch.no_grad():
            lg = lm.model(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), use_cache=False).logits
    finally:
        for h in hs:
            h.remove()
    return float(lg[0, -1].softmax(-1)[tid])


def test_batched_equals_loop(tiny_decoder):
    lm = tiny_decoder
    samples, window = 2, 2
    res = causal_trace(lm, PROMPT, "France", " capital", samples=samples, window=window, seed=3, batch_size=7)
    ids = encode(lm, PROMPT)
    subj = res.subject_positions
    tid = resolve_token(lm, " capital")
    kinds, L = ("resid", "attn", "mlp"), lm.anatomy.n_layers
    _, got = run(lm, ids[None], capture=[(PART_SITES[k], i) for k in kinds for i in range(L)])
    clean = {k: {i: got[(PART_SITES[k], i)][0] for i in range(L)} for k in kinds}
    g = torch.Generator().manual_seed(3)
    eps = torch.randn(samples, len(subj), lm.anatomy.d_model, generator=g) * res.noise_scale
    p_corr = sum(one_row_prob(lm, ids, subj, eps[s], ("none", -1, 0), clean, window, tid)
                 for s in range(samples)) / samples
    assert res.p_corrupted == pytest.approx(p_corr, abs=1e-6)
    L, P = res.resid.shape
    for kind in ("resid", "mlp", "attn"):
        loop = torch.zeros(L, P)
        for layer in range(L):
            for p in range(subj[0], P):
                ps = [one_row_prob(lm, ids, subj, eps[s], (kind, layer, p), clean, window, tid) for s in range(samples)]
                loop[layer, p] = sum(ps) / samples - p_corr
        assert torch.allclose(getattr(res, kind), loop, atol=1e-6), (kind, (getattr(res, kind) - loop).abs().max())
    assert res.noise_scale == pytest.approx(3 * embedding_std(lm))


def test_restoring_subject_embeddings_gives_p_clean(tiny_decoder):
    lm = tiny_decoder
    res = causal_trace(lm, PROMPT, "France", " capital", samples=3)
    assert res.p_corrupted != pytest.approx(res.p_clean, abs=1e-7)
    ids = encode(lm, PROMPT)
    subj = torch.tensor(res.subject_positions)
    _, got = run(lm, ids[None], capture=[("resid_pre", 0)])
    g = torch.Generator().manual_seed(0)
    eps = torch.randn(3, len(subj), lm.anatomy.d_model, generator=g) * res.noise_scale
    rows = torch.arange(3).repeat_interleave(len(subj))
    pos = subj.repeat(3)
    lg, _ = run(lm, ids[None].expand(3, -1),
                [Edit("resid_pre", 0, rows, pos, eps.reshape(-1, eps.shape[-1]), mode="add"),
                 Edit("resid_pre", 0, rows, pos, got[("resid_pre", 0)][0, pos])])
    p = lg[:, -1].softmax(-1)[:, res.target_id]
    assert torch.allclose(p, torch.full((3,), res.p_clean), atol=1e-6)
    # a one-token subject: the sweep's own entry at (layer 0, subject) is that restoration: AIE = p_clean - p_corrupted
    one = causal_trace(lm, PROMPT, "capital", " of", samples=3)
    assert one.subject_positions == [1]
    assert float(one.resid[0, 1]) == pytest.approx(one.p_clean - one.p_corrupted, abs=1e-6)
    # tokens before the subject never see the noise: exactly zero
    assert (res.resid[:, : res.subject_positions[0]] == 0).all()


def test_window_layers_as_rome():
    assert window_layers(0, 10, 30) == [0, 1, 2, 3, 4]
    assert window_layers(15, 10, 30) == list(range(10, 20))
    assert window_layers(29, 10, 30) == list(range(24, 30))
    assert window_layers(3, 1, 30) == [3]


def test_seeded_default_target_and_files(tmp_path):
    lm = get_model("tiny:llama")
    a = causal_trace(lm, PROMPT, "France", samples=2, seed=1)
    b = causal_trace(lm, PROMPT, "France", samples=2, seed=1)
    c = causal_trace(lm, PROMPT, "France", samples=2, seed=2)
    assert_same_computation(a.resid, b.resid, why="the same seed, the same calls")
    # another seed, other noise: apart by far more than rounding (1.4e-4 here, with entries up to 7e-5)
    assert float((a.resid - c.resid).abs().max()) > 1e-3 * float(a.resid.abs().max())
    probs = lm.model(input_ids=encode(lm, PROMPT)[None]).logits[0, -1].softmax(-1)
    assert a.target_id == int(probs.argmax())
    back = CausalTrace.load(a.save(tmp_path / "t.safetensors"))
    assert_same_computation(back.mlp, a.mlp, why="saved and read back")
    assert back.subject_positions == a.subject_positions
    d = a.to_dict()
    for k in ("tokens", "subject_positions", "p_clean", "p_corrupted", "resid", "mlp", "attn"):
        assert k in d
    assert len(a.to_frame()) == 3 * a.resid.numel()
    from lenscope.viz.plots import save_figure

    assert save_figure(a.plot(), tmp_path / "t.png").stat().st_size > 5000


def test_std_cache_is_per_model_object():
    """The cache must not hand one model's std to another (a freed model's id() can be reused): it holds the
    model weakly and drops it with the model."""
    import gc

    import lenscope
    from lenscope.interventions.tracing import _STD_CACHE

    a = lenscope.load("tiny:llama")
    std_a = embedding_std(a)
    assert a.model in _STD_CACHE
    n = len(_STD_CACHE)
    del a
    gc.collect()
    assert len(_STD_CACHE) == n - 1
    assert embedding_std(get_model("tiny:bloom")) != pytest.approx(std_a, rel=1e-3)
