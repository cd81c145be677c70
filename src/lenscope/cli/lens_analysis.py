"""``lenscope lens cbe`` (causal basis extraction and causal fidelity) and ``lenscope lens depth`` (prediction
depth)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import InputError
from .common import command, load_model, print_json
from .options import EVAL_PART_OPTION, JSON_OPTION, MODEL_OPTION, SEQ_LEN_OPTION

LENS_HELP = "'logit', 'patchscope' or a tuned-lens directory; repeat to compare (the first is the main one in JSON)."
LENSES_OPTION = typer.Option(None, "--lens", help=LENS_HELP + " Default: logit.")  # cbe and depth


def _lenses(lm, specs: list[str] | None) -> dict:
    """Lens specs -> {name: Lens}: 'logit' and 'patchscope' by their names, a single tuned lens 'tuned', several by
    their path."""
    from .lens import LENS_NAMES, get_lens

    specs = list(specs or ["logit"])
    dirs = [s for s in specs if s not in LENS_NAMES]
    out = {}
    for s in specs:
        name = s if s in LENS_NAMES else ("tuned" if len(dirs) == 1 else s)
        if name in out:
            raise InputError(f"--lens {s} is given twice")
        out[name] = get_lens(lm, s)
    return out


def _cbe_summary(results: list) -> dict:
    from ..lenses.cbe import fidelity_spearman

    per = [r.to_dict() for r in results]
    d = {"lens": results[0].lens, "layers": per, "fidelity_spearman": fidelity_spearman(results)}
    if len(per) == 1:
        d.update({k: per[0][k] for k in ("layer", "sigma", "model_sigma", "pca_sigma", "pca_variance", "seconds")})
    return d


def register(lens_app: typer.Typer) -> None:
    """Add ``cbe`` and ``depth`` to the ``lens`` group."""
    command(lens_app, "cbe")(cbe_cmd)
    command(lens_app, "depth")(depth_cmd)


def cbe_cmd(
    data: str = typer.Option(..., "--data", help="Plain text file whose tokens the influences average over."),
    layer: list[int] = typer.Option(..., "--layer", "-l", help="State (0 = embeddings); repeat for several."),  # noqa: B008
    model: str = MODEL_OPTION,
    lens: list[str] | None = LENSES_OPTION,
    k: int = typer.Option(8, "--k", help="Number of basis directions."),
    tokens: int = typer.Option(4096, "--tokens", help="Token budget (sequences of --seq-len)."),
    seq_len: int = SEQ_LEN_OPTION,
    part: str = EVAL_PART_OPTION,
    model_tokens: int = typer.Option(1024, "--model-tokens",
                                     help="Tokens for the model-side ablations (causal fidelity); 0: skip them."),
    max_evals: int = typer.Option(40, "--max-evals", help="L-BFGS evaluations per direction (coarse stage)."),
    out: str = typer.Option(None, "--out", help="Directory for result files, plots and cbe.json."),
    as_json: bool = JSON_OPTION,
):
    """Causal basis extraction: the k most influential orthonormal directions of a state for a lens, their
    influence on the model itself (causal fidelity), and the principal components for comparison."""
    from ..lenses.cbe import causal_basis
    from .lens import _sequences

    if k < 1:
        raise InputError(f"--k must be at least 1, not {k}")
    lm = load_model(model)
    lenses = _lenses(lm, lens)
    L = lm.anatomy.n_layers
    for layer_ in layer:
        if not 0 <= layer_ <= L:
            raise InputError(f"--layer {layer_} is outside 0..{L} ({lm.name} has {L} layers)")
    seqs = _sequences(lm, data, part, seq_len, tokens)
    results = {name: [causal_basis(lm, ln, seqs, layer_, k, name=name, model_tokens=model_tokens,
                                   max_evals=max_evals, progress=not as_json) for layer_ in layer]
               for name, ln in lenses.items()}
    names = list(results)
    summary = {"model": lm.name, "k": k, "n_tokens": results[names[0]][0].n_tokens, "data": str(data),
               **_cbe_summary(results[names[0]]), "lenses": {n: _cbe_summary(r) for n, r in results.items()}}
    if out:
        _write_cbe(Path(out), results, summary)
    if as_json:
        print_json(summary)
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    for name, rs in results.items():
        for r in rs:
            t = Table(title=f"{name} lens on {lm.name}, state {r.layer}: influence (nats), {r.n_tokens} tokens")
            for col in ("direction", "σ lens", "σ model", "σ PCA (lens)", "PCA variance"):
                t.add_column(col, justify="right")
            has_model = r.model_sigma.numel() > 0
            for i in range(r.k):
                t.add_row(str(i), f"{float(r.sigma[i]):.4g}",
                          f"{float(r.model_sigma[i]):.4g}" if has_model else "-",
                          f"{float(r.pca_sigma[i]):.4g}", f"{float(r.pca_variance[i]):.4g}")
            con.print(t)
            f = r.fidelity_spearman
            con.print(f"fidelity Spearman (state {r.layer}): {'n/a' if f is None else f'{f:.3f}'}; "
                      f"CBE {r.seconds:.1f} s, model-side ablations {r.model_seconds:.1f} s")
        pooled = summary["lenses"][name]["fidelity_spearman"]
        if len(rs) > 1:
            con.print(f"{name} lens: fidelity Spearman pooled over states: "
                      f"{'n/a' if pooled is None else f'{pooled:.3f}'}")
    if out:
        con.print(f"written: {out}")


def depth_cmd(
    text: str | None = typer.Argument(None, help="A text whose tokens' prediction depth to show."),
    data: list[str] | None = typer.Option(None, "--data", help="Plain text or .jsonl file (BLiMP: "  # noqa: B008
                                             "sentence_good; else a 'text' field); repeat for several data sets."),
    model: str = MODEL_OPTION,
    lens: list[str] | None = LENSES_OPTION,
    tokens: int = typer.Option(2048, "--tokens", help="Token budget per plain text file."),
    seq_len: int = SEQ_LEN_OPTION,
    part: str = typer.Option("eval", "--part", help="Plain text files: eval (last 20%, default), train or all."),
    limit: int = typer.Option(100, "--limit", help="Texts read from each .jsonl file."),
    png: str = typer.Option(None, "--png", help="Write a plot."),
    as_json: bool = JSON_OPTION,
):
    """Prediction depth: the first layer from which a lens's top-1 equals the model's final top-1 and stays
    so; for one TEXT per token, or over --data files with its rank correlation to the model's loss."""
    if (text is None) == (not data):
        raise InputError("give either a TEXT or --data FILE (not both)")
    lm = load_model(model)
    lenses = _lenses(lm, lens)
    if text is not None:
        _text_depth(lm, text, lenses, png, as_json)
    else:
        _data_depth(lm, data, lenses, tokens=tokens, seq_len=seq_len, part=part, limit=limit, png=png,
                    as_json=as_json)


