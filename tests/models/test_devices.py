"""Models larger than one device (accelerate device maps with CPU + disk offload) and reduced-precision dtypes.

This machine has no accelerator: the split models place blocks on "cpu" and "disk" (accelerate offload: the
parameters sit on ``meta`` and hooks load them for each forward pass), which exercises the dispatch hooks, the
materialisation of offloaded weights into the Anatomy and the input device of a dispatched model. See
docs/devices.md for what this does not cover.
"""

import json
import os

import pytest
import torch
from typer.testing import CliRunner

import lenscope
from lenscope.attribution.dla import direct_logit_attribution
from lenscope.errors import InputError
from lenscope.mixing.maps import context_mixing
from lenscope.models.families import family_for
from lenscope.models.loading.devices import compute_dtype, main_device, parse_device_map, parse_dtype
from lenscope.models.runtime.trace import residual_states
from lenscope.models.runtime.verify import LOGIT_TOL, RESID_TOL, tolerances
from lenscope.models.weights.anatomy import to_device
from tests.conftest import DECODERS, TINY, get_model
from tests.tolerances import assert_same_computation

TEXT = "The capital of France is Paris, and Berlin"
TRACED = ("embed", "resid_pre", "resid_mid", "resid_post", "attn_out", "attn_write", "mlp_out", "mlp_write",
          "pattern", "mlp_pre", "mlp_up", "ln_final.in", "ln_final.out", "logits", "positions")
# the exact comparisons below (tests.tolerances.assert_same_computation): a split model runs the same operations on
# the same CPU, its weights the same values in the same layout, only placed (and brought in) by accelerate
SPLIT = "the same forward on the same CPU: the split only places the weights"
VIEWS = "the same float32 conversion of the same bfloat16 weights, at load or at each use"


def split_map(model, disk_blocks=(1,), other="cpu", disk_modules=()) -> dict:
    """A device map placing the listed blocks on "disk" and the others on "cpu"; every other module holding weights
    on ``other`` (``disk_modules``: names of such modules to put on "disk" instead)."""
    fam = family_for(model)
    names = {id(m): n for n, m in model.named_modules()}
    blocks = [names[id(lh.block)] for lh in fam.hooks(model).layers]
    dm = {b: ("disk" if i in disk_blocks else "cpu") for i, b in enumerate(blocks)}
    for n, m in model.named_modules():
        if any(n == b or n.startswith(b + ".") for b in blocks) or not n:
            continue
        if any(n.startswith(k + ".") for k in dm):
            continue
        if next(m.parameters(recurse=False), None) is not None or next(m.buffers(recurse=False), None) is not None:
            dm[n] = "disk" if n in disk_modules else other
    return dm


_split: dict = {}


def split(name: str, **kw):
    key = (name, json.dumps(kw, sort_keys=True, default=str))
    if key not in _split:
        base = get_model(name)
        _split[key] = lenscope.load(name, device_map=split_map(base.model, **kw))
    return _split[key]


# ----------------------------------------------------------------------------------------------
# the split model gives the same numbers


@pytest.mark.parametrize("family", TINY)
def test_split_model_same_trace_and_verify(family):
    name = f"tiny:{family}"
    lm0, lm = get_model(name), split(name)
    assert lm.device_map and "disk" in lm.device_map.values()
    # the offloaded block's parameters really are off-device (meta), and hooks bring them in per forward pass
    off = lm.anatomy.extras["placement"]["offloaded"]
    assert off and all(p.device.type == "meta" for n, p in lm.model.named_parameters()
                       if any(n.startswith(o + ".") for o in off))
    # ... while the Anatomy holds their real values, equal to the unsplit model's
    assert all(d.type == "cpu" for d in lm.anatomy.devices)
    for a, b in zip(lm0.anatomy.layers, lm.anatomy.layers):
        for x, y in ((a.attn.W_Q, b.attn.W_Q), (a.attn.W_O, b.attn.W_O), (a.mlp.W_in, b.mlp.W_in),
                     (a.mlp.W_out, b.mlp.W_out)):
            assert y.device.type != "meta"
            assert_same_computation(x, y, why="the same weights, loaded again")
    t0, t1 = lenscope.trace(lm0, TEXT), lenscope.trace(lm, TEXT)
    for k in TRACED:
        x, y = (t0.site(k), t1.site(k)) if "." in k else (getattr(t0, k), getattr(t1, k))
        assert (x is None) == (y is None), k
        if x is not None:
            assert_same_computation(x, y, why=f"{SPLIT} ({k})")
    r0, r1 = lenscope.verify(lm0, tr=t0), lenscope.verify(lm, tr=t1)
    assert r1.ok and r1.devices == ["cpu"] * lm.anatomy.n_layers
    assert_same_computation((r1.layers, r1.max_abs_logit_error), (r0.layers, r0.max_abs_logit_error), why=SPLIT)


