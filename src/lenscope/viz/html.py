"""Self-contained interactive HTML pages (inline CSS and vanilla JavaScript, nothing fetched from anywhere).

The data travel as JSON in a ``<script type="application/json">`` block in which ``<``, ``>``, ``&`` and ``/``
are written as JSON escapes, so no token string (``"</script>"``, ``"<b>"``, a URL) can end the block or
appear as markup; the page builds its grid with ``textContent`` only.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from ..errors import InputError


def script_json(obj) -> str:
    """``obj`` as JSON that is safe inside a ``<script>`` block (no ``<``, ``>``, ``&`` or ``/`` characters)."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    for ch, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("/", "\\/"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def render_page(css: str, title: str, data_id: str, payload, script: str) -> str:
    """One self-contained page: the head with ``title`` and the page's ``css``, the data as safe JSON in a
    ``<script type="application/json" id=data_id>`` block, and the page's own ``script``, run in strict mode
    inside a function where ``DATA`` holds the parsed payload (a leading newline of ``css`` and ``script`` is
    dropped, so both can start on the line after their opening quotes)."""
    return "".join([
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n',
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n',
        f'<meta name="generator" content="lenscope">\n<title>{html.escape(title)}</title>\n<style>\n',
        css.removeprefix("\n"), "</style>\n</head>\n<body>\n",
        f'<script type="application/json" id="{data_id}">', script_json(payload), "</script>\n",
        '<script>\n(function () {\n  "use strict";\n',
        f'  var DATA = JSON.parse(document.getElementById("{data_id}").textContent);\n',
        script.removeprefix("\n"), "})();\n</script>\n</body>\n</html>\n",
    ])


