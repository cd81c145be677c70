r"""How far lenscope's circuit approximations can be trusted on smollm2: one task per run.

For ``--task ioi`` (names swapped: ``ioi_contrasts(corruption="swap")``) or ``--task sva`` (subject number
flipped: ``sva_contrasts``), on the first ``--n`` pairs:

- nodes: AtP and AtP* against exact node patching (Spearman, top-10 recall, false negatives, mean absolute error);
- edges: EAP and EAP-IG (5 steps) against exact edge patching of the union of each method's top ``--top`` edges
  and ``--sample`` more drawn at random (seeded), the same edges for both;
- faithfulness: the curves of EAP's and EAP-IG's top-k circuits (log grid, corrupted ablation), the smallest
  EAP-IG circuit reaching 0.8, and circuits chosen by exact scores: the top-k of the exactly scored edges, and
  greedy exact (ACDC-like) pruning of EAP-IG's top ``--greedy`` edges against EAP-IG's and EAP's top-k circuits of
  the same size;
- information-flow routes (tau 0.04, per head) of each prompt: the share of exact patching's top-10 nodes that
  appear on some prompt's routes (recall) and the share of route components among them (precision).

Writes ``docs/results/circuits/<task>.json`` and the pictures ``docs/images/circuits-<task>-*.png``:

    .venv/bin/python benchmarks/circuits_study.py --task ioi --n 8
    .venv/bin/python benchmarks/circuits_study.py --task sva --n 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import record  # noqa: E402

import lenscope  # noqa: E402
from lenscope.circuits import (  # noqa: E402
    Circuit,
    atp_star,
    attribution_patching,
    check_against_exact,
    edge_attribution,
    exact_edge_patching,
    exact_node_patching,
    faithfulness,
    greedy_circuit,
    information_flow_routes,
    route_recovery,
    smallest_circuit,
)
from lenscope.circuits.analysis import check_edges  # noqa: E402
from lenscope.circuits.circuit import _Evaluator  # noqa: E402
from lenscope.data.contrast import ioi_contrasts, sva_contrasts, tokenize_with  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", choices=("ioi", "sva"), default="ioi")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--top", type=int, default=50)
    ap.add_argument("--sample", type=int, default=100)
    ap.add_argument("--greedy", type=int, default=80)
    ap.add_argument("--tau", type=float, default=0.005)
    ap.add_argument("--out", default=None)
    ap.add_argument("--img", default="docs/images")
    args = ap.parse_args()
    out_path = Path(args.out or f"docs/results/circuits/{args.task}.json")
    res: dict = {"task": args.task, "model": args.model, "machine": record()}
    lm = lenscope.load(args.model)
    tok = tokenize_with(lm)
    make = (lambda n: ioi_contrasts(n, seed=0, corruption="swap", tokenize=tok)) if args.task == "ioi" else (
        lambda n: sva_contrasts(n, seed=0, tokenize=tok))
    pairs = make(args.n)
    res["n"] = len(pairs)
    res["example"] = pairs[0].to_dict()
    t = {}

    def clock(key, fn):
        s = time.perf_counter()
        v = fn()
        t[key] = round(time.perf_counter() - s, 2)
        print(f"{key}: {t[key]} s", flush=True)
        return v

    # nodes
    atp = clock("atp", lambda: attribution_patching(lm, pairs=pairs))
    star = clock("atp_star", lambda: atp_star(lm, pairs=pairs))
    exn = clock("exact_nodes", lambda: exact_node_patching(lm, pairs=pairs))
    res["metric_clean"], res["metric_corrupted"] = exn.metric_clean, exn.metric_corrupted
    res["nodes"] = {"atp": check_against_exact(atp, exn), "atp_star": check_against_exact(star, exn),
                    "exact_top10": [n["name"] for n in sorted(exn.nodes(), key=lambda n: -abs(n["score"]))[:10]]}
    # edges
    eap = clock("eap", lambda: edge_attribution(lm, pairs, method="eap"))
    eig = clock("eap_ig", lambda: edge_attribution(lm, pairs, method="eap-ig", steps=5))
    mask = torch.zeros_like(eig.valid)
    for r in (eap, eig):
        top = r.ranking()[: args.top]
        mask[top[:, 0], top[:, 1]] = True
    g = torch.Generator().manual_seed(0)
    cand = (eig.valid & ~mask).nonzero()
    pick = cand[torch.randperm(len(cand), generator=g)[: args.sample]]
    mask[pick[:, 0], pick[:, 1]] = True
    exe = clock("exact_edges", lambda: exact_edge_patching(lm, pairs, mask))
    res["edges"] = {"total": eig.n_edges, "checked": int(mask.sum()), "eap": check_edges(eap, exe),
                    "eap_ig": check_edges(eig, exe)}
    # faithfulness
    f_eap = clock("faith_eap", lambda: faithfulness(lm, pairs, eap))
    f_eig = clock("faith_eap_ig", lambda: faithfulness(lm, pairs, eig))
    small = clock("smallest", lambda: smallest_circuit(lm, pairs, eig, 0.8, curve=f_eig))
    checked = int(mask.sum())
    ks = [k for k in (10, 20, 40, 80, checked) if k <= checked]
    f_exact = clock("faith_exact_top", lambda: faithfulness(lm, pairs, exe, ks=ks))
    res["faithfulness"] = {"eap": f_eap.points(), "eap_ig": f_eig.points(), "exact_top_of_checked": f_exact.points(),
                           "smallest_eap_ig_0.8": None if small is None else len(small),
                           "smallest_eap_ig_0.8_value": None if small is None else small.info["faithfulness"],
                           "smallest_eap_0.8_grid": f_eap.smallest(0.8),
                           "smallest_eap_ig_0.8_grid": f_eig.smallest(0.8)}
    cands = torch.zeros_like(eig.valid)
    top = eig.ranking()[: args.greedy]
    cands[top[:, 0], top[:, 1]] = True
    greedy = clock("greedy", lambda: greedy_circuit(lm, pairs, tau=args.tau, candidates=cands))
    k = max(1, len(greedy))
    ev = _Evaluator(lm, pairs, "logit_diff", -1, "corrupted", 1024)
    same = ev(torch.stack([Circuit.top(lm, eig, k).edge_mask(ev.graph), Circuit.top(lm, eap, k).edge_mask(ev.graph),
                           Circuit.top(lm, eig, args.greedy).edge_mask(ev.graph)]))
    res["greedy"] = {"candidates": args.greedy, "tau": args.tau, "edges": len(greedy),
                     "faithfulness": greedy.info["faithfulness"],
                     "start_faithfulness": greedy.info["start_faithfulness"],
                     "eap_ig_same_size": float(same[0]), "eap_same_size": float(same[1]),
                     "eap_ig_candidates": float(same[2])}
    # routes
    def routes():
        comps = set()
        for p in pairs:
            comps |= information_flow_routes(lm, p.clean, tau=0.04).components()
        return comps
    comps = clock("routes", routes)
    rec = route_recovery_from(comps, res["nodes"]["exact_top10"])
    res["routes"] = {"tau": 0.04, "components": len(comps), **rec}
    res["seconds"] = t
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    # pictures
    img = Path(args.img)
    img.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8), layout="constrained")
    for curve, label in ((f_eap, "EAP"), (f_eig, "EAP-IG (5 steps)"), (f_exact, "exact (top of checked edges)")):
        pts = [p for p in curve.points() if p["k"] > 0]
        ax.plot([p["k"] for p in pts], [p["value"] for p in pts], "o-", markersize=3, label=label)
    ax.axhline(0.8, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(f"edges kept (of {eig.n_edges})")
    ax.set_ylabel("faithfulness")
    ax.set_title(f"{args.model} · {args.task.upper()} · {len(pairs)} pairs", fontsize=10)
    ax.legend(fontsize=8)
    fig.savefig(img / f"circuits-{args.task}-faithfulness.png", dpi=110)
    if small is not None:
        c = Circuit.top(lm, eig, min(len(small), 60))
        c.draw().savefig(img / f"circuits-{args.task}-circuit.png", dpi=110)
    fig, ax = plt.subplots(figsize=(4.2, 4.0), layout="constrained")
    a = {n["name"]: n["score"] for n in atp.nodes()}
    x = {n["name"]: n["score"] for n in exn.nodes()}
    ax.scatter([x[k] for k in x], [a[k] for k in x], s=8)
    lim = max(abs(v) for v in list(a.values()) + list(x.values()))
    ax.plot([-lim, lim], [-lim, lim], color="grey", linewidth=0.6)
    ax.set_xlabel("exact patching effect")
    ax.set_ylabel("AtP estimate")
    ax.set_title(f"nodes · {args.task.upper()}", fontsize=10)
    fig.savefig(img / f"circuits-{args.task}-atp-vs-exact.png", dpi=110)
    print(json.dumps({k: v for k, v in res.items() if k not in ("machine",)}, indent=1)[:3000])


def route_recovery_from(components: set, circuit_nodes: list[str]) -> dict:
    """``route_recovery`` for a set of components (the union over prompts)."""

    class _R:
        per_head = True

        def components(self):
            return components

    return route_recovery(_R(), circuit_nodes)


if __name__ == "__main__":
    main()
