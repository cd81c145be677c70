"""The page of ``lenscope serve``: the report's views computed on demand, for exploring one prediction.

:func:`app_html` writes the HTML shell only: no inline script or style (the server's Content-Security-Policy
allows neither). Scripts and styles are files served under ``static/``: the report's own ``core.js`` and
``report.css``, every view's script (its folder's, :mod:`lenscope.viz.views`: one implementation of every view,
shared with the static report) plus ``app.js`` and ``app.css`` from ``assets/`` here. ``app.js`` asks the server's
API (``api/models``, ``api/analyze``,
``api/head``, ``api/token``, ``api/report``; a translation model's ``api/alignment``) and draws each view with
``LS.drawSection`` as its answer arrives.
Nothing here computes a method.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path

from .. import views as _views

__all__ = ["app_html", "asset_names", "asset_path", "default_views", "GROUPS"]

# A server passes the report's titles and blurbs (``views=`` of app_html: ``[{"key", "title", "blurb"}]`` from its
# sections); without them the cards take the views' own words (default_views()).
# the requests the page makes for one input, in this order, each drawn as it arrives: the views that share the
# one trace first, then each slower view on its own (the circuit only with a corrupted prompt)
GROUPS = (("prediction", "trajectory", "components"), ("attribution",), ("mixing",), ("flow",), ("circuit",))
# asked for too, each on its own, when the server has sparse dictionaries (lenscope serve --dict; the graph needs
# transcoders, else its card says so)
FEATURES = ("features", "graph")
# the one view of a translation (encoder-decoder) model, asked for with its source (api/alignment)
ALIGNMENT = "alignment"
_ASKED = {k for g in GROUPS for k in g} | set(FEATURES) | {ALIGNMENT}


def default_views() -> tuple[dict, ...]:
    """The views the page asks for by default, in the report's order, with their titles."""
    return tuple({"key": k, "title": v.title} for k, v in _views.registry().items() if k in _ASKED)


def _report_assets():
    return resources.files("lenscope.viz.report").joinpath("assets")


def _app_assets():
    return resources.files(__package__).joinpath("assets")


def asset_names() -> dict[str, list[str]]:
    """The files the page loads from ``static/``: ``{"report": [...], "app": [...]}`` (what a server serves): the
    report's shared files and every view's script, and the app's own."""
    scripts = [f"{k}.js" for k, v in _views.registry().items() if v.script()]
    return {"report": sorted({p.name for p in _report_assets().iterdir() if p.name.endswith((".js", ".css"))}
                             | set(scripts)),
            "app": sorted(p.name for p in _app_assets().iterdir() if p.name.endswith((".js", ".css")))}


def asset_path(name: str):
    """Where the file ``name`` of :func:`asset_names` lies (a view's script: its folder), else None."""
    view = _views.get(name.removesuffix(".js")) if name.endswith(".js") else None
    if view is not None and view.script():
        return view.folder / name
    for d in (_report_assets(), _app_assets()):
        p = d.joinpath(name)
        if p.is_file():
            return p
    return None


def _plugin(key: str) -> bool:
    """Whether view ``key`` comes from a plug-in folder (not one of lenscope's own)."""
    view = _views.get(key)
    return view is not None and view.folder is not None and view.folder.parent != Path(_views.__file__).parent


def _card(view: dict) -> str:
    key = html.escape(view["key"])
    blurb = view.get("blurb")
    # shown when a corrupted prompt is given (the circuit), or a translation model chosen (the alignment)
    hidden = " hidden" if view["key"] in ("circuit", ALIGNMENT) else ""
    return (f'<section class="card" id="sec-{key}" data-section="{key}" data-state="idle"{hidden}>'
            f'<h2>{html.escape(view["title"])}</h2>'
            + (f'<p class="blurb">{html.escape(blurb)}</p>' if blurb else "")
            + '<div class="status" role="status"></div><div class="body"></div></section>')