@pytest.mark.parametrize("family", DECODERS)
def test_split_model_same_decompositions(family):
    name = f"tiny:{family}"
    lm0, lm = get_model(name), split(name)
    d0 = direct_logit_attribution(lm0, TEXT, "#5", foil="#7", by_head=True)
    d1 = direct_logit_attribution(lm, TEXT, "#5", foil="#7", by_head=True)
    assert d1.names == d0.names
    assert_same_computation((d1.values, d1.completeness_error), (d0.values, d0.completeness_error), why=SPLIT)
    assert d0.completeness_error < 1e-4
    m0, m1 = context_mixing(lm0, TEXT), context_mixing(lm, TEXT)
    for s in m0:
        assert_same_computation((m0[s].maps, m0[s].completeness_error), (m1[s].maps, m1[s].completeness_error),
                                why=f"{SPLIT} ({s})")
        assert m0[s].completeness_error <= 1e-3


def test_split_encoder_same_mixing():
    lm0, lm = get_model("tiny:bert"), split("tiny:bert")
    m0, m1 = context_mixing(lm0, TEXT), context_mixing(lm, TEXT)
    for s in m0:
        assert_same_computation(m0[s].maps, m1[s].maps, why=f"{SPLIT} ({s})")


def test_offloaded_embedding_and_head():
    """With the embeddings and the LM head on disk the model's first parameter is on meta: inputs go where
    accelerate executes the model, not to a meta parameter's device."""
    lm0 = get_model("tiny:llama")
    lm = split("tiny:llama", disk_blocks=(0,), disk_modules=("model.embed_tokens", "lm_head"))
    assert next(lm.model.parameters()).device.type == "meta"
    assert main_device(lm.model) == torch.device("cpu")
    r = lenscope.verify(lm)
    assert r.ok
    assert_same_computation(r.layers, lenscope.verify(lm0).layers, why=SPLIT)
    assert_same_computation(lm.anatomy.embed.W_E, lm0.anatomy.embed.W_E, why="the same weights, loaded again")
    assert_same_computation(lm.anatomy.unembed.W_U, lm0.anatomy.unembed.W_U, why="the same weights, loaded again")


def test_tied_embeddings_split():
    """gpt2 and qwen2 tie the LM head to the embeddings: the head offloaded, the embeddings on CPU."""
    for name, head in (("tiny:gpt2", "lm_head"), ("tiny:qwen2", "lm_head")):
        lm0 = get_model(name)
        dm = split_map(lm0.model, disk_modules=(head,))
        lm = lenscope.load(name, device_map=dm)
        assert_same_computation(lm.anatomy.unembed.W_U, lm0.anatomy.unembed.W_U, why="the same weights, loaded again")
        assert lenscope.verify(lm).ok


