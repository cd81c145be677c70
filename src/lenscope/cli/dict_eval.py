"""``lenscope dict eval``: a dictionary (or a folder of them, or a cross-layer transcoder) evaluated on held-out text
beside its baselines (:func:`lenscope.features.dictionaries.evaluate.evaluate_dictionaries`)."""

from __future__ import annotations

import typer

from .common import handle_errors, load_model, print_json
from .options import JSON_OPTION, MAX_MEMORY_OPTION, MODEL_OPTION, SEQ_LEN_OPTION


@handle_errors
def eval_cmd(
    dict_dir: str = typer.Option(..., "--dict", help="A dictionary folder (cfg.json + sae_weights.safetensors), a "
                                                     "folder of them (one per site, as dict train writes several), "
                                                     "or a cross-layer transcoder's folder (clt.json, or "
                                                     "circuit-tracer's layout): one entry per block."),
    data: str = typer.Option(..., "--data", help="Text: a .txt / .txt.gz file or a folder of them (documents "
                                                 "separated by <|endoftext|> lines; one in 20 is held out and only "
                                                 "those are evaluated)."),
    model: str = MODEL_OPTION,
    tokens: int = typer.Option(100_000, "--tokens", help="Held-out tokens to evaluate (dead latents need at least "
                                                         "100,000; with fewer the result says so)."),
    splice_tokens: int = typer.Option(None, "--splice-tokens", help="Of those, the tokens the splices (delta loss, "
                                                                    "loss recovered, KL) run on (default: 16,384; "
                                                                    "a full forward pass per variant)."),
    fit_tokens: int = typer.Option(None, "--fit-tokens", help="Train-part tokens the baselines are fitted on "
                                                              "(default: 32,768)."),
    seq_len: int = SEQ_LEN_OPTION,
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per forward pass."),
    splice_each: bool = typer.Option(True, "--splice-each/--no-splice-each", help="Splice each dictionary alone "
                                     "(with its site zeroed and its baseline: three full forward passes per batch "
                                     "each); --no-splice-each: only the replacement model of several transcoders."),
    baselines: bool = typer.Option(True, "--baselines/--no-baselines", help="PCA (SAEs) / linear (transcoders) "
                                                                            "baselines beside each dictionary."),
    save: str = typer.Option(None, "--save", help="Write the evaluation as JSON (every latent's firing count too)."),
    progress: bool = typer.Option(False, "--progress", help="Progress on stderr."),
    max_memory: str = MAX_MEMORY_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Explained variance, L0, dead latents and, spliced into the model, delta loss, loss recovered and KL, on
    held-out text, beside PCA (SAEs) or linear (transcoders) baselines; the replacement model of several
    transcoders or of a cross-layer transcoder."""
    from ..errors import InputError
    from ..features.dictionaries.evaluate import evaluate_dictionaries
    from ..memory import parse_size
    from ..models.dictionaries.clt import load_transcoders

    for name, v in (("--tokens", tokens), ("--splice-tokens", splice_tokens), ("--fit-tokens", fit_tokens),
                    ("--seq-len", seq_len), ("--batch-size", batch_size)):
        if v is not None and v < 1:
            raise InputError(f"{name} must be at least 1; got {v}")
    limit = parse_size(max_memory) if max_memory is not None else None
    dicts = load_transcoders(dict_dir)
    lm = load_model(model)
    ev = evaluate_dictionaries(lm, dicts, data, tokens=tokens, seq_len=seq_len, batch_size=batch_size,
                               baselines=baselines, fit_tokens=fit_tokens, splice_tokens=splice_tokens,
                               splice_each=splice_each, progress=progress, max_memory=limit)
    if save:
        ev.save(save)
    if as_json:
        print_json(ev.to_dict())
        return
    for line in ev.lines():
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
