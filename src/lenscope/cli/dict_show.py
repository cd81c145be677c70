"""``lenscope dict show``: one feature's card (its top-activating contexts on held-out text, its activation histogram
and density, the tokens its decoder direction promotes and suppresses) as a page and / or JSON."""

from __future__ import annotations

import typer

from .common import MODEL_HELP, handle_errors, print_json


def pick_dictionary(dicts: list, site: str | None, path: str):
    """The one dictionary of a ``--dict`` folder that a command uses: the only one, or the one of ``--site``
    (a folder with several needs it; a one-line InputError otherwise)."""
    from ..errors import InputError
    from ..models.runtime.sites import site_key

    sites = [d.site for d in dicts]
    if site is None:
        if len(dicts) > 1:
            raise InputError(f"{path} holds {len(dicts)} dictionaries ({', '.join(map(str, sites))}): pick one "
                             "with --site")
        return dicts[0]
    try:
        want = "{}.{}".format(*site_key(site))
    except Exception:  # noqa: BLE001 - any unreadable site name gets the same one-line answer
        want = site
    for d in dicts:
        if d.site == want:
            return d
    raise InputError(f"{path} has no dictionary for site {site!r}; it holds {', '.join(map(str, sites))}")


@handle_errors
def dict_show_cmd(
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    dict_dir: str = typer.Option(..., "--dict", help="A dictionary folder (cfg.json + sae_weights.safetensors), or a "
                                                     "folder of them (then give --site)."),
    feature: int = typer.Option(..., "--feature", help="The feature (latent index) to show."),
    data: str = typer.Option(..., "--data", help="Text: a file or the corpus folder; its held-out part is read."),
    site: str = typer.Option(None, "--site", help="Which dictionary of a folder of several (its site, mlp_out.5)."),
    tokens: int = typer.Option(65_536, "--tokens", help="Held-out tokens to read."),
    top: int = typer.Option(20, "--top", help="Top-activating contexts to keep."),
    html: str = typer.Option(None, "--html", help="Write the card's page here."),
    save: str = typer.Option(None, "--save", help="Save the card (.safetensors)."),
    as_json: bool = typer.Option(False, "--json", help="Print the card as JSON."),
):
    """One feature of a dictionary, on held-out text: top contexts, histogram, density, promoted tokens."""
    from ..data.corpus import corpus_files
    from ..errors import InputError
    from ..models.dictionaries.dictionary import load_dictionaries

    if not (html or as_json or save):
        raise InputError("nothing to write: give --html PATH, --json or --save PATH")
    if tokens < 1 or top < 1:
        raise InputError("--tokens and --top must be at least 1")
    d = pick_dictionary(load_dictionaries(dict_dir), site, dict_dir)
    if not 0 <= feature < d.width:
        raise InputError(f"--feature {feature} is outside the dictionary's {d.width} latents (0..{d.width - 1})")
    corpus_files(data)  # a missing file is refused before the model loads
    from ..features.dictionaries.cards import feature_card
    from .common import load_model

    lm = load_model(model)
    card = feature_card(lm, d, feature, data, tokens=tokens, top=top)
    from ..features.dictionaries.labels import labels_for
    from ..viz.views.feature import feature_label

    labels = labels_for(dict_dir)
    label = feature_label(labels, d.site, feature, d.width)  # labels of another width: none
    if html:
        from ..viz.views import standalone

        standalone(card, html, labels=labels)
    if save:
        card.save(save)
    if as_json:
        print_json({**card.to_dict(), "label": label} if label is not None else card.to_dict())
    else:
        typer.echo(f"{d.site} #{feature}" + (f" {label}" if label is not None else "")
                   + f": density {card.density:.4g} ({card.active} of {card.tokens_seen} held-out "
                   f"tokens), max {card.max_activation:.4g}" + (f"; page written: {html}" if html else ""))


def register(app: typer.Typer) -> None:
    """Add ``dict show``."""
    app.command("show")(dict_show_cmd)
