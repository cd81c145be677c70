"""A self-contained page showing context attributions: the input tokens coloured by score, a switch between
methods, and a layer selector for methods with per-layer scores. No network at view time; token strings
enter the page as escaped JSON and are placed with ``textContent`` only."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from .html import render_page, write_page


def explanation_html(results, path: str | Path | None = None, title: str | None = None) -> str:
    """The page for one or several :class:`~lenscope.attribution.explanation.Explanation` of the same text;
    written to ``path`` when given. Returns the HTML."""
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    if not results:
        raise InputError("no explanations given")
    first = results[0]
    if title is None:
        title = f"Context attribution · {first.model} · {first.what()}"
    payload = {"title": title, "explanations": [r.to_dict() for r in results]}
    page = render_page(_CSS, title, "lenscope-explain", payload, _SCRIPT)
    if path is not None:
        write_page(page, path)
    return page


_CSS = """
:root { --bg:#f6f7f9; --card:#fff; --ink:#1d2230; --muted:#6b7280; --line:#e3e6eb; --accent:#3b5bdb; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font:13px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif; }
header { padding:18px 26px 4px; }
h1 { font-size:19px; font-weight:650; margin:0 0 4px; }
.sub { color:var(--muted); font-size:12px; }
.bar { display:flex; flex-wrap:wrap; gap:12px 22px; align-items:center; padding:10px 26px; }
.seg { display:inline-flex; border:1px solid var(--line); border-radius:8px; overflow:hidden; background:var(--card); }
.seg button { font:inherit; font-size:12.5px; border:0; background:transparent; padding:5px 12px; cursor:pointer;
  color:var(--muted); border-right:1px solid var(--line); }
.seg button:last-child { border-right:0; }
.seg button.on { background:var(--accent); color:#fff; }
.label { color:var(--muted); font-size:12px; margin-right:6px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:12px; margin:8px 26px 18px;
  padding:16px 18px; box-shadow:0 1px 2px rgba(16,24,40,.04); }
.tokens { font-family:ui-monospace,"DejaVu Sans Mono",Menlo,monospace; font-size:15px; line-height:2.1; }
.tok { padding:3px 2px; border-radius:4px; white-space:pre; cursor:default; }
.tok.query { outline:2px solid #111827; outline-offset:1px; }
.tok.future { color:#b0b5bf; }
.meta { color:var(--muted); font-size:12px; margin-top:10px; }
.meta b { color:var(--ink); font-weight:600; }
.legend { display:inline-flex; gap:8px; align-items:center; color:var(--muted); font-size:11.5px; }
.ramp { width:180px; height:11px; border-radius:3px; border:1px solid rgba(0,0,0,.08); }
table.top { border-collapse:collapse; margin-top:10px; font-size:12px; }
table.top td { padding:2px 10px 2px 0; font-variant-numeric:tabular-nums; }
table.top td.t { font-family:ui-monospace,"DejaVu Sans Mono",Menlo,monospace; white-space:pre; }
#tip { position:fixed; pointer-events:none; display:none; background:#111827; color:#f3f4f6; border-radius:8px;
  padding:7px 10px; font-size:12px; z-index:10; }
"""

# the body of the page's function: render_page wraps it and defines DATA
_SCRIPT = r"""
  var EX = DATA.explanations, cur = 0, layer = -1;
  function el(tag, cls, text) { var e = document.createElement(tag); if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text; return e; }
  function show(t) { return t.replace(/\n/g, "\u21b5"); }
  function mix(a, b, f) { return a.map(function (x, i) { return Math.round(x + (b[i] - x) * f); }); }
  var WHITE = [255, 255, 255], BLUE = [37, 99, 235], RED = [192, 57, 43];
  function colour(v, vmax, signed) {
    if (v === null || !isFinite(v) || vmax <= 0) return "transparent";
    var f = Math.min(1, Math.abs(v) / vmax) * 0.85;
    var c = mix(WHITE, (signed && v < 0) ? RED : BLUE, f);
    return "rgb(" + c.join(",") + ")";
  }
  var tip = el("div"); tip.id = "tip"; document.body.appendChild(tip);
  var head = el("header"); head.appendChild(el("h1", "", DATA.title));
  head.appendChild(el("div", "sub", "Each input token is coloured by how much it contributes to the prediction " +
    "at the outlined position. Blue raises the target (or the score), red lowers it."));
  document.body.appendChild(head);
  var bar = el("div", "bar"); document.body.appendChild(bar);
  var mseg = el("div", "seg"); var mlab = el("span", "label", "method"); var mw = el("span");
  mw.appendChild(mlab); mw.appendChild(mseg);
  bar.appendChild(mw);
  var lw = el("span"); lw.appendChild(el("span", "label", "layer"));
  var sel = el("select"); lw.appendChild(sel); bar.appendChild(lw);
  var legend = el("span", "legend"); bar.appendChild(legend);
  var card = el("div", "card"); document.body.appendChild(card);
  var toks = el("div", "tokens"); card.appendChild(toks);
  var meta = el("div", "meta"); card.appendChild(meta);
  var top = el("table", "top"); card.appendChild(top);
  EX.forEach(function (e, i) {
    var b = el("button", "", e.method); b.dataset.method = e.method;
    b.addEventListener("click", function () { cur = i; layer = -1; render(); });
    mseg.appendChild(b);
  });
  sel.addEventListener("change", function () { layer = parseInt(sel.value, 10); render(); });
  function values(e) { return (layer >= 0 && e.layers) ? e.layers[layer] : e.scores; }
  function render() {
    var e = EX[cur];
    Array.prototype.forEach.call(mseg.children, function (b, i) { b.classList.toggle("on", i === cur); });
    sel.textContent = "";
    var all = el("option", "", "all layers (total)"); all.value = "-1"; sel.appendChild(all);
    if (e.layers) e.layers.forEach(function (_, l) {
      var o = el("option", "", "layer " + l); o.value = String(l); sel.appendChild(o);
    });
    sel.value = String(layer); sel.disabled = !e.layers;
    var v = values(e), vmax = 0, signed = false;
    v.forEach(function (x) { if (x !== null) { vmax = Math.max(vmax, Math.abs(x)); if (x < -1e-12) signed = true; } });
    legend.textContent = "";
    var ramp = el("span", "ramp");
    ramp.style.background = signed
      ? "linear-gradient(90deg," + colour(-1, 1, true) + ",#fff," + colour(1, 1, true) + ")"
      : "linear-gradient(90deg,#fff," + colour(1, 1, false) + ")";
    legend.appendChild(el("span", "", signed ? (-vmax).toPrecision(3) : "0")); legend.appendChild(ramp);
    legend.appendChild(el("span", "", vmax.toPrecision(3)));
    toks.textContent = "";
    e.tokens.forEach(function (t, j) {
      var s = el("span", "tok", show(t));
      s.style.background = colour(v[j], vmax, signed);
      if (j === e.position) s.classList.add("query");
      s.addEventListener("mousemove", function (ev) {
        tip.textContent = "#" + j + " " + JSON.stringify(t) + "  score " +
          (v[j] === null ? "n/a" : v[j].toPrecision(4));
        tip.style.display = "block";
        tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
      });
      s.addEventListener("mouseleave", function () { tip.style.display = "none"; });
      toks.appendChild(s);
    });
    meta.textContent = "";
    var parts = [["model", e.model], ["method", e.method], ["position", String(e.position)]];
    if (e.target !== null) parts.push(["target", JSON.stringify(e.target)]);
    if (e.foil !== null) parts.push(["foil", JSON.stringify(e.foil)]);
    if (e.invariant_error !== null) parts.push(["invariant error", e.invariant_error.toExponential(1)]);
    parts.forEach(function (p, i) { if (i) meta.appendChild(document.createTextNode("  ·  "));
      meta.appendChild(document.createTextNode(p[0] + " ")); meta.appendChild(el("b", "", p[1])); });
    top.textContent = "";
    var order = v.map(function (x, j) { return j; }).filter(function (j) { return v[j] !== null; })
                 .sort(function (a, b) { return v[b] - v[a]; }).slice(0, 5);
    order.forEach(function (j) { var tr = el("tr"); tr.appendChild(el("td", "", "#" + j));
      tr.appendChild(el("td", "t", JSON.stringify(e.tokens[j]))); tr.appendChild(el("td", "", v[j].toPrecision(4)));
      top.appendChild(tr); });
  }
  render();
"""
