/* lenscope report: an attribution graph (lenscope graph --html, AttributionGraph, the report's --dict with
   transcoders), drawn as a diagram. Rows: the tokens' embeddings at the bottom, one row per block, the logits at the
   top; columns: the positions. Every feature and error node has its own place in its (block, position) cell: a cell
   of a few nodes lists them one above the other, each feature with its label beside it (where the dictionary's
   labels are cached: lenscope dict label), a fuller cell packs them in a grid; each row is as tall as its fullest
   cell, so no two nodes overlap. Transcoder features are circles, error nodes squares, logits boxes with their token
   and probability; an edge is red when positive, blue when negative, thicker and more opaque the larger |weight|
   (the edges are drawn as one SVG path per sign and strength band, so thousands of them draw fast).
   Controls: the node slider shows a feature or error node while its influence (its cumulative share of the
   influence on the logits, circuit-tracer's) is at most the threshold; the edge slider shows an edge between shown
   nodes while its |weight| is at least that share of the strongest edge's (d.edge_share to start); the first-token
   switch hides or shows the first position's feature and error nodes and their edges (their share of the influence,
   d.first_position_share, stated beside it; hidden at first when d.hide_first), and lays the rows out again for the
   nodes left. Tokens and logits are always shown. Hover a node for its numbers; click it for its details (a feature
   also emits LS.emit("feature", {site, feature}): the app opens its card); shift-click selects several, which
   "group" makes a supernode: LS.emit("supernode", {label, ids, done}) when something listens (the app keeps it on
   the server and answers with every supernode), else kept in the page and downloadable as JSON. A supernode is
   drawn as a box around its shown members with its label. */
