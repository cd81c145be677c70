"""``lenscope dict label``: a short deterministic label for every feature of a dictionary (or a folder of them),
computed from the features' cards on held-out text and cached beside the dictionary's files (``labels.json``;
:mod:`lenscope.features.dictionaries.labels`). ``graph``, ``features`` and ``dict show`` show them when present."""

from __future__ import annotations

import typer

from .common import handle_errors, load_model, print_json
from .options import JSON_OPTION, MAX_MEMORY_OPTION, MODEL_OPTION, SEQ_LEN_OPTION


@handle_errors
def label_cmd(
    dict_dir: str = typer.Argument(..., help="A dictionary folder (cfg.json + sae_weights.safetensors, or "
                                             "circuit-tracer's layout), or a folder of them; labels.json goes here."),
    data: str = typer.Option(..., "--data", help="Text: a file or the corpus folder; its held-out part is read."),
    model: str = MODEL_OPTION,
    tokens: int = typer.Option(65_536, "--tokens", help="Held-out tokens to read (one pass for every feature)."),
    top: int = typer.Option(20, "--top", help="Top-activating contexts per feature the label is read from."),
    seq_len: int = SEQ_LEN_OPTION,
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per forward pass."),
    force: bool = typer.Option(False, "--force", help="Compute again even when labels.json holds these labels."),
    explain: int = typer.Option(0, "--explain", help="Also explain N live features of each dictionary, drawn at "
                                "random (--seed), in words written by --explainer from their top contexts, each "
                                "scored by detection (AUROC); kept in labels.json."),
    explainer: str = typer.Option(None, "--explainer", help="The model that writes and judges the explanations "
                                  "(any model lenscope loads; default: --model)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the features drawn for --explain."),
    max_memory: str = MAX_MEMORY_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Label every feature: its most frequent top-activating token and the token its decoder promotes most
    ('<token>' → '<token>'; 'dead' when never active), cached in DIR/labels.json with the data, the tokens read and
    the code version; read back when already there."""
    from ..data.corpus import corpus_files
    from ..errors import InputError
    from ..models.dictionaries.dictionary import load_dictionaries

    for name, v in (("--tokens", tokens), ("--top", top), ("--seq-len", seq_len), ("--batch-size", batch_size)):
        if v is not None and v < 1:
            raise InputError(f"{name} must be at least 1; got {v}")
    dicts = load_dictionaries(dict_dir)
    corpus_files(data)  # a missing file is refused before the model loads
    from ..features.dictionaries.labels import LABELS_FILE, cached_labels

    lm = load_model(model)
    kw = {"seq_len": seq_len} if seq_len is not None else {}
    doc, computed = cached_labels(lm, dicts, dict_dir, data, tokens=tokens, top=top, force=force,
                                  batch_size=batch_size, max_memory=max_memory, progress=not as_json, **kw)
    expl = _explain(lm, dicts, dict_dir, data, doc, explain, explainer, seed, not as_json) if explain else []
    if as_json:
        print_json({**doc, "path": f"{dict_dir.rstrip('/')}/{LABELS_FILE}", "computed": computed,
                    "explained": [r.to_dict() for r in expl]})
        return
    for r in expl:
        typer.echo(f"{r.site}: {len(r.features)} features explained by {r.explainer}, mean detection AUROC "
                   f"{r.mean_detection() if r.mean_detection() is None else round(r.mean_detection(), 3)}")
    for d in dicts:
        rec = doc["dictionaries"][d.site]
        dead = rec["label"].count("dead")
        typer.echo(f"{d.site}: {d.width} features labelled, {dead} dead; e.g. "
                   + "; ".join(f"#{i} {rec['label'][i]}" for i in range(min(3, d.width))))
    typer.echo(f"{'written to' if computed else 'read from'} {dict_dir.rstrip('/')}/{LABELS_FILE} "
               f"({doc['tokens']} held-out tokens of {doc['data']})")


def _explain(lm, dicts, folder, data, doc, n, explainer, seed, progress):
    """``--explain``: explain ``n`` live features of each dictionary (``lenscope.evaluate.explanations``)."""
    from ..errors import InputError
    from ..evaluate.explanations import explain_features, pick_features, save_explanations

    if n < 2:
        raise InputError(f"--explain needs at least 2 features (each one's inactive texts are the others'); got {n}")
    judge = lm if explainer is None or explainer == lm.name else load_model(explainer)
    out = []
    for d in dicts:
        rec = doc["dictionaries"][d.site]
        feats = pick_features(d.width, n, seed, [lab != "dead" for lab in rec["label"]])
        r = explain_features(lm, d, feats, data, judge, seed=seed, labels=[rec["label"][f] for f in feats],
                             progress=progress)
        save_explanations(r, folder)
        out.append(r)
    return out


def register(app: typer.Typer) -> None:
    """Add ``dict label``."""
    app.command("label")(label_cmd)
