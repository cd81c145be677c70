"""``lenscope mixing``: norm-based context-mixing maps of one text, or (``lenscope mixing study``) the
paper's analyses over a dataset."""

from __future__ import annotations

import typer

from .common import ModelChoice, command, emit, fail, print_json
from .options import JSON_OPTION, MODEL_OPTION
from .sweeps import ray_address_option, ray_option, ray_target, workers_option

SCOPE_HELP = ("Pre-LN decoders: attention, attn_2020, attn, atb, atbln, atblnff, atblnffres, atblnffres_nextln; "
              "Post-LN encoders: attention, attn_2020, attn, atb, atbff, atbffres, atbffresln "
              "(default: the whole layer, atblnffres / atbffresln)")


def register(app: typer.Typer) -> None:
    @command(app, "mixing", model=True)
    def mixing_cmd(
        text: str = typer.Argument(..., help="The text to analyse, or `study` to run the analyses over --data."),
        model: ModelChoice = MODEL_OPTION,
        scope: str = typer.Option(None, "--scope", "-s", help=SCOPE_HELP),
        layer: int = typer.Option(None, "--layer", "-l", help="One layer only (negative counts from the end)."),
        png: str = typer.Option(None, "--png", help="Draw the maps (one panel per layer) to this PNG file."),
        save: str = typer.Option(None, "--save", help="Save the maps (.safetensors) to reload later."),
        numeric_steps: int = typer.Option(None, "--numeric-ig", help="Split the FF block with the paper's numeric "
                                          "IG (this many midpoint steps) instead of the closed form."),
        data: str = typer.Option(None, "--data", help="study: sst2, wikitext, or a text file (one sentence per line)."),
        limit: int = typer.Option(None, "--limit", help="study: use the first N sentences."),
        out: str = typer.Option(None, "--out", help="study: folder for records, tables and figures."),
        resume: bool = typer.Option(False, "--resume", help="study: continue an interrupted run in --out."),
        max_tokens: int = typer.Option(64, "--max-tokens", help="study: skip sentences longer than this."),
        ray: bool = ray_option(),
        ray_address: str = ray_address_option(),
        workers: int = workers_option(),
        as_json: bool = JSON_OPTION,
    ):
        """Norm-based context-mixing maps ||F_i(x_j)|| of TEXT per layer and scope (Kobayashi et al.)."""
        if text == "study":
            return _study(model, data, limit, out, resume, max_tokens, as_json, ray_target(ray, ray_address), workers)
        for opt, v in (("--data", data), ("--limit", limit), ("--out", out), ("--ray", ray or None)):
            if v is not None:
                fail(f"{opt} belongs to `lenscope mixing study`; for one text use --scope/--layer/--png")
        if numeric_steps is not None and numeric_steps < 1:
            fail("--numeric-ig must be at least 1")
        from ..mixing.maps import context_mixing

        lm = model.load()
        if scope is None:
            scope = "atbffresln" if lm.anatomy.placement == "post" else "atblnffres"
        res = context_mixing(lm, text, scope, layers=layer, numeric_steps=numeric_steps)[scope]
        if emit(res, png=png, save=save, as_json=as_json):
            return
        from rich.console import Console

        con = Console()
        con.print(f"{lm.name}: scope {scope}, {len(res.tokens)} tokens, layers {res.layers[0]}..{res.layers[-1]}"
                  f"  completeness error {res.completeness_error:.1e}")
        for k, l in enumerate(res.layers):
            m = res.maps[k].clone()
            m.fill_diagonal_(-1)
            i, j = divmod(int(m.argmax()), m.shape[1])
            con.print(f"  layer {l:>2}: strongest mixing {res.tokens[j]!r} → {res.tokens[i]!r} "
                      f"({float(res.maps[k, i, j]):.3g}); mean self share "
                      f"{float((res.maps[k].diagonal() / res.maps[k].sum(-1).clamp_min(1e-12)).mean()):.2f}")
        if png:
            con.print(f"plot saved to {png}")


def _study(model: ModelChoice, data, limit, out, resume, max_tokens, as_json, ray=None, workers=2):
    from ..sweeps.mixing_study import load_sentences, mixing_study

    if data is None:
        fail("`lenscope mixing study` needs --data (sst2, wikitext or a file with one sentence per line)")
    if resume and out is None:
        fail("--resume needs the --out folder of the interrupted study")
    if max_tokens < 3:
        fail("--max-tokens must be at least 3")
    name, sents = load_sentences(data, limit)
    lm = model.load()
    st = mixing_study(lm, sents, out, dataset=name, resume=resume, max_tokens=max_tokens, ray=ray, workers=workers)
    if out:
        st.save(out)
    if as_json:
        from ..results import finite_json

        print_json(finite_json(st.to_dict()))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"{lm.name} on {name}: {st.n_sentences} sentences ({st.skipped} skipped)")
    t = Table()
    for c in ("layer", f"CC {st.info['pre_ff']}→{st.info['post_ff']}", "CC masked γ", "‖FF‖", "‖bypass‖",
              "corr(γ, |FF|)", "top FF-amp pair"):
        t.add_column(c, justify="right")
    for l in range(len(st.ff_norm)):
        top = st.top_pairs[l][0] if st.top_pairs[l] else None
        pair = f"{top['token_j']!r}→{top['token_i']!r}" if top else ""
        f = (lambda v: "n/a" if v is None else f"{v:.3f}")
        t.add_row(str(l), f(st.cc_ff[l]), f(st.cc_ff_masked[l]), f"{st.ff_norm[l]:.2f}", f"{st.bypass_norm[l]:.2f}",
                  f(st.gamma_pearson[l]), pair)
    con.print(t)
    if out:
        con.print(f"tables and figures in {out}")