def app_html(*, models: list[str], default: str, token_required: bool, max_tokens: int,
             views: list[dict] | None = None, features: bool = False, seq2seq=()) -> str:
    """The app's page: a prompt box, target, foil and corrupted-prompt inputs, a model picker over ``models``
    (``default`` selected unless the URL names another), one card per view, and the head / token panel.

    ``token_required``: the server wants ``Authorization: Bearer``; the page takes the token from its URL
    (``?token=T``) and says so when it is missing. ``max_tokens``: the server's limit, shown in the prompt box.
    ``views``: ``[{"key", "title", "blurb"?}]`` (the report's sections) for the cards' titles; only the views the
    page requests (:data:`GROUPS`) and a plug-in's views (:func:`~lenscope.viz.views.add_folder`, each asked for on its
    own) get a card, in this order. ``features``: the server has sparse dictionaries, so
    the page asks for the features view too (click a token: its active features; click a feature: its card) and the
    attribution graph (``api/supernode`` keeps the supernodes grouped on it). ``seq2seq``: the names among ``models``
    of encoder-decoder (translation) models: with one chosen, the page shows a source field (the text is the target)
    and optional gold links, and asks ``api/alignment`` for the alignment view, its only card."""
    given = {v["key"]: v for v in (views or ())}
    shown = [given.get(v["key"], v) for v in default_views()]
    order = [v for v in (views or ()) if v["key"] in _ASKED]
    if order:  # the server's order, then any default view it did not name
        shown = order + [v for v in shown if v["key"] not in {o["key"] for o in order}]
    if not features:
        shown = [v for v in shown if v["key"] not in FEATURES]
    plugins = [v for v in (views or ()) if v["key"] not in _ASKED and _plugin(v["key"])]
    shown += plugins
    groups = GROUPS + (tuple((k,) for k in FEATURES) if features else ()) + tuple((v["key"],) for v in plugins)
    names = asset_names()
    scripts = ["core.js"] + [n for n in names["report"] if n.endswith(".js") and n != "core.js"] + ["app.js"]
    opts = "".join(f'<option value="{html.escape(m)}"{" selected" if m == default else ""}>{html.escape(m)}</option>'
                   for m in models)
    toc = "".join(f'<a href="#sec-{html.escape(v["key"])}" data-toc="{html.escape(v["key"])}"'
                  f'{" hidden" if v["key"] in ("circuit", ALIGNMENT) else ""}>{html.escape(v["title"])}</a>'
                  for v in shown)
    e = html.escape
    return "".join([
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n',
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n',
        '<meta name="generator" content="lenscope">\n<title>lenscope</title>\n',
        '<link rel="icon" href="data:,">\n',
        '<link rel="stylesheet" href="static/report.css">\n<link rel="stylesheet" href="static/app.css">\n',
        '</head>\n',
        f'<body class="app" data-default="{e(default)}" data-token-required="{"1" if token_required else "0"}" '
        f'data-max-tokens="{int(max_tokens)}" data-groups="{";".join(",".join(g) for g in groups)}" '
        f'data-seq2seq="{e(json.dumps(list(seq2seq)))}">\n',
        '<header class="top app-top">\n<h1>lenscope <span class="sub">explore a prediction</span></h1>\n',
        '<form id="ask" autocomplete="off" spellcheck="false">\n',
        f'<div class="askrow"><label class="field">model <select id="model" name="model">{opts}</select></label>',
        '<span id="model-info" class="meta"></span></div>\n',
        f'<textarea id="text" name="text" rows="2" placeholder="a prompt (at most {int(max_tokens)} tokens); '
        'Enter runs, Shift+Enter starts a new line"></textarea>\n',
        '<div class="askrow" id="pair-row" hidden>',
        '<label class="field grow">source <input id="source" name="source" placeholder="the source sentence; the '
        'text above is its translation (the target)"></label>',
        '<label class="field grow">gold links <input id="gold" name="gold" placeholder="optional: sure links '
        'i-j i-j (source word-target word, 0-based); possible ones with p: p2-3"></label></div>\n',
        '<div class="askrow">',
        '<label class="field">target <input id="target" name="target" placeholder="the top prediction"></label>',
        '<label class="field">foil <input id="foil" name="foil" placeholder="the runner-up"></label>',
        '<label class="field grow">corrupted prompt <input id="corrupted" name="corrupted" '
        'placeholder="optional: same length, turns on patching and the circuit"></label>',
        '<button type="submit" id="run">Run</button>',
        '<button type="button" id="save" disabled>Save as report</button></div>\n',
        '</form>\n<div id="msg" class="msg" role="alert" hidden></div>\n</header>\n',
        f'<nav class="toc"><a href="#sec-run">Run</a>{toc}</nav>\n<main id="views">\n',
        '<section class="card" id="sec-run" data-state="idle"><h2>Run</h2>',
        '<p class="blurb">Type a prompt and press Enter. Click a head in the direct logit attribution to open it; '
        'click a token to see every attribution method for the prediction there; click a bar of the prediction '
        'to make it the target.</p><div class="body"></div></section>\n',
        "\n".join(_card(v) for v in shown),
        '\n</main>\n<aside id="panel" class="panel-side" hidden><div class="panel-head"><h2 id="panel-title"></h2>',
        '<button type="button" id="panel-close" title="close (Esc)">\u00d7</button></div>',
        '<div class="status" id="panel-status" role="status"></div><div id="panel-body"></div></aside>\n',
        '<footer>lenscope serve: every view computed on this machine; this page fetches nothing from elsewhere.'
        ' Hover any cell for its numbers.</footer>\n',
        "".join(f'<script src="static/{e(s)}"></script>\n' for s in scripts),
        "</body>\n</html>\n",
    ])
