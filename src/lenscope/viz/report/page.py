"""The report as one self-contained HTML page: styles, data and scripts inline; nothing is fetched when viewed.

Server-side HTML is written with ``html.escape`` only; the views are drawn by their scripts (each view's folder,
:mod:`lenscope.viz.views`) from the JSON data block (token strings reach the page through ``textContent`` only);
``assets/`` holds what every page shares (``core.js``, ``report.css``)."""

from __future__ import annotations

import html
from importlib import resources

from .. import views
from ..html import script_json


def _assets():
    return resources.files(__package__).joinpath("assets")


def asset(name: str) -> str:
    """A file of the page: ``core.js`` or ``report.css`` here, or a view's script ``<key>.js`` (its folder's)."""
    view = views.get(name.removesuffix(".js")) if name.endswith(".js") else None
    if view is not None and view.script():
        return view.script()
    return _assets().joinpath(name).read_text(encoding="utf-8")


def section_scripts(keys) -> list[str]:
    """The scripts of the sections ``keys`` and of the views they draw with (:attr:`View.uses
    <lenscope.viz.views.View.uses>`), each once, in order (a key with no view or no script: none)."""
    out = []
    for key in dict.fromkeys(u for k in keys for u in (k, *(getattr(views.get(k), "uses", ())))):
        view = views.get(key)
        if view is not None and view.script():
            out.append(view.script())
    return out


def _fmt(v) -> str:
    if v is None:
        return "–"
    if v == 0 or 1e-3 <= abs(v) < 1e4:
        return f"{v:.4g}"
    return f"{v:.2e}"


def _prompt(meta: dict) -> str:
    text = html.escape(meta["text"])
    if meta.get("source") is not None:  # a translation pair: the source, then the target (the text)
        return (f'<div class="prompt source" title="source">{html.escape(meta["source"])}</div>'
                f'<div class="prompt target" title="target">{text}</div>')
    parts = [f'<div class="prompt">{text}']
    if meta.get("target") is not None:
        parts.append(f' <span class="tgt" title="target">{html.escape(meta["target"])}</span>')
        if meta.get("foil") is not None:
            parts.append(f' <span class="foil" title="foil">{html.escape(meta["foil"])}</span>')
    parts.append("</div>")
    if meta.get("corrupted") is not None:
        parts.append(f'<div class="prompt corrupted" title="corrupted prompt (the circuit view)">'
                     f'{html.escape(meta["corrupted"])}</div>')
    return "".join(parts)


def _run_card(report: dict) -> str:
    m, t = report["meta"], report["timings"]
    v = m["versions"]
    what = ("the model's own top prediction" if m.get("target_is_top_prediction") else "given") \
        if m.get("target") is not None else "no language-model head"
    kind = "encoder-decoder" if m.get("encoder_decoder") else "decoder" if m["causal"] else "encoder"
    if m.get("source") is not None:
        what = "every target token, the reference's own (teacher-forced)"
    rows = [
        ("model", f"{m['model']} · family {m['family']} ({m['model_type']}) · {m['n_layers']} layers · "
                  f"d_model {m['d_model']} · {kind} · {m['placement']}"),
        *([("source tokens", str(len(m["source_tokens"])))] if m.get("source_tokens") is not None else []),
        ("tokens", str(len(m["tokens"]))),
        ("target", f"{m['target']!r} ({what})" + (f" vs foil {m['foil']!r}" if m.get("foil") is not None else "")
         if m.get("target") is not None else what),
        *([("tuned lens", m["lens"] or "none (logit lens only)")] if m.get("source") is None else []),
        *([("corrupted", repr(m["corrupted"]))] if m.get("corrupted") is not None else []),
        ("versions", " · ".join(f"{k} {val}" for k, val in v.items())),
        ("time", " · ".join(f"{k} {val:.2f} s" for k, val in t.items())),
    ]
    kv = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(val))}</td></tr>" for k, val in rows)
    checks = []
    for c in report["checks"]:
        if c["ok"] is None:
            badge = '<span class="badge info">reported</span>'
        elif c["ok"]:
            badge = '<span class="badge ok">ok</span>'
        else:
            badge = '<span class="badge bad">FAILED</span>'
        tol = "–" if c["tolerance"] is None else f"≤ {c['tolerance']:g}"
        checks.append(f"<tr><td>{html.escape(c['section'])}</td><td>{html.escape(c['name'])}</td>"
                      f'<td class="num">{_fmt(c["value"])}</td><td class="num">{tol}</td><td>{badge}</td></tr>')
    ok = report["ok"]
    verdict = ('<span class="badge ok">every check passed</span>' if ok
               else '<span class="badge bad">a check failed: do not trust the views marked FAILED</span>')
    return (f'<section class="card" id="sec-run"><h2>Run</h2><p class="blurb">What ran, and every number that '
            f'says whether a view is exact (each decomposition\'s parts against the real activation or logit).</p>'
            f'<table class="kv">{kv}</table><details{" open" if not ok else ""}><summary>{len(report["checks"])} '
            f'exactness checks</summary> {verdict}<table class="checks"><tr><th>view</th><th>check</th>'
            f'<th>value</th><th>tolerance</th><th></th></tr>{"".join(checks)}</table></details></section>')


