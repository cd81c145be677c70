"""Pool ``lenscope lens cbe --out`` results of several runs (e.g. one per state, run in parallel):
fidelity Spearman per lens over all states, one fidelity scatter, one table.

    .venv/bin/python docs/results/lens-analysis/pool_cbe.py docs/results/lens-analysis/cbe-smollm2
"""

import json
import sys
from pathlib import Path

from lenscope.lenses.cbe import CausalBasis, fidelity_spearman
from lenscope.viz.lens_analysis_plots import plot_fidelity, plot_sigma
from lenscope.viz.plots import save_figure

root = Path(sys.argv[1])
groups: dict[str, list[CausalBasis]] = {}
for f in sorted(root.rglob("cbe-*-state*.safetensors")):
    r = CausalBasis.load(f)
    groups.setdefault(r.lens, []).append(r)
for rs in groups.values():
    rs.sort(key=lambda r: r.layer)
rho = {name: fidelity_spearman(rs) for name, rs in groups.items()}
save_figure(plot_fidelity(groups, rho=rho), root / "fidelity-pooled.png")
layers = sorted({r.layer for rs in groups.values() for r in rs})
for layer in layers:
    at_layer = [r for rs in groups.values() for r in rs if r.layer == layer]
    save_figure(plot_sigma(at_layer), root / f"sigma-state{layer}.png")
summary = {name: {"fidelity_spearman_pooled": fidelity_spearman(rs),
                  "states": {r.layer: {"fidelity_spearman": r.fidelity_spearman, "sigma": r.sigma.tolist(),
                                       "model_sigma": r.model_sigma.tolist(), "pca_sigma": r.pca_sigma.tolist(),
                                       "seconds": r.seconds, "model_seconds": r.model_seconds,
                                       "n_tokens": r.n_tokens, "n_model_tokens": r.n_model_tokens,
                                       "reordered": r.reordered}
                             for r in rs}}
           for name, rs in groups.items()}
(root / "pooled.json").write_text(json.dumps(summary, indent=1) + "\n")
lines = ["| lens | state | σ_1 … σ_8 (lens) | model σ (same directions) | PCA σ_1 … σ_8 | fidelity ρ |",
         "| --- | ---: | --- | --- | --- | ---: |"]
for name, rs in groups.items():
    for r in rs:
        f = r.fidelity_spearman
        lines.append(f"| {name} | {r.layer} | {' '.join(f'{x:.3g}' for x in r.sigma.tolist())} | "
                     f"{' '.join(f'{x:.3g}' for x in r.model_sigma.tolist())} | "
                     f"{' '.join(f'{x:.3g}' for x in r.pca_sigma.tolist())} | {'n/a' if f is None else f'{f:.2f}'} |")
    p = fidelity_spearman(rs)
    lines.append(f"| {name} | pooled | | | | {'n/a' if p is None else f'{p:.2f}'} |")
(root / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
