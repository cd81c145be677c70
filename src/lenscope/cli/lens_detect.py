"""``lenscope lens detect``: prompt-injection detection from prediction trajectories."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..errors import InputError
from .common import handle_errors, load_model, print_json
from .options import JSON_OPTION, MODEL_OPTION


@handle_errors
def detect_cmd(
    model: str = MODEL_OPTION,
    lens: list[str] | None = typer.Option(
        None, "--lens", help="'logit' or a tuned-lens directory; repeat to compare lenses on one forward pass "
                             "(default: logit)."),
    limit: int | None = typer.Option(None, "--limit", help="At most N prompts per class (clean, injected); "
                                                          "default: all of SST-2 dev (436 per class)."),
    data: str | None = typer.Option(None, "--data", help="SST-2 dev.tsv (default: sst2/dev.tsv under the shared "
                                                        "data folder, or $LENSCOPE_DATA)."),
    out: str | None = typer.Option(None, "--out", help="Folder for labelled_set.jsonl, features.safetensors, "
                                                      "detect.safetensors, detect.json and two PNGs."),
    seed: int = typer.Option(0, "--seed", help="Seeds the labelled set, the splits, the detectors and the bootstrap."),
    splits: int = typer.Option(
        5, "--splits", help="Random clean train/test splits (AUROC averaged, intervals pooled)."),
    train_fraction: float = typer.Option(0.5, "--train-fraction", help="Share of the clean prompts the detectors "
                                                                       "are fitted on."),
    bootstrap: int = typer.Option(1000, "--bootstrap", help="Bootstrap resamples per split."),
    batch_size: int = typer.Option(16, "--batch-size", help="Prompts per forward pass."),
    as_json: bool = JSON_OPTION,
):
    """Detect injected instructions from lens trajectories at the answer position (clean-only detectors)."""
    from ..detect import detect, load_sst2
    from .lens import get_lens

    if limit is not None and limit < 1:
        raise InputError("--limit must be at least 1")
    examples = load_sst2(data)
    lm = load_model(model)
    specs = list(lens) if lens else ["logit"]
    lenses = {}
    for spec in specs:
        the_lens = get_lens(lm, spec)
        name = the_lens.kind
        if name in lenses:
            name = f"{name}:{Path(spec).name}" if spec != "logit" else name
        if name in lenses:
            raise InputError(f"--lens {spec} is given twice")
        lenses[name] = the_lens
    res, feats, _ = detect(lm, lenses, examples=examples, limit=limit, seed=seed, train_fraction=train_fraction,
                           splits=splits, n_bootstrap=bootstrap, batch_size=batch_size, out=out,
                           progress=not as_json)
    d = res.to_dict()
    if out:
        from ..viz.plots import save_figure

        save_figure(res.plot(), Path(out) / "detect.png")
        save_figure(feats.plot("logp_answers"), Path(out) / "trajectories.png")
        d["out"] = str(Path(out))
        (Path(out) / "detect.json").write_text(json.dumps(d, indent=2) + "\n")
    if as_json:
        print_json(d)
        return
    from rich.console import Console
    from rich.table import Table

    con = Console(emoji=False)
    table = Table(title=f"prompt-injection detection on {lm.name} ({res.n_injected} injected vs {res.n_clean_test} "
                        f"clean held out; detectors fitted on {res.n_clean_train} clean): AUROC "
                        f"[{int(res.level * 100)}% bootstrap interval]")
    table.add_column("features (dim)")
    for det in res.detectors:
        table.add_column(det, justify="right")
    for i, f in enumerate(res.features):
        table.add_row(f"{f} ({res.feature_dims[i]})", *[
            f"{float(res.auroc[i, j]):.3f} [{float(res.auroc_low[i, j]):.3f}, {float(res.auroc_high[i, j]):.3f}]"
            for j in range(len(res.detectors))])
    con.print(table)
    acc = "n/a" if res.clean_accuracy is None else f"{res.clean_accuracy:.1%}"
    fol = "n/a" if res.injection_followed is None else f"{res.injection_followed:.1%}"
    con.print(f"the model's answers: clean accuracy {acc}; injected prompts whose top-1 token starts the target {fol}")
    if out:
        con.print(f"written: {out}")


def register(lens_app: typer.Typer) -> None:
    """Add this module's commands to the ``lens`` group."""
    lens_app.command("detect")(detect_cmd)