def render(report: dict, title: str | None = None) -> str:
    """The page's HTML from a report's plain data: ``meta``, ``sections`` (each ``key``, ``title``, ``blurb`` and
    ``data`` or a ``note``), ``checks``, ``timings`` and ``ok`` (:meth:`lenscope.report.Report.to_dict`). A section
    is drawn by its view's script (``viz/views/<key>/<key>.js``). ``title``: the page's (default: ``lenscope report ·
    MODEL``)."""
    meta = report["meta"]
    title = title or f"lenscope report · {meta['model']}"
    toc = ['<nav class="toc"><a href="#sec-run">Run</a>']
    cards = [_run_card(report)]
    for s in report["sections"]:
        cls = ' class="skipped"' if "note" in s else ""
        toc.append(f'<a href="#sec-{s["key"]}"{cls}>{html.escape(s["title"])}</a>')
        if "note" in s:
            inner = f'<p class="note">{html.escape(s["note"])}</p>'
        else:
            inner = f'<p class="blurb">{html.escape(s["blurb"])}</p><div class="body"></div>'
        cards.append(f'<section class="card" id="sec-{s["key"]}" data-section="{s["key"]}">'
                     f'<h2>{html.escape(s["title"])}</h2>{inner}</section>')
    toc.append("</nav>")
    payload = {"meta": meta, "sections": [{k: v for k, v in s.items() if k in ("key", "data", "note")}
                                          for s in report["sections"]]}
    scripts = [asset("core.js")] + section_scripts(s["key"] for s in report["sections"] if "note" not in s)
    return "".join([
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n',
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n',
        '<meta name="generator" content="lenscope">\n',
        f"<title>{html.escape(title)}</title>\n<style>\n", asset("report.css"), "</style>\n</head>\n<body>\n",
        f'<header class="top"><h1>How {html.escape(meta["model"])} '
        f'{"aligns its translation with the source" if meta.get("source") is not None else "arrives at its prediction"}'
        '</h1>',
        f'<div class="sub">lenscope {html.escape(meta["versions"]["lenscope"])} · {html.escape(meta["created"])}</div>',
        _prompt(meta), "</header>\n", "".join(toc), "\n<main>\n", "\n".join(cards), "\n</main>\n",
        '<footer>Made with lenscope. Self-contained: this file fetches nothing. '
        'Hover any cell for its numbers.</footer>\n',
        '<script type="application/json" id="lenscope-data">', script_json(payload), "</script>\n",
        "".join(f"<script>\n{s}\n</script>\n" for s in scripts),
        "<script>LS.start();</script>\n</body>\n</html>\n",
    ])