def test_auto_device_map_under_max_memory():
    lm0 = get_model("tiny:llama")
    size = sum(p.numel() * 4 for p in lm0.model.parameters())
    lm = lenscope.load("tiny:llama", device_map="auto", max_memory={"cpu": size // 2, "disk": "1GB"})
    assert "disk" in lm.device_map.values()
    r = lenscope.verify(lm)
    assert r.ok and r.layers == lenscope.verify(lm0).layers


def test_whole_model_on_disk_is_refused():
    with pytest.raises(InputError, match="whole model would be offloaded"):
        lenscope.load("tiny:gpt2", device_map="auto", max_memory={"cpu": 1000, "disk": "1GB"})


def test_residual_states_of_split_model():
    lm0, lm = get_model("tiny:gpt-neox"), split("tiny:gpt-neox")
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    a, b = residual_states(lm0, ids, mid=True), residual_states(lm, ids, mid=True)
    for k in ("states", "mid", "logits"):
        assert_same_computation(a[k], b[k], why=f"{SPLIT} ({k})")


def test_trace_device_argument():
    lm = get_model("tiny:llama")
    t0, t1 = lenscope.trace(lm, TEXT), lenscope.trace(lm, TEXT, device="cpu")
    for k in ("resid_pre", "pattern", "logits"):
        assert_same_computation(getattr(t0, k), getattr(t1, k), why="device='cpu', where it runs anyway: the same "
                                "calls")
    assert t1.positions.device == t1.resid_pre.device


@pytest.mark.parametrize("family", TINY)
def test_math_runs_on_each_layers_device(family):
    """lenscope's own math moves its inputs to the device of the part's weights (a block on another device is
    recomputed there). No second real device here, so the weights go to ``meta``: an operation mixing a CPU
    input with meta weights raises, so a missing move fails this test; the shapes must come out right."""
    lm = get_model(f"tiny:{family}")
    A = lm.anatomy
    tr = lenscope.trace(lm, TEXT)
    meta = torch.device("meta")
    layer = to_device(A.layers[-1], meta)
    assert layer.device == meta and A.layers[-1].device.type == "cpu"  # a copy; the Anatomy is untouched
    r = layer.forward(tr.resid_pre[-1], tr.positions)
    assert r["resid_post"].device == meta and r["resid_post"].shape == tr.resid_post[-1].shape
    assert r["pattern"].shape == tr.pattern[-1].shape
    rest = layer.after_attention(tr.resid_pre[-1], tr.attn_out[-1])
    assert rest["resid_post"].device == meta
    for norm in layer.norms().values():
        assert norm(tr.resid_pre[-1]).device == meta
    assert layer.attn.head_outputs(tr.pattern[-1], tr.attn_in[-1]).device == meta
    emb = to_device(A.embed, meta)
    assert emb(tr.input_ids, tr.positions).shape == tr.embed.shape
    if A.unembed is not None:
        assert to_device(A.unembed, meta)(tr.final_resid).device == meta


# ----------------------------------------------------------------------------------------------
# dtypes


def test_parse_dtype_and_device_map():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float16") is torch.float16
    assert parse_dtype(None) is torch.float32 and parse_dtype(torch.bfloat16) is torch.bfloat16
    assert compute_dtype(torch.bfloat16) is torch.float32 and compute_dtype(torch.float64) is torch.float64
    with pytest.raises(InputError, match="unknown dtype"):
        parse_dtype("int8")
    assert parse_device_map('{"a": "0", "b": "disk"}') == {"a": 0, "b": "disk"}
    assert parse_device_map("auto") == "auto" and parse_device_map(None) is None
    with pytest.raises(InputError, match="unknown device map"):
        parse_device_map("everywhere")


def test_tolerances_scale_with_the_dtype():
    t32 = tolerances(torch.float32)
    assert (t32.logit, t32.resid, t32.error_scale) == (LOGIT_TOL, RESID_TOL, "rms")
    for dt in (torch.bfloat16, torch.float16):
        t = tolerances(dt)
        eps = torch.finfo(dt).eps
        assert t.eps == eps and t.error_scale == "max"
        assert t.resid == pytest.approx(16 * eps) and t.completeness == pytest.approx(16 * eps)
        assert t.logit_tol(torch.tensor([-30.0, 2.0])) == pytest.approx(4 * eps * 30)
    assert tolerances("bfloat16").resid > tolerances("float16").resid > tolerances("float32").resid


_reduced: dict = {}


def reduced(name, dtype):
    if (name, dtype) not in _reduced:
        _reduced[(name, dtype)] = lenscope.load(name, dtype=dtype)
    return _reduced[(name, dtype)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", TINY)
def test_verify_reduced_precision(family, dtype):
    lm = reduced(f"tiny:{family}", dtype)
    assert lm.dtype == dtype and next(lm.model.parameters()).dtype == dtype
    assert lm.anatomy.dtype == torch.float32  # lenscope computes in float32 from the model's weights
    tr = lenscope.trace(lm, TEXT)
    assert tr.resid_pre.dtype == torch.float32 and tr.logits.dtype == torch.float32
    rep = lenscope.verify(lm, tr=tr)
    tol = tolerances(dtype)
    assert rep.ok, rep.to_frame()
    assert rep.dtype == str(dtype).removeprefix("torch.") and rep.resid_tol == tol.resid
    assert rep.logit_tol == pytest.approx(tol.logit_tol(tr.logits))
    # honest: errors are the size of the dtype's rounding, not float32's
    assert rep.max_rel_resid_error > 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3", "gpt-neox"])
def test_decompositions_in_reduced_precision(family, dtype):
    """The decompositions compute in float32 from the reduced-precision weights and activations; their
    completeness is reported against what the reduced-precision model computed (its rounding included)."""
    lm = reduced(f"tiny:{family}", dtype)
    tol = tolerances(dtype)
    tr = lenscope.trace(lm, TEXT)
    d = direct_logit_attribution(lm, TEXT, "#5", by_head=True, tr=tr)
    assert d.values.dtype == torch.float32
    assert d.completeness_error <= tol.logit_tol(tr.logits)
    maps = context_mixing(lm, TEXT, tr=tr, check=False)
    errs = {s: m.completeness_error for s, m in maps.items() if s != "attention"}
    assert max(errs.values()) <= tol.completeness, errs
    assert max(errs.values()) > 1e-5  # the dtype's rounding shows: nothing pretends to float32 exactness


def test_reduced_precision_verify_catches_a_wrong_weight():
    lm = lenscope.load("tiny:llama", dtype=torch.bfloat16)
    W = lm.model.model.layers[0].mlp.down_proj.weight
    W.add_(0.05 * torch.randn(W.shape, generator=torch.Generator().manual_seed(1)).to(W.dtype))
    rep = lenscope.verify(lm)  # the Anatomy keeps the weights it read before the change
    assert not rep.ok and rep.layers[0]["mlp_out"] > rep.resid_tol


def test_overflow_is_reported():
    """A model that overflows in its own dtype (inf / NaN in its activations) fails verify and says where."""
    lm = lenscope.load("tiny:gpt2", dtype=torch.float16)
    lm.model.transformer.h[1].mlp.c_fc.bias.fill_(6e4)
    lm.model.transformer.h[1].mlp.c_proj.weight.fill_(1.0)
    rep = lenscope.verify(lm)
    assert not rep.ok and rep.nonfinite and "nonfinite" in repr(rep)


def test_split_and_reduced_together():
    name = "tiny:qwen2"
    lm = lenscope.load(name, dtype="bfloat16", device_map=split_map(get_model(name).model))
    lm_one = reduced(name, torch.bfloat16)
    assert lm.anatomy.dtype == torch.float32 and lm.anatomy.extras["placement"]["dtype"] == "bfloat16"
    r, r1 = lenscope.verify(lm), lenscope.verify(lm_one)
    assert r.ok
    assert_same_computation(r.layers, r1.layers, why=SPLIT)


# ----------------------------------------------------------------------------------------------
# command line


def test_cli_dtype_and_device_map(tmp_path):
    from lenscope.cli import app

    dm = tmp_path / "map.json"
    dm.write_text(json.dumps(split_map(get_model("tiny:llama").model)))
    r = CliRunner().invoke(app, ["verify", "-m", "tiny:llama", "--dtype", "bfloat16", "--device-map", str(dm),
                                 "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["ok"] and d["dtype"] == "bfloat16" and d["error_scale"] == "max"
    r = CliRunner().invoke(app, ["components", "The capital of France is", "-m", "tiny:gpt2", "-t", "#5",
                                 "--dtype", "float16", "--json"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["verify", "-m", "tiny:llama", "--dtype", "int4"])
    assert r.exit_code == 2 and "unknown dtype" in r.output


def test_load_model_keeps_its_old_signature():
    from lenscope.cli.common import load_model

    lm = load_model("tiny:gpt2")
    assert lm.dtype == torch.float32 and lm.device_map is None and "placement" not in lm.anatomy.extras


def test_math_device_gathers_the_anatomy_and_traces():
    lm = lenscope.load("tiny:llama", math_device="cpu", device_map=split_map(get_model("tiny:llama").model))
    assert lm.anatomy.extras["placement"]["math_device"] == "cpu"
    assert all(d.type == "cpu" for d in lm.anatomy.devices)
    tr = lenscope.trace(lm, TEXT)
    assert tr.resid_pre.device.type == "cpu" and lenscope.verify(lm, tr=tr).ok


def test_completeness_tolerance():
    from lenscope.models.runtime.verify import completeness_tolerance

    assert_same_computation((completeness_tolerance(torch.float32), completeness_tolerance(get_model("tiny:gpt2"))),
                            (1e-3, 1e-3), why="the float32 constant, returned as it is")
    assert completeness_tolerance("bfloat16") == pytest.approx(16 * torch.finfo(torch.bfloat16).eps)
    assert completeness_tolerance(torch.float16) == pytest.approx(16 * torch.finfo(torch.float16).eps)


def test_anatomy_dtype_model_keeps_views():
    """``anatomy_dtype="model"``: a bfloat16 model's weights stay views (no copies) and lenscope's own math still
    computes in float32, giving the same verify and mixing numbers as the float32 copies."""
    lm = lenscope.load("tiny:llama", dtype="bfloat16", anatomy_dtype="model")
    W, P = lm.anatomy.layers[0].mlp.W_out, lm.model.model.layers[0].mlp.down_proj.weight
    assert W.dtype == torch.bfloat16 and W.untyped_storage().data_ptr() == P.untyped_storage().data_ptr()
    copies = reduced("tiny:llama", torch.bfloat16)
    assert_same_computation(lenscope.verify(lm).layers, lenscope.verify(copies).layers, why=VIEWS)
    m, mc = context_mixing(lm, TEXT, check=False), context_mixing(copies, TEXT, check=False)
    for s in m:
        assert_same_computation(m[s].maps, mc[s].maps, why=f"{VIEWS} ({s})")


@pytest.mark.slow
def test_real_model_split_with_disk_offload():
    """smollm2 loaded by transformers with a device map (half its blocks on disk) gives the unsplit numbers."""
    lm0 = get_model("smollm2")
    dm = split_map(lm0.model, disk_blocks=tuple(range(15, 30)))  # lm_head is tied to the embeddings: kept together
    lm = lenscope.load("smollm2", device_map=dm)
    assert len(lm.anatomy.extras["placement"]["offloaded"]) > 100
    t0, t1 = lenscope.trace(lm0, TEXT), lenscope.trace(lm, TEXT)
    for k in ("resid_pre", "pattern", "logits"):
        assert_same_computation(getattr(t0, k), getattr(t1, k), why=f"{SPLIT} ({k})")
    r0, r1 = lenscope.verify(lm0, tr=t0), lenscope.verify(lm, tr=t1)
    assert r1.ok
    assert_same_computation(r1.layers, r0.layers, why=SPLIT)
    d0 = direct_logit_attribution(lm0, TEXT, " Paris", tr=t0)
    d1 = direct_logit_attribution(lm, TEXT, " Paris", tr=t1)
    assert_same_computation(d0.values, d1.values, why=SPLIT)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_real_model_reduced_precision(dtype):
    lm = lenscope.load("smollm2", dtype=dtype)
    rep = lenscope.verify(lm)
    assert rep.ok, rep.to_frame()
    d = direct_logit_attribution(lm, TEXT, " Paris")
    assert d.completeness_error <= tolerances(dtype).logit_tol(torch.tensor([d.logit]))


def test_docs_devices_python_runs(tmp_path, monkeypatch):
    """The examples of docs/devices.md run as written (tiny models, so not slow)."""
    import re
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    page = Path(__file__).resolve().parents[2] / "docs" / "devices.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    assert len(blocks) == 2
    for code in blocks:
        exec(compile(code, "devices.md", "exec"), {})


@pytest.mark.parametrize("family,block", [("llama", "model.layers.1"), ("gpt2", "transformer.h.1"),
                                          ("gemma3", "model.layers.1")])
def test_a_partial_device_map_is_completed(family, block):
    """Naming one block is enough: the rest stays on the CPU (tied embeddings together) and the numbers agree."""
    import lenscope

    full = lenscope.load(f"tiny:{family}")
    split = lenscope.load(f"tiny:{family}", device_map={block: "disk"})
    assert lenscope.verify(split).ok
    a = lenscope.direct_logit_attribution(full, "The capital of France is", "#5", by_head=True)
    b = lenscope.direct_logit_attribution(split, "The capital of France is", "#5", by_head=True)
    assert torch.allclose(a.values, b.values, atol=1e-6)


def test_a_device_map_naming_an_unknown_module_is_a_clear_error():
    import lenscope

    with pytest.raises(lenscope.InputError, match="does not have: model.nope"):
        lenscope.load("tiny:llama", device_map={"model.nope": "disk"})


def test_offload_folders_of_processes_that_no_longer_run_are_removed(tmp_path):
    """A killed process leaves its offload folder (its weights) behind: the next one removes the folders whose
    process is gone, and keeps a running process's and the folders without a process id in their name."""
    import subprocess
    import sys

    from lenscope.models.loading.devices import OFFLOAD_PREFIX, sweep_offload_dirs

    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(p.stdout)  # that process has exited
    gone = tmp_path / f"{OFFLOAD_PREFIX}{dead}-abc"
    live = tmp_path / f"{OFFLOAD_PREFIX}{os.getpid()}-def"
    parent = tmp_path / f"{OFFLOAD_PREFIX}{os.getppid()}-ghi"
    old = tmp_path / f"{OFFLOAD_PREFIX}x1y2z3"
    for d in (gone, live, parent, old):
        d.mkdir()
        (d / "w.dat").write_bytes(b"0" * 16)
    assert sweep_offload_dirs(str(tmp_path)) == [str(gone)]
    assert not gone.exists() and live.exists() and parent.exists() and old.exists()