def _text_depth(lm, text: str, lenses: dict, png: str | None, as_json: bool) -> None:
    """``lens depth TEXT``: each token's prediction depth for every lens (a plot, JSON or a table)."""
    from ..lenses.depth import text_depths

    names = list(lenses)
    res = text_depths(lm, text, lenses)
    first = res[names[0]]
    if png:
        from ..viz.lens_analysis_plots import plot_token_depths
        from ..viz.plots import save_figure

        save_figure(plot_token_depths(list(res.values())), png)
    if as_json:
        d = first.to_dict()
        d["lenses"] = {n: {"depth": r.to_dict()["depth"]} for n, r in res.items()}
        print_json(d)
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"prediction depth on {lm.name} ({lm.anatomy.n_layers} layers; '-' = never settles)")
    t.add_column("pos", justify="right")
    t.add_column("token")
    t.add_column("model's top-1")
    for n in names:
        t.add_column(f"{n} depth", justify="right")
    t.add_column("loss", justify="right")
    rows = {n: r.to_dict() for n, r in res.items()}
    for i, tok in enumerate(first.tokens):
        loss = rows[names[0]]["loss"][i]
        t.add_row(str(i), repr(tok)[1:-1], repr(first.predictions[i])[1:-1],
                  *["-" if rows[n]["depth"][i] is None else str(rows[n]["depth"][i]) for n in names],
                  "" if loss is None else f"{loss:.2f}")
    Console().print(t)


