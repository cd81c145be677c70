"""Integrated gradients against exact Shapley values for the feed-forward split (docs/mixing.md's table).

    .venv/bin/python benchmarks/mixing_shapley.py --out docs/results/mixing-shapley.json

For 1-layer tiny models (and the same with the MLP's input projections x8, so pre-activations reach ~5): at each
position of "The capital of France is", the players are the sources of the FF input plus the remainder; exact
Shapley values come from all 2^m coalitions, every hidden unit its own game, with the model's own activation
module. Per position: the relative L2 distance of IG's hidden parts (lenscope's closed form) to the Shapley
values; over the lower triangle: the correlation of lenscope's ``atblnff`` map with the map of the Shapley parts.
The helpers are the test suite's (``tests/mixing/test_maps.py``), so the script and the test compute the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from machine import record  # noqa: E402

import lenscope  # noqa: E402
from lenscope.mixing.maps import context_mixing  # noqa: E402
from lenscope.models.weights.algebra import ig_hidden  # noqa: E402
from lenscope.models.weights.anatomy import ACTIVATIONS  # noqa: E402
from tests.conftest import tiny_with_layers  # noqa: E402
from tests.mixing.test_maps import TEXT, activation_module, brute_ig, brute_parts, lin, shapley, with_strong_mlp  # noqa: E402


def compare(lm) -> dict:
    layer = lm.anatomy.layers[0]
    tr = lenscope.trace(lm, TEXT)
    n = len(tr.tokens)
    ref = brute_parts(lm, tr, 0)
    act = activation_module(lm, 0)
    ff = "atbff" if lm.anatomy.placement == "post" else "atblnff"
    inp = "atb" if lm.anatomy.placement == "post" else "atbln"
    cm = context_mixing(lm, tr=tr, scopes=[ff])[ff]
    W_out = layer.mlp.W_out.double()
    shap_map = torch.zeros(n, n, dtype=torch.float64)
    rel = []
    for i in range(n):
        mlp_in = tr.mlp_in[0][i].double()
        players = torch.cat([ref[inp][i], (mlp_in - ref[inp][i].sum(0))[None]])
        _, _, G, U = brute_ig(lm, 0, players, steps=2)
        phi = shapley(G, U, act)
        ig, ig_rest, _ = ig_hidden(ACTIVATIONS[layer.mlp.act], G[None, :-1], G[None, -1],
                                   None if U is None else U[None, :-1], None if U is None else U[None, -1])
        ig = torch.cat([ig[0], ig_rest])
        rel.append(float((ig - phi).norm() / phi.norm()))
        f = phi[:n] @ W_out
        if layer.ln_mlp_out is not None:  # Gemma's sandwich norm: part of atblnff, at the real output's scale
            f = lin(layer.ln_mlp_out, f, tr.mlp_out[0][i])
        shap_map[i] = f.norm(dim=-1)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    a, b = cm.maps[0].double()[mask], shap_map[mask]
    return {"tokens": n, "players": n + 1, "max_pre_activation": float(tr.mlp_pre[0].abs().max()),
            "rel_l2_per_position": rel, "rel_l2_max": max(rel), "rel_l2_mean": sum(rel) / len(rel),
            "map_correlation": float(torch.corrcoef(torch.stack([a, b]))[0, 1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="llama,gpt2,gemma3,opt")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    res = {"text": TEXT, "machine": record(), "rows": {}}
    for fam in a.families.split(","):
        for strong in (False, True):
            lm = with_strong_mlp(fam) if strong else tiny_with_layers(fam, 1)
            key = f"{fam}x8" if strong else fam
            res["rows"][key] = compare(lm)
            print(key, {k: v for k, v in res["rows"][key].items() if k != "rel_l2_per_position"}, flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