def write_page(page: str, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def trajectory_html(trajs, path: str | Path, title: str | None = None) -> Path:
    """Write ONE self-contained HTML page showing prediction trajectories side by side; returns its path.

    ``trajs`` is a :class:`~lenscope.lenses.trajectory.PredictionTrajectory` or a list of them (e.g. the tuned
    and the logit lens on the same text). Each is a colour-coded grid (states bottom-up, input tokens across)
    whose cells show the lens's top-1 token; hovering a cell shows the state, position, top-k tokens with
    their probabilities, entropy and KL, and marks the same cell in the other grids. Buttons switch the colour
    between entropy, KL and top-1 probability (one scale for all grids).
    """
    if hasattr(trajs, "top_tokens"):
        trajs = [trajs]
    trajs = list(trajs)
    if not trajs:
        raise InputError("no trajectories given; pass at least one PredictionTrajectory")
    if title is None:
        lenses = " vs ".join(dict.fromkeys(t.lens for t in trajs))
        title = f"Prediction trajectory · {lenses} lens · {trajs[0].model}"
    payload = {"title": title, "trajectories": [t.to_dict(digits=6) for t in trajs]}
    return write_page(render_page(_CSS, title, "lenscope-data", payload, _SCRIPT), path)


_CSS = """
:root {
  --bg: #f6f7f9; --card: #ffffff; --ink: #1d2230; --muted: #6b7280; --line: #e3e6eb; --accent: #3b5bdb;
  --cell-w: 50px; --cell-h: 19px; --cell-font: 10.5px;
}
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--ink);
  font: 13px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
header { padding: 18px 26px 6px; }
h1 { font-size: 19px; font-weight: 650; margin: 0 0 6px; letter-spacing: -0.01em; }
.text { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; font-size: 12px; color: #374151;
  background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 6px 10px;
  display: inline-block; max-width: 100%; white-space: pre-wrap; word-break: break-word; }
.bar { display: flex; flex-wrap: wrap; align-items: center; gap: 14px 26px; margin: 12px 0 4px; }
.seg { display: inline-flex; border: 1px solid var(--line); border-radius: 8px; overflow: hidden;
  background: var(--card); }
.seg button { font: inherit; font-size: 12.5px; border: 0; background: transparent; padding: 5px 13px; cursor: pointer;
  color: var(--muted); border-right: 1px solid var(--line); }
.seg button:last-child { border-right: 0; }
.seg button:hover { background: #eef1f6; color: var(--ink); }
.seg button.on { background: var(--accent); color: white; }
.label { color: var(--muted); font-size: 12px; margin-right: 6px; }
.legend { display: inline-flex; align-items: center; gap: 8px; font-size: 11.5px; color: var(--muted); }
.legend .ramp { width: 190px; height: 11px; border-radius: 3px; border: 1px solid rgba(0,0,0,.08); }
.hint { color: var(--muted); font-size: 11.5px; }
.hint b { color: var(--ink); }
main { display: flex; flex-wrap: wrap; gap: 18px; padding: 10px 26px 30px; align-items: flex-start; }
.panel { background: var(--card); border: 1px solid var(--line); border-radius: 12px; padding: 12px 14px 10px;
  box-shadow: 0 1px 2px rgba(16,24,40,.04); max-width: 100%; overflow-x: auto; }
.panel h2 { margin: 0 0 2px; font-size: 14.5px; font-weight: 650; }
.panel .meta { color: var(--muted); font-size: 11.5px; margin-bottom: 8px; }
.grid { display: grid; gap: 1px; width: max-content; }
.cell { width: var(--cell-w); height: var(--cell-h); border-radius: 2px; font-size: var(--cell-font);
  line-height: var(--cell-h); text-align: center; overflow: hidden; white-space: pre; text-overflow: ellipsis;
  padding: 0 2px; cursor: default;
  font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; letter-spacing: -0.02em; }
.cell.hit { font-weight: 700; text-decoration: underline; text-underline-offset: 2px; }
.cell:hover, .cell.peer { outline: 2px solid #111827; outline-offset: -1px; position: relative; z-index: 1; }
.cell.peer { outline-style: dashed; }
.ws { opacity: .5; }
.rowlab { font-size: 10.5px; color: var(--muted); text-align: right; padding-right: 7px; line-height: var(--cell-h);
  white-space: nowrap; font-variant-numeric: tabular-nums; }
.rowlab.mid { font-size: 9.5px; opacity: .8; }
.rowlab.on, .collab.on { color: var(--ink); font-weight: 700; }
.collab { width: var(--cell-w); font-size: var(--cell-font); text-align: center; overflow: hidden; white-space: pre;
  text-overflow: ellipsis; font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; color: #374151;
  padding: 3px 1px 0; }
.collab.target { color: var(--muted); padding: 0 1px 3px; font-size: 10px; }
.axis { font-size: 10.5px; color: var(--muted); }
.corner { font-size: 10px; color: var(--muted); text-align: right; padding-right: 7px; align-self: end; }
#tip { position: fixed; pointer-events: none; z-index: 10; display: none; min-width: 230px; max-width: 340px;
  background: #111827; color: #f3f4f6; border-radius: 10px; padding: 10px 12px; font-size: 12px;
  box-shadow: 0 8px 24px rgba(0,0,0,.25); }
#tip .head { font-weight: 650; margin-bottom: 2px; }
#tip .sub { color: #9ca3af; font-size: 11px; margin-bottom: 7px; }
#tip code { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; background: rgba(255,255,255,.08);
  padding: 0 4px; border-radius: 3px; white-space: pre; }
#tip table { border-collapse: collapse; width: 100%; }
#tip td { padding: 2px 0; vertical-align: middle; }
#tip td.p { text-align: right; width: 52px; font-variant-numeric: tabular-nums; color: #d1d5db; }
#tip .track { width: 90px; height: 7px; background: rgba(255,255,255,.1); border-radius: 4px; overflow: hidden;
  margin-left: 8px; }
#tip .fill { height: 100%; background: #7dd3fc; border-radius: 4px; }
#tip .stats { display: flex; gap: 16px; margin-top: 8px; padding-top: 7px; border-top: 1px solid rgba(255,255,255,.12);
  color: #d1d5db; font-variant-numeric: tabular-nums; }
#tip .stats b { color: white; font-weight: 600; }
footer { color: var(--muted); font-size: 11px; padding: 0 26px 24px; }
"""

# the body of the page's function: render_page wraps it and defines DATA
_SCRIPT = r"""
  var TR = DATA.trajectories;
  // colour maps (key colours of matplotlib's viridis and magma), sampled evenly from 0 to 1
  var VIRIDIS = ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"];
  var MAGMA = ["#000004", "#1c1044", "#4f127b", "#812581", "#b5367a", "#e55964", "#fb8761", "#fec287", "#fcfdbf"];
  // bright = confident / close to the model's output, as in the static plots
  var VALUES = {
    entropy: { key: "entropy", name: "Entropy", unit: " nats", stops: VIRIDIS.slice().reverse(),
               lo: "0 (confident)", hiSuffix: " nats (unsure)" },
    kl: { key: "kl", name: "KL(final \u2016 lens)", unit: " nats", stops: MAGMA.slice().reverse(),
          lo: "0 (= output)", hiSuffix: " nats (log scale)", log: true },
    prob: { key: "top_prob", name: "Top-1 probability", unit: "", stops: VIRIDIS, lo: "0", hiSuffix: "" }
  };
  var current = "entropy";

  function hex(h) { return [parseInt(h.substr(1, 2), 16), parseInt(h.substr(3, 2), 16), parseInt(h.substr(5, 2), 16)]; }
  function colour(stops, t) {
    t = Math.max(0, Math.min(1, isFinite(t) ? t : 0));
    var x = t * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(x)), f = x - i;
    var a = hex(stops[i]), b = hex(stops[i + 1]);
    return [0, 1, 2].map(function (j) { return Math.round(a[j] + (b[j] - a[j]) * f); });
  }
  function luminance(c) {
    var l = c.map(function (v) { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
    return 0.2126 * l[0] + 0.7152 * l[1] + 0.0722 * l[2];
  }
  function range(v) {
    if (v === "prob") return [0, 1];
    var hi = 1e-6;
    TR.forEach(function (t) {
      t[VALUES[v].key].forEach(function (row) { row.forEach(function (x) { if (x > hi) hi = x; }); });
    });
    return [0, hi];
  }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  // a token with its whitespace made visible (spaces as a faint open box, newlines and tabs as arrows)
  function tokenInto(node, s) {
    var MAP = { " ": "\u2423", "\n": "\u21b5", "\t": "\u21e5" };
    var buf = "";
    function flush() { if (buf) { node.appendChild(document.createTextNode(buf)); buf = ""; } }
    for (var i = 0; i < s.length; i++) {
      var ch = s.charAt(i);
      var code = s.charCodeAt(i);
      if (MAP[ch]) { flush(); node.appendChild(el("span", "ws", MAP[ch])); }
      else if (code < 32 || code === 127) {  // other control characters as \xNN
        flush(); node.appendChild(el("span", "ws", "\\x" + (code < 16 ? "0" : "") + code.toString(16)));
      } else { buf += ch; }
    }
    flush();
    if (!s.length) node.appendChild(el("span", "ws", "\u2205"));
    return node;
  }
  function fmt(x, d) { return (Math.abs(x) < 1e-4 && x !== 0) ? x.toExponential(1) : x.toFixed(d); }
  function pct(p) {
    return p >= 0.995 ? (p * 100).toFixed(0) + "%" : p >= 0.001 ? (p * 100).toFixed(1) + "%" : "<0.1%";
  }

  // ---------------------------------------------------------------- page
  var header = el("header");
  header.appendChild(el("h1", null, DATA.title));
  header.appendChild(el("div", "text", TR[0].tokens.join("")));
  var bar = el("div", "bar");
  var ctl = el("div");
  ctl.appendChild(el("span", "label", "Colour by"));
  var seg = el("div", "seg");
  Object.keys(VALUES).forEach(function (v) {
    var b = el("button", v === current ? "on" : "", v === "prob" ? "Probability" : v === "kl" ? "KL" : "Entropy");
    b.type = "button";
    b.setAttribute("data-value", v);
    b.addEventListener("click", function () { setValue(v); });
    seg.appendChild(b);
  });
  ctl.appendChild(seg);
  bar.appendChild(ctl);
  var legend = el("div", "legend");
  var lo = el("span"), ramp = el("span", "ramp"), hi = el("span");
  legend.appendChild(lo); legend.appendChild(ramp); legend.appendChild(hi);
  bar.appendChild(legend);
  var hint = el("div", "hint");
  hint.appendChild(document.createTextNode("Cells: the lens\u2019s top-1 token; "));
  hint.appendChild(el("b", null, "bold"));
  hint.appendChild(document.createTextNode(TR[0].causal ? " = the actual next token. " : " = the input token. "));
  hint.appendChild(document.createTextNode("Hover for the top-k."));
  bar.appendChild(hint);
  header.appendChild(bar);
  document.body.appendChild(header);
  var main = el("main");
  document.body.appendChild(main);
  var tip = el("div");
  tip.id = "tip";
  document.body.appendChild(tip);

  var cells = [];  // per trajectory: cells[t][s][p]
  var labels = []; // per trajectory: {rows: [], cols: []}

  TR.forEach(function (t, ti) {
    var S = t.state_labels.length, P = t.tokens.length;
    var targets = t.causal ? t.tokens.slice(1).concat([null]) : t.tokens.slice();
    var panel = el("section", "panel");
    panel.appendChild(el("h2", null, t.lens + " lens"));
    panel.appendChild(el("div", "meta",
      t.model + " \u00b7 " + (S) + " states \u00d7 " + P + " positions \u00b7 top-" + t.k));
    var grid = el("div", "grid");
    grid.style.gridTemplateColumns = "auto repeat(" + P + ", var(--cell-w))";
    var mine = [], rows = [], cols = [];
    for (var s = 0; s < S; s++) mine.push([]);
    if (t.causal) {  // what each position predicts
      grid.appendChild(el("div", "corner", "predicts \u2192"));
      for (var p = 0; p < P; p++) {
        var c = el("div", "collab target");
        if (targets[p] !== null) { tokenInto(c, targets[p]); c.title = targets[p]; }
        grid.appendChild(c);
      }
    }
    for (var r = S - 1; r >= 0; r--) {  // output on top, embeddings at the bottom
      var lab = t.state_labels[r];
      var isMid = /\.mid$/.test(lab);
      var text = r === 0 ? "embed " + lab : r === S - 1 ? "output " + lab : isMid ? lab.replace(".mid", " mid") : lab;
      var rl = el("div", "rowlab" + (isMid ? " mid" : ""), text);
      rows[r] = rl;
      grid.appendChild(rl);
      for (var q = 0; q < P; q++) {
        var cell = el("div", "cell");
        var tok = t.top_tokens[r][q];
        tokenInto(cell, tok);
        if (targets[q] !== null && tok === targets[q]) cell.className += " hit";
        cell.setAttribute("data-t", ti); cell.setAttribute("data-s", r); cell.setAttribute("data-p", q);
        mine[r][q] = cell;
        grid.appendChild(cell);
      }
    }
    grid.appendChild(el("div", "corner", "input \u2192"));
    for (var p2 = 0; p2 < P; p2++) {
      var cl = el("div", "collab");
      tokenInto(cl, t.tokens[p2]);
      cl.title = t.tokens[p2];
      cols[p2] = cl;
      grid.appendChild(cl);
    }
    panel.appendChild(grid);
    main.appendChild(panel);
    cells.push(mine);
    labels.push({ rows: rows, cols: cols });
    grid.addEventListener("mouseover", function (e) { var c = e.target.closest(".cell"); if (c) show(c, e); });
    grid.addEventListener("mousemove", function (e) { if (tip.style.display === "block") place(e); });
    grid.addEventListener("mouseleave", hide);
  });
  var foot = el("footer", null, "Made with lenscope. States: the residual stream entering each block " +
    "(embed = token embeddings, output = the model\u2019s last residual); " +
    "\u201cmid\u201d = after the block\u2019s attention, " +
    "read with the logit lens. KL(final \u2016 lens) compares with the model\u2019s own output distribution.");
  document.body.appendChild(foot);

  function setValue(v) {
    current = v;
    var spec = VALUES[v], rg = range(v);
    Array.prototype.forEach.call(seg.children, function (b) {
      b.className = b.getAttribute("data-value") === v ? "on" : "";
    });
    TR.forEach(function (t, ti) {
      var vals = t[spec.key];
      cells[ti].forEach(function (row, s) {
        row.forEach(function (cell, p) {
          var x = vals[s][p];
          var c = colour(spec.stops,
                         spec.log ? Math.log1p(Math.max(0, x)) / Math.log1p(rg[1]) : (x - rg[0]) / (rg[1] - rg[0]));
          cell.style.background = "rgb(" + c.join(",") + ")";
          cell.style.color = luminance(c) > 0.22 ? "#111827" : "#f9fafb";
        });
      });
    });
    ramp.style.background = "linear-gradient(to right, " + spec.stops.join(", ") + ")";
    lo.textContent = spec.name + ": " + spec.lo;
    hi.textContent = v === "prob" ? "1" : fmt(rg[1], 2) + spec.hiSuffix;
  }

  var peers = [];
  function clearPeers() {
    peers.forEach(function (n) { n.classList.remove("peer"); n.classList.remove("on"); });
    peers = [];
  }
  function mark(n, cls) { if (n) { n.classList.add(cls); peers.push(n); } }

  function show(cell, e) {
    var ti = +cell.getAttribute("data-t"), s = +cell.getAttribute("data-s"), p = +cell.getAttribute("data-p");
    var t = TR[ti];
    clearPeers();
    TR.forEach(function (u, ui) {
      mark(labels[ui].cols[p], "on");
      var r = u.state_labels.indexOf(t.state_labels[s]);
      if (r >= 0) mark(labels[ui].rows[r], "on");
      if (ui !== ti && r >= 0 && p < u.tokens.length) mark(cells[ui][r][p], "peer");
    });
    tip.textContent = "";
    var lab = t.state_labels[s];
    var what = s === 0 ? "embeddings" : s === t.state_labels.length - 1 ? "output" : /\.mid$/.test(lab) ?
      "after layer " + lab.replace(".mid", "") + "\u2019s attention" : "entering layer " + lab;
    tip.appendChild(el("div", "head", t.lens + " lens \u00b7 state " + lab + " (" + what + ")"));
    var sub = el("div", "sub");
    sub.appendChild(document.createTextNode("position " + p + " \u00b7 input "));
    sub.appendChild(tokenInto(el("code"), t.tokens[p]));
    if (t.causal && p + 1 < t.tokens.length) {
      sub.appendChild(document.createTextNode(" \u2192 next "));
      sub.appendChild(tokenInto(el("code"), t.tokens[p + 1]));
    }
    tip.appendChild(sub);
    var table = el("table");
    for (var i = 0; i < t.k; i++) {
      var tr = el("tr"), td1 = el("td"), td2 = el("td"), td3 = el("td", "p");
      td1.appendChild(tokenInto(el("code"), t.topk_tokens[s][p][i]));
      var track = el("div", "track"), fill = el("div", "fill");
      fill.style.width = Math.max(1, 100 * t.topk_prob[s][p][i]).toFixed(1) + "%";
      track.appendChild(fill);
      td2.appendChild(track);
      td3.textContent = pct(t.topk_prob[s][p][i]);
      tr.appendChild(td1); tr.appendChild(td2); tr.appendChild(td3);
      table.appendChild(tr);
    }
    tip.appendChild(table);
    var stats = el("div", "stats");
    [["entropy", t.entropy[s][p]], ["KL", t.kl[s][p]]].forEach(function (kv) {
      var span = el("span", null, kv[0] + " ");
      span.appendChild(el("b", null, fmt(kv[1], 3)));
      span.appendChild(document.createTextNode(" nats"));
      stats.appendChild(span);
    });
    tip.appendChild(stats);
    tip.style.display = "block";
    place(e);
  }
  function place(e) {
    var w = tip.offsetWidth, h = tip.offsetHeight, x = e.clientX + 16, y = e.clientY + 16;
    if (x + w > window.innerWidth - 8) x = e.clientX - w - 16;
    if (y + h > window.innerHeight - 8) y = Math.max(8, e.clientY - h - 16);
    tip.style.left = x + "px"; tip.style.top = y + "px";
  }
  function hide() { tip.style.display = "none"; clearPeers(); }

  // cell width: fit the grids side by side in the window when that leaves cells readable
  function fit() {
    var maxP = Math.max.apply(null, TR.map(function (t) { return t.tokens.length; }));
    var avail = document.documentElement.clientWidth - 52 - 18 * (TR.length - 1);
    var w = Math.floor((avail / TR.length - 30 - 84) / maxP);
    w = Math.max(34, Math.min(56, w));
    document.documentElement.style.setProperty("--cell-w", w + "px");
    document.documentElement.style.setProperty("--cell-font", (w < 42 ? 9.5 : 10.5) + "px");
  }
  fit();
  window.addEventListener("resize", fit);
  setValue(current);
  // for screenshots and tests: #cell=t,s,p opens that cell's tooltip
  var m = /cell=(\d+),(\d+),(\d+)/.exec(location.hash);
  if (m && cells[+m[1]] && cells[+m[1]][+m[2]] && cells[+m[1]][+m[2]][+m[3]]) {
    var target = cells[+m[1]][+m[2]][+m[3]], box = target.getBoundingClientRect();
    show(target, { clientX: box.right, clientY: box.bottom });
  }
  var mv = /value=(entropy|kl|prob)/.exec(location.hash);
  if (mv) setValue(mv[1]);
"""