def _data_depth(lm, data: list[str], lenses: dict, *, tokens: int, seq_len: int, part: str, limit: int,
                png: str | None, as_json: bool) -> None:
    """``lens depth --data FILE ...``: the depth statistics of every file and pooled over them, for every lens (a
    plot, JSON or a table)."""
    from ..lenses.depth import corpus_depths, read_texts
    from .lens import _sequences

    names = list(lenses)
    per_file = []
    for path in data:
        if str(path).endswith(".jsonl"):
            src = read_texts(path, limit=limit)
        else:
            src = _sequences(lm, path, part, seq_len, tokens)
        per_file.append(corpus_depths(lm, src, lenses, name=Path(path).stem, progress=not as_json))
    if len(per_file) == 1:
        pooled = per_file[0]
    else:
        import torch

        from ..lenses.depth import DepthStats

        pooled = {n: DepthStats(model=lm.name, lens=n, data="+".join(Path(p).stem for p in data),
                                n_layers=lm.anatomy.n_layers,
                                depth=torch.cat([f[n].depth for f in per_file]),
                                loss=torch.cat([f[n].loss for f in per_file])) for n in names}
    if png:
        from ..viz.lens_analysis_plots import plot_depth_stats
        from ..viz.plots import save_figure

        save_figure(plot_depth_stats(list(pooled.values())), png)
    summary = {**pooled[names[0]].to_dict(), "lenses": {n: s.to_dict() for n, s in pooled.items()}}
    if len(per_file) > 1:
        summary["datasets"] = [{"data": f[names[0]].data, **{n: _short(f[n]) for n in names}} for f in per_file]
    if as_json:
        print_json(summary)
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"prediction depth on {lm.name} ({lm.anatomy.n_layers} layers)")
    t.add_column("data")
    t.add_column("tokens", justify="right")
    for n in names:
        t.add_column(f"{n}: mean depth", justify="right")
        t.add_column("never", justify="right")
        t.add_column("ρ(depth, loss)", justify="right")
    rows = [(f[names[0]].data, f) for f in per_file] + ([("all", pooled)] if len(per_file) > 1 else [])
    for label, f in rows:
        cells = [label, str(f[names[0]].n_tokens)]
        for n in names:
            s = f[n]
            cells += [_fmt(s.mean_depth, ".2f"), f"{s.never_settled:.1%}", _fmt(s.spearman_with_loss, ".3f")]
        t.add_row(*cells)
    Console().print(t)


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _short(s) -> dict:
    return {"n_tokens": s.n_tokens, "mean_depth": s.mean_depth, "never_settled": s.never_settled,
            "spearman_with_loss": s.spearman_with_loss, "mean_loss": float(s.loss.double().mean())}


def _write_cbe(out: Path, results: dict, summary: dict) -> None:
    import json

    from ..lenses.cbe import fidelity_spearman
    from ..viz.lens_analysis_plots import plot_fidelity, plot_sigma
    from ..viz.plots import save_figure

    out.mkdir(parents=True, exist_ok=True)
    for name, rs in results.items():
        for r in rs:
            r.save(out / f"cbe-{Path(name).name}-state{r.layer}.safetensors")
    layers = [r.layer for r in next(iter(results.values()))]
    for i, layer in enumerate(layers):
        save_figure(plot_sigma([rs[i] for rs in results.values()]), out / f"sigma-state{layer}.png")
    if any(r.model_sigma.numel() for rs in results.values() for r in rs):
        rho = {name: fidelity_spearman(rs) for name, rs in results.items()}
        save_figure(plot_fidelity(results, rho=rho), out / "fidelity.png")
    (out / "cbe.json").write_text(json.dumps(summary, indent=1))