(function () {
  "use strict";
  var POS = "#c0281b", NEG = "#2b59c3", FEAT = "#f08c2e", ERR = "#adb5bd", DOT = 11, LINE = 14, LIST = 6, BANDS = 8;
  var MAXCOL = 200; // the widest a column grows for its labels or its grid
  var RING = ["#7048e8", "#0ca678", "#e8590c", "#1c7ed6", "#d6336c", "#5c940d"];

  function name(n) {
    if (n.kind === "feature") return "L" + n.layer + " #" + n.feature + " @" + n.position;
    if (n.kind === "error") return "L" + n.layer + " error @" + n.position;
    if (n.kind === "token") return LS.show(n.token, 14) + " @" + n.position;
    return "logit " + LS.show(n.logit_token, 14);
  }

  function short(s, max) { return s.length > max ? s.slice(0, max - 1) + "\u2026" : s; } // a label, already printable

  LS.sections.graph = function (body, d, meta) {
    var toks = d.tokens, P = toks.length, L = d.n_layers, byId = {};
    var nodes = d.nodes.map(function (n) {
      var m = {}; for (var k in n) m[k] = n[k];
      m.token = toks[n.position]; m.ins = []; m.outs = []; byId[m.id] = m; return m;
    });
    var links = d.links.filter(function (e) { return byId[e.source] && byId[e.target]; });
    links.forEach(function (e) { byId[e.source].outs.push(e); byId[e.target].ins.push(e); });
    var fixed = function (n) { return n.kind === "token" || n.kind === "logit"; };
    var first = function (n) { return !fixed(n) && n.position === 0; };
    var maxInf = 0, maxW = 0, nFirst = 0;
    nodes.forEach(function (n) { if (!fixed(n)) maxInf = Math.max(maxInf, n.influence); if (first(n)) nFirst++; });
    links.forEach(function (e) { maxW = Math.max(maxW, Math.abs(e.weight)); });
    var top = Math.max(0.01, Math.ceil(maxInf * 100 - 1e-9) / 100), thr = top;
    var eshare = d.edge_share === undefined ? 0.1 : d.edge_share, hideFirst = !!d.hide_first && P > 1;
    var supernodes = (d.supernodes || []).map(function (s) { return s.slice(); });
    var selected = {};

    var info = LS.el("p", "meta", null, body);
    info.textContent = d.n_feature_nodes + " of " + d.n_active_features + " active features as nodes \u00b7 " +
      nodes.length + " nodes, " + links.length + " edges after pruning (nodes " + d.node_threshold + ", edges " +
      d.edge_threshold + ") \u00b7 replacement score " + LS.fmt(d.replacement_score, 3) + " \u00b7 completeness " +
      LS.fmt(d.completeness_score, 3) + " \u00b7 exactness error " + LS.fmt(d.max_exactness_error) +
      (d.seconds !== null && d.seconds !== undefined ? " \u00b7 " + LS.fmt(d.seconds, 1) + " s" : "");
    var ctl = LS.el("div", "controls", null, body);
    var slider = LS.slider(ctl, "node threshold (influence)", 0, top, 0.01, thr, function (v) { thr = v; draw(); },
      function (v) { return "\u2264 " + v.toFixed(2); });
    slider.setAttribute("data-role", "graph-threshold");
    var eslider = LS.slider(ctl, "edges (|weight| / strongest)", 0, 1, 0.01, eshare, function (v) { eshare = v; draw(); },
      function (v) { return "\u2265 " + v.toFixed(2); });
    eslider.setAttribute("data-role", "graph-edge-threshold");
    var fwrap = LS.el("label", null, null, ctl), fbox = LS.el("input", null, null, fwrap);
    fbox.type = "checkbox"; fbox.checked = !hideFirst; fbox.disabled = P < 2 || !nFirst;
    fbox.setAttribute("data-role", "graph-first-token");
    var fsay = LS.el("span", "meta", null, fwrap);
    fsay.setAttribute("data-role", "graph-first-share");
    fsay.textContent = " first token's nodes (" + nFirst + "; share of the influence " +
      (d.first_position_share === undefined || d.first_position_share === null ? "?" : LS.fmt(d.first_position_share, 2)) +
      (d.skip_first ? ", the BOS left out of the graph" : "") + ")";
    fbox.addEventListener("change", function () { hideFirst = !fbox.checked; place(); draw(); paint(); });
    var count = LS.el("span", "meta", null, ctl);
    count.setAttribute("data-role", "graph-count");
    var lgd = LS.el("span", "circuit-legend", null, ctl);
    [["feature", FEAT, "50%"], ["error", ERR, "1px"], ["edge > 0", POS, "0"], ["edge < 0", NEG, "0"]].forEach(function (k) {
      var s = LS.el("span", "legend", null, lgd), sw = LS.el("span", "sw", null, s);
      sw.style.background = k[1]; sw.style.borderRadius = k[2]; LS.el("span", null, k[0], s);
    });

    // selection and supernodes
    var sctl = LS.el("div", "controls", null, body);
    var nsel = LS.el("span", "meta", null, sctl);
    nsel.setAttribute("data-role", "graph-selected");
    var input = LS.el("input", null, null, sctl);
    input.placeholder = "supernode label"; input.setAttribute("data-role", "supernode-label");
    var bGroup = LS.el("button", null, "group as supernode", sctl), bClear = LS.el("button", null, "clear", sctl);
    var bSave = LS.el("button", null, "download supernodes (JSON)", sctl);
    [bGroup, bClear, bSave].forEach(function (b) { b.type = "button"; });
    bGroup.setAttribute("data-role", "supernode-group"); bSave.setAttribute("data-role", "supernode-download");
    var say = LS.el("span", "meta", null, sctl);

    // the columns: one per position, each as wide as its cells need (labels beside the nodes of a list cell, a grid
    // about twice as wide as tall), at least an even share of 1,100 pixels (44 to 130)
    var minCol = Math.max(44, Math.min(130, Math.floor(1100 / Math.max(1, P)))), left = 64, colW = [], colX = [];
    var logits = nodes.filter(function (n) { return n.kind === "logit"; })
      .sort(function (a, b) { return b.activation - a.activation; });
    var bw = 78, x0 = left;
    var svg = LS.svg("svg", { width: 100, height: 100, "class": "attr-graph" }, body);
    var gGrid = LS.svg("g", {}, svg), gBoxes = LS.svg("g", {}, svg), gEdges = LS.svg("g", { "pointer-events": "none" }, svg);
    var gNodes = LS.svg("g", {}, svg), gLabels = LS.svg("g", { "pointer-events": "none" }, svg);
    var list = LS.el("div", "tokens", null, body);
    list.setAttribute("data-role", "graph-supernodes");
    var panel = LS.el("div", "graph-detail row", null, body);
    panel.setAttribute("data-role", "graph-detail");

    // the nodes' elements, made once (place() moves them, draw() shows or hides them)
    nodes.forEach(function (n) {
      var el;
      if (n.kind === "token") {
        el = LS.svg("g", {}, gNodes);
        n.box = LS.svg("rect", { height: 22, rx: 5, fill: "#e9ecef", stroke: "#adb5bd" }, el);
        n.txt = LS.text(el, 0, 0, "", { "text-anchor": "middle", "font-size": 11, "class": "mono", fill: "#1d2230" });
      } else if (n.kind === "logit") {
        el = LS.svg("g", {}, gNodes);
        n.box = LS.svg("rect", { width: bw, height: 30, rx: 6, fill: "#d3f9d8", stroke: "#2f9e44" }, el);
        n.txt = LS.text(el, 0, 0, LS.show(n.logit_token, 10), { "text-anchor": "middle", "font-size": 11, "class": "mono" });
        n.txt2 = LS.text(el, 0, 0, "p " + LS.fmt(n.activation, 3), { "text-anchor": "middle", "font-size": 9.5, fill: "#374151" });
      } else {
        el = n.kind === "feature" ? LS.svg("circle", { r: 4, fill: FEAT }, gNodes)
          : LS.svg("rect", { width: 7.6, height: 7.6, fill: ERR }, gNodes);
        if (n.label) {
          n.lab = LS.text(gLabels, 0, 0, "", { "font-size": 9.5, fill: "#1f2937", stroke: "#fff", "stroke-width": 3,
            "paint-order": "stroke", "data-role": "node-label",
            "data-label-of": n.id });
        }
      }
      n.el = el;
      el.setAttribute("data-node", n.id);
      el.setAttribute("data-kind", n.kind);
      el.classList.add("ls-click");
    });
    function nodeOf(e) { var t = e.target.closest ? e.target.closest("[data-node]") : null; return t ? byId[t.getAttribute("data-node")] : null; }
    gNodes.addEventListener("mousemove", function (e) {
      var n = nodeOf(e);
      if (!n) { LS.untip(); return; }
      LS.tip(e, function (tp) {
        LS.line(tp, [[name(n), 1], ["  " + n.id, 0]]);
        if (n.label) LS.line(tp, [["label ", 0], [n.label, 1]]);
        if (n.kind === "feature") LS.line(tp, [["activation ", 0], [LS.fmt(n.activation, 4), 1]]);
        if (n.kind === "error") LS.line(tp, [["error norm ", 0], [LS.fmt(n.activation, 4), 1]]);
        if (n.kind === "logit") LS.line(tp, [["probability ", 0], [LS.fmt(n.activation, 4), 1]]);
        if (n.kind !== "logit") LS.line(tp, [["influence (cumulative share) ", 0], [LS.fmt(n.influence, 4), 1]]);
        LS.line(tp, [[n.ins.length + " edges in, " + n.outs.length + " out after pruning", 0]]);
      });
    });
    gNodes.addEventListener("mouseleave", LS.untip);
    gNodes.addEventListener("click", function (e) {
      var n = nodeOf(e);
      if (!n) return;
      if (e.shiftKey || e.ctrlKey || e.metaKey) { if (selected[n.id]) delete selected[n.id]; else selected[n.id] = true; }
      else { selected = {}; selected[n.id] = true; show(n); }
      paint();
    });

    // the layout: each (block, position) cell's nodes (features by influence, the error last), a list of at most
    // LIST one per line (labels beside), else a grid; a row as tall as its fullest cell; tokens below, logits above
    function place() {
      var cells = {}, rows = [], l, p;
      for (l = 0; l < L; l++) rows.push(0);
      nodes.forEach(function (n) {
        if (fixed(n) || (hideFirst && first(n))) return;
        var k = n.layer + "_" + n.position;
        (cells[k] = cells[k] || []).push(n);
      });
      for (p = 0; p < P; p++) colW[p] = minCol;
      Object.keys(cells).forEach(function (k) {
        var c = cells[k], p = c[0].position;
        c.sort(function (a, b) { return (a.kind === "error") - (b.kind === "error") || a.influence - b.influence; });
        c.list = c.length <= LIST;
        if (c.list) c.forEach(function (n) { if (n.label) colW[p] = Math.max(colW[p], Math.min(MAXCOL, 24 + 5.4 * n.label.length)); });
        else colW[p] = Math.max(colW[p], Math.min(MAXCOL, 10 + DOT * Math.ceil(Math.sqrt(2 * c.length))));
      });
      var x = left;
      for (p = 0; p < P; p++) { colX[p] = x; x += colW[p]; }
      x0 = Math.max(left, x - logits.length * (bw + 4));
      svg.setAttribute("width", Math.max(x, x0 + logits.length * (bw + 4)) + 12);
      Object.keys(cells).forEach(function (k) {
        var c = cells[k];
        c.cap = Math.max(1, Math.floor((colW[c[0].position] - 8) / DOT));
        c.h = c.list ? c.length * LINE : Math.ceil(c.length / c.cap) * DOT;
        rows[c[0].layer] = Math.max(rows[c[0].layer], c.h);
      });
      var y = 8, rowMid = {}, base = {}, minH = Math.max(26, Math.min(60, Math.floor(400 / Math.max(1, L))));
      rowMid.logit = y + 16; y += 46;
      for (l = L - 1; l >= 0; l--) { var h = Math.max(minH, rows[l] + 12); rowMid[l] = y + h / 2; base[l] = y + h - 6; y += h; }
      rowMid.token = y + 14; y += 40;
      svg.setAttribute("height", y);
      while (gGrid.firstChild) gGrid.removeChild(gGrid.firstChild);
      [["logits", rowMid.logit], ["emb", rowMid.token]].concat(Array.apply(null, Array(L)).map(function (_, i) {
        return ["L" + i, rowMid[i]];
      })).forEach(function (r) {
        LS.text(gGrid, left - 8, r[1] + 3.5, r[0], { "text-anchor": "end", "font-size": 10, fill: "#6b7280" });
      });
      for (l = 0; l < L; l++) LS.svg("line", { x1: left, x2: x, y1: base[l] + 3, y2: base[l] + 3, stroke: "#f1f3f5" }, gGrid);
      for (p = 1; p < P; p++) LS.svg("line", { x1: colX[p], x2: colX[p], y1: rowMid.logit + 18, y2: rowMid.token,
        stroke: "#f5f6f8" }, gGrid);
      Object.keys(cells).forEach(function (k) {
        var c = cells[k];
        var w = colW[c[0].position], x1 = colX[c[0].position], cap = c.cap;
        c.forEach(function (n, i) {
          var cx, cy;
          if (c.list) { cx = x1 + 9; cy = base[n.layer] - DOT / 2 - i * LINE; }
          else {
            cx = x1 + (w - Math.min(c.length, cap) * DOT) / 2 + DOT / 2 + (i % cap) * DOT;
            cy = base[n.layer] - DOT / 2 - Math.floor(i / cap) * DOT;
          }
          setXY(n, cx, cy);
          n.labelled = !!(n.lab && c.list);
          if (n.labelled) {
            n.lab.setAttribute("x", cx + 7); n.lab.setAttribute("y", cy + 3.5);
            n.lab.textContent = short(n.label, Math.max(4, Math.floor((w - 24) / 5.4)));
          }
        });
      });
      nodes.forEach(function (n) {
        var cx, cy;
        if (n.kind === "token") {
          var w = colW[n.position];
          cx = colX[n.position] + w / 2; cy = rowMid.token;
          n.box.setAttribute("x", cx - w / 2 + 3); n.box.setAttribute("y", cy - 11); n.box.setAttribute("width", w - 6);
          n.txt.textContent = LS.show(n.token, Math.max(3, Math.floor((w - 10) / 7)));
          n.txt.setAttribute("x", cx); n.txt.setAttribute("y", cy + 4);
          n.ax = [cx, cy - 11];
        } else if (n.kind === "logit") {
          cx = x0 + logits.indexOf(n) * (bw + 4) + bw / 2; cy = rowMid.logit;
          n.box.setAttribute("x", cx - bw / 2); n.box.setAttribute("y", cy - 15);
          n.txt.setAttribute("x", cx); n.txt.setAttribute("y", cy - 2);
          n.txt2.setAttribute("x", cx); n.txt2.setAttribute("y", cy + 11);
          n.ax = [cx, cy + 15];
        }
      });
    }
    function setXY(n, cx, cy) {
      if (n.kind === "feature") { n.el.setAttribute("cx", cx); n.el.setAttribute("cy", cy); }
      else { n.el.setAttribute("x", cx - 3.8); n.el.setAttribute("y", cy - 3.8); }
      n.ax = [cx, cy];
    }

    function shown(n) { return fixed(n) || (n.influence <= thr + 1e-9 && !(hideFirst && first(n))); }
    function draw() {
      while (gEdges.firstChild) gEdges.removeChild(gEdges.firstChild);
      var nn = 0, paths = {}, drawn = [];
      nodes.forEach(function (n) {
        var on = shown(n);
        n.el.style.display = on ? "" : "none"; n.el.setAttribute("data-shown", on ? "1" : "0");
        if (n.lab) n.lab.style.display = on && n.labelled ? "" : "none";
        if (on) nn++;
      });
      links.forEach(function (e) {
        var s = byId[e.source], t = byId[e.target], w = Math.abs(e.weight);
        if (!shown(s) || !shown(t) || w < eshare * maxW - 1e-12) return;
        var band = Math.min(BANDS - 1, Math.floor(Math.sqrt(w / (maxW || 1)) * BANDS)), key = (e.weight >= 0 ? "p" : "n") + band;
        (paths[key] = paths[key] || []).push("M" + s.ax[0].toFixed(1) + " " + s.ax[1].toFixed(1) + "L" + t.ax[0].toFixed(1) +
          " " + t.ax[1].toFixed(1));
        drawn.push(e.source + ">" + e.target);
      });
      Object.keys(paths).sort(function (a, b) { return a.slice(1) - b.slice(1); }).forEach(function (key) {
        var a = (Number(key.slice(1)) + 0.5) / BANDS;
        LS.svg("path", { d: paths[key].join(""), fill: "none", stroke: key[0] === "p" ? POS : NEG,
          "stroke-width": (0.5 + 2.5 * a).toFixed(2), "stroke-opacity": (0.08 + 0.82 * a).toFixed(3), "data-edges": key }, gEdges);
      });
      svg.lsEdges = drawn;
      svg.setAttribute("data-nodes", nn); svg.setAttribute("data-edges", drawn.length);
      count.textContent = nn + " of " + nodes.length + " nodes, " + drawn.length + " of " + links.length + " edges shown";
      boxes();
    }

    // supernodes: a box around the shown members of each, with its label
    function boxes() {
      while (gBoxes.firstChild) gBoxes.removeChild(gBoxes.firstChild);
      supernodes.forEach(function (s, i) {
        var x1 = Infinity, y1 = Infinity, x2 = -Infinity, y2 = -Infinity;
        s.slice(1).forEach(function (id) {
          var n = byId[id];
          if (!n || !shown(n) || !n.ax) return;
          x1 = Math.min(x1, n.ax[0]); y1 = Math.min(y1, n.ax[1]); x2 = Math.max(x2, n.ax[0]); y2 = Math.max(y2, n.ax[1]);
        });
        if (x1 === Infinity) return;
        var c = RING[i % RING.length], g = LS.svg("g", { "data-role": "supernode-box", "data-supernode": s[0] }, gBoxes);
        LS.svg("rect", { x: x1 - 8, y: y1 - 8, width: x2 - x1 + 16, height: y2 - y1 + 16, rx: 5, fill: c, "fill-opacity": 0.07,
          stroke: c, "stroke-width": 1.5 }, g);
        LS.text(g, x1 - 7, y1 - 11, short(s[0], 24), { "font-size": 10, "font-weight": 600, fill: c, stroke: "#fff",
          "stroke-width": 3, "paint-order": "stroke" });
      });
    }

    // details of the node clicked: its numbers and its strongest edges in and out (a click on one shows that node)
    function show(n) {
      while (panel.firstChild) panel.removeChild(panel.firstChild);
      panel.setAttribute("data-node", n.id);
      var p0 = LS.el("div", "panel", null, panel);
      LS.el("h3", null, name(n) + " \u00b7 " + n.kind, p0);
      var tb = LS.el("table", "kv", null, p0);
      var site = n.kind === "feature" ? (d.layer_sites || {})[String(n.layer)] : null;
      [["node", n.id], ["label", n.label], ["position", n.position + " " + JSON.stringify(n.token)], ["transcoder", site],
       ["latent", n.kind === "feature" ? n.feature : null],
       [{ feature: "activation", error: "error norm", logit: "probability" }[n.kind], n.activation === null ? null : LS.fmt(n.activation, 4)],
       ["influence", n.kind === "logit" ? null : LS.fmt(n.influence, 4)]].forEach(function (r) {
        if (!r[0] || r[1] === null || r[1] === undefined) return;
        var tr = LS.el("tr", null, null, tb); LS.el("th", null, r[0], tr); LS.el("td", null, String(r[1]), tr);
      });
      [["strongest inputs", n.ins, "source"], ["strongest outputs", n.outs, "target"]].forEach(function (g) {
        if (!g[1].length) return;
        var pg = LS.el("div", "panel", null, panel);
        LS.el("h3", null, g[0], pg);
        var t2 = LS.el("table", "kv", null, pg);
        g[1].slice().sort(function (a, b) { return Math.abs(b.weight) - Math.abs(a.weight); }).slice(0, 8).forEach(function (e) {
          var o = byId[e[g[2]]], tr = LS.el("tr", null, null, t2);
          var th = LS.el("th", null, null, tr), a = LS.el("span", "feature-link", name(o) + (o.label ? " " + short(o.label, 28) : ""), th);
          a.addEventListener("click", function () { selected = {}; selected[o.id] = true; show(o); paint(); });
          LS.el("td", null, LS.fmt(e.weight, 4), tr).style.color = e.weight >= 0 ? POS : NEG;
        });
      });
      if (site) LS.emit("feature", { site: site, feature: n.feature });
    }

    function paint() {
      var ring = {};
      supernodes.forEach(function (s, i) { s.slice(1).forEach(function (id) { if (!(id in ring)) ring[id] = RING[i % RING.length]; }); });
      nodes.forEach(function (n) {
        var shape = n.box || n.el, sel = !!selected[n.id], r = ring[n.id];
        shape.setAttribute("stroke", sel ? "#111827" : r || (n.kind === "token" ? "#adb5bd" : n.kind === "logit" ? "#2f9e44" : "none"));
        shape.setAttribute("stroke-width", sel ? 2.4 : r ? 2 : 1);
        n.el.classList.toggle("ls-sel", sel);
      });
      var k = Object.keys(selected).length;
      nsel.textContent = k + " selected (shift-click adds)";
      while (list.firstChild) list.removeChild(list.firstChild);
      supernodes.forEach(function (s, i) {
        var chip = LS.el("span", "tok", null, list), sw = LS.el("span", "sw", null, chip);
        sw.style.cssText = "display:inline-block;width:9px;height:9px;border-radius:2px;margin-right:5px;background:" + RING[i % RING.length];
        LS.el("span", null, s[0] + " (" + (s.length - 1) + ")", chip);
        chip.setAttribute("data-supernode", s[0]);
        LS.hover(chip, function (tp) {
          LS.line(tp, [["supernode ", 0], [s[0], 1]]);
          s.slice(1).forEach(function (id) { var o = byId[id]; LS.line(tp, [[o ? name(o) + (o.label ? " " + o.label : "") : id, 0]]); });
        });
      });
      boxes();
    }
    bGroup.addEventListener("click", function () {
      var ids = Object.keys(selected), label = input.value.trim();
      if (!ids.length || !label) { say.textContent = "select nodes (click, shift-click) and type a label first"; return; }
      say.textContent = "";
      var done = function (all) { supernodes = all.map(function (s) { return s.slice(); }); selected = {}; input.value = ""; paint(); };
      if (LS.listening("supernode")) LS.emit("supernode", { label: label, ids: ids, done: done });
      else done(supernodes.concat([[label].concat(ids)]));
    });
    bClear.addEventListener("click", function () { selected = {}; paint(); });
    bSave.addEventListener("click", function () {
      var blob = new Blob([JSON.stringify({ model: d.model, tokens: toks, supernodes: supernodes }, null, 1)],
        { type: "application/json" });
      var a = LS.el("a", null, null, document.body);
      a.href = URL.createObjectURL(blob); a.download = "supernodes.json"; a.click();
      setTimeout(function () { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
    });
    place();
    draw();
    paint();
  };
})();
