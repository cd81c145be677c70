"""``lenscope dict train``: train sparse dictionaries (SAEs, transcoders, skip transcoders) from a model's activations
streamed over a text, or from a tensor file (:mod:`lenscope.features.dictionaries.train`)."""

from __future__ import annotations

import typer

from ..models.dictionaries import kinds as kinds
from .common import MODEL_HELP, handle_errors, load_model, print_json
from .options import DTYPE_OPTION, JSON_SUMMARY_OPTION, MAX_MEMORY_OPTION, RESUME_OPTION, SEED_OPTION, SEQ_LEN_OPTION


def register(app: typer.Typer) -> None:
    @app.command("train")
    @handle_errors
    def train_cmd(
        out: str = typer.Option(..., "--out", help="Folder for the dictionary (a subfolder per site when several) and "
                                                   "its checkpoint."),
        model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP + " Needed with --data."),
        site: str = typer.Option(None, "--site", help="Site(s) to train on, comma-separated: resid_pre.5, "
                                                      "resid_post.5, attn_out.5, mlp_out.5; NAME.* for every block. "
                                                      "A transcoder is named by the mlp_out it replaces."),
        kind: str = typer.Option(kinds.DEFAULT, "--kind", help=kinds.kind_help()),
        transcoder: bool = typer.Option(False, "--transcoder", help="Transcoders: MLP input -> MLP output."),
        skip: bool = typer.Option(False, "--skip", help="Skip transcoders: a transcoder plus a linear skip path."),
        clt: bool = typer.Option(False, "--clt", "--cross-layer",
                                 help="One cross-layer transcoder over every block (--layers: the first N): each "
                                      "block's latents read its MLP input and write its MLP output and every later "
                                      "one's; from --data only, no --site."),
        layers: int = typer.Option(None, "--layers", help="With --clt: the blocks it covers, from block 0 (default: "
                                                          "all)."),
        width: int = typer.Option(..., "--width", help="Latents of each dictionary."),
        k: int = typer.Option(..., "--k", help=kinds.k_help()),
        data: str = typer.Option(None, "--data", help="Text to stream through the model (a file or a folder of .txt "
                                                      "/ .txt.gz files, e.g. ../shared/data/corpus); its training "
                                                      "part (1 document in 20 is held out)."),
        activations: str = typer.Option(None, "--activations",
                                        help="A safetensors file of activations instead: its one tensor or the one "
                                             "named 'activations', (n, d), or (n, 2, d) input/output pairs."),
        tokens: int = typer.Option(None, "--tokens", help="Token budget (default 1,000,000 without --max-minutes; "
                                                          "with it, the most to use)."),
        max_minutes: float = typer.Option(None, "--max-minutes", help="Time budget in minutes: the number of steps "
                                                                      "follows from the speed of the first steps."),
        batch_size: int = typer.Option(4096, "--batch-size", help="Tokens per optimizer step."),
        buffer: int = typer.Option(None, "--buffer", help="Rows in the shuffle buffer (default: 65,536, fewer when "
                                                          "many sites share it, to stay under 1 GiB)."),
        seq_len: int = SEQ_LEN_OPTION,
        forward_batch: int = typer.Option(8, "--forward-batch", help="Sequences per forward pass of the model."),
        lr: float = typer.Option(None, "--lr", help="Peak learning rate (default: SAEs 2e-4 * sqrt(16384 / width); "
                                                   "transcoders and skip transcoders 8e-3 * sqrt(4608 / width))."),
        dead_after: int = typer.Option(200_000, "--dead-after", help="Tokens without firing after which a latent is "
                                                                     "dead (revived by the auxiliary loss)."),
        checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="Save a checkpoint every N steps."),
        precision: str = typer.Option("auto", "--precision", help="Encoder and decoder matmuls: auto "
                                                                  "(bfloat16 only where the CPU runs it natively), "
                                                                  "bf16 or fp32."),
        resume: bool = RESUME_OPTION,
        max_memory: str = MAX_MEMORY_OPTION,
        dtype: str = DTYPE_OPTION,
        seed: int = SEED_OPTION,
        as_json: bool = JSON_SUMMARY_OPTION,
    ):
        """Train sparse dictionaries on a model's activations (--data) or on a tensor file (--activations)."""
        from ..distributed import ddp
        from ..errors import InputError
        from ..features.dictionaries.train import DictSettings, train
        from ..memory import parse_size

        if transcoder and skip:
            raise InputError("give --transcoder or --skip, not both")
        if clt:
            _check_clt(skip, site, data, activations, model)
        elif layers is not None:
            raise InputError("--layers is for --clt (the blocks a cross-layer transcoder covers)")
        if (data is None) == (activations is None):
            raise InputError("give exactly one of --data (text streamed through --model) and --activations (a file)")
        if data is not None and not clt and (model is None or site is None):
            raise InputError("--data needs --model and --site")
        if precision not in ("auto", "bf16", "fp32"):
            raise InputError(f"--precision is auto, bf16 or fp32, not {precision!r}")
        role = "skip" if skip else "transcoder" if transcoder or clt else "sae"
        limit = parse_size(max_memory) if max_memory is not None else None
        n_sites = max(1, len(site.split(","))) if site else 1
        lm = load_model(model, dtype=dtype) if model is not None else None
        if clt:
            n_sites = layers or lm.anatomy.n_layers  # (its inputs and targets: twice, as a transcoder's)
        if lm is not None and site and "*" in site:
            n_sites = len(site.split(",")) - site.count("*") + site.count("*") * lm.anatomy.n_layers
        d = lm.anatomy.d_model if lm is not None else 1024
        per_row = (2 if role != "sae" else 1) * n_sites * d * 4
        buf = buffer or max(batch_size, min(65_536, (1 << 30) // per_row // batch_size * batch_size))
        s = DictSettings(kind=kind, width=width, k=k, role=role,
                         tokens=tokens if tokens is not None else (0 if max_minutes else 1_000_000),
                         max_minutes=max_minutes, batch_size=batch_size, buffer=buf, lr=lr, seed=seed,
                         dead_after=dead_after, checkpoint_every=checkpoint_every,
                         bf16={"auto": None, "bf16": True, "fp32": False}[precision])
        dist = ddp.from_env()
        if clt:
            from ..features.dictionaries.train_clt import train_clt

            C = train_clt(s, lm=lm, data=data, n_layers=layers, seq_len=seq_len, forward_batch=forward_batch,
                          out=out, resume=resume, dist=dist, max_memory=limit)
            if as_json and dist.main and C is not None:
                tr = C.info["training"]
                print_json({"out": out, "clt": True, "layers": C.n_layers, "kind": kind, "width": width, "k": k,
                            "tokens": tr["tokens"], "seconds": tr["seconds"], "tokens_per_s": tr["tokens_per_s"],
                            "precision": tr["precision"]["matmul_dtype"], "final": tr["final"]})
            return
        dicts = train(s, lm=lm, sites=site, data=data, activations=activations, seq_len=seq_len,
                      forward_batch=forward_batch, out=out, resume=resume, dist=dist, max_memory=limit)
        if as_json and dist.main and dicts:
            tr = [D.info["training"] for D in dicts]
            print_json({"out": out, "kind": kind, "role": role, "width": width, "k": k,
                        "tokens": tr[0]["tokens"], "seconds": tr[0]["seconds"], "tokens_per_s": tr[0]["tokens_per_s"],
                        "precision": tr[0]["precision"]["matmul_dtype"],
                        "dictionaries": [{"site": D.site, **t["final"], "scale_in": t["scale_in"],
                                          "scale_out": t["scale_out"]} for D, t in zip(dicts, tr)]})


def _check_clt(skip: bool, site, data, activations, model) -> None:
    """``--clt``'s bad combinations, one line each."""
    from ..errors import InputError

    if skip:
        raise InputError("--clt trains a cross-layer transcoder without a skip path: drop --skip")
    if site:
        raise InputError("--clt covers every block's MLP (its input ln_mlp.out and output mlp_out): drop --site "
                         "(--layers N: the first N blocks)")
    if activations is not None or data is None or model is None:
        raise InputError("--clt trains from a model's activations streamed over a text: give --model and --data "
                         "(not --activations)")
