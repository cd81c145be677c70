/* lenscope report: an attribution graph (lenscope graph --html, AttributionGraph, the report's --dict with
   transcoders). Rows: the tokens' embeddings at the bottom, one row per block, the logits at the top; columns: the
   positions. Transcoder features are circles, error nodes squares, logits boxes with their token and probability;
   an edge is red when positive, blue when negative, more opaque the larger |weight|. The slider prunes: a feature or
   error node is shown while its influence (its cumulative share of the influence on the logits, circuit-tracer's)
   is at most the threshold, with the edges between shown nodes; tokens and logits always. Hover a node for its
   numbers; click it for its details (a feature also emits LS.emit("feature", {site, feature}): the app opens its
   card); shift-click selects several, which "group" makes a supernode: LS.emit("supernode", {label, ids, done}) when
   something listens (the app keeps it on the server and answers with every supernode), else kept in the page and
   downloadable as JSON. */
(function () {
  "use strict";
  var POS = "#c0281b", NEG = "#2b59c3", FEAT = "#f08c2e", ERR = "#adb5bd", DOT = 11;
  var RING = ["#7048e8", "#0ca678", "#e8590c", "#1c7ed6", "#d6336c", "#5c940d"];

  function label(n) {
    if (n.kind === "feature") return "L" + n.layer + " #" + n.feature + " @" + n.position;
    if (n.kind === "error") return "L" + n.layer + " error @" + n.position;
    if (n.kind === "token") return LS.show(n.token, 14) + " @" + n.position;
    return "logit " + LS.show(n.logit_token, 14);
  }

  LS.sections.graph = function (body, d, meta) {
    var toks = d.tokens, P = toks.length, L = d.n_layers, byId = {};
    var nodes = d.nodes.map(function (n) {
      var m = {}; for (var k in n) m[k] = n[k];
      m.token = toks[n.position]; m.ins = []; m.outs = []; byId[m.id] = m; return m;
    });
    var links = d.links.filter(function (e) { return byId[e.source] && byId[e.target]; });
    links.forEach(function (e) { byId[e.source].outs.push(e); byId[e.target].ins.push(e); });
    links.sort(function (a, b) { return Math.abs(a.weight) - Math.abs(b.weight); }); // the strongest drawn last
    var fixed = function (n) { return n.kind === "token" || n.kind === "logit"; };
    var maxInf = 0;
    nodes.forEach(function (n) { if (!fixed(n)) maxInf = Math.max(maxInf, n.influence); });
    var top = Math.max(0.01, Math.ceil(maxInf * 100 - 1e-9) / 100), thr = top;
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

    // the layout: a column per position; a row per block, as tall as its fullest cell (features by influence, the
    // error last), the tokens below and the logits above
    var cw = Math.max(56, Math.min(130, Math.floor(1000 / Math.max(1, P)))), left = 64;
    var cap = Math.max(1, Math.floor((cw - 10) / DOT)), cells = {}, lines = [];
    for (var l = 0; l < L; l++) lines.push(1);
    nodes.forEach(function (n) {
      if (fixed(n)) return;
      var k = n.layer + "_" + n.position;
      (cells[k] = cells[k] || []).push(n);
    });
    Object.keys(cells).forEach(function (k) {
      var c = cells[k];
      c.sort(function (a, b) { return (a.kind === "error") - (b.kind === "error") || a.influence - b.influence; });
      lines[c[0].layer] = Math.max(lines[c[0].layer], Math.ceil(c.length / cap));
    });
    var logits = nodes.filter(function (n) { return n.kind === "logit"; })
      .sort(function (a, b) { return b.activation - a.activation; });
    var bw = 78, x0 = Math.max(left, left + P * cw - logits.length * (bw + 4));
    var W = Math.max(left + P * cw, x0 + logits.length * (bw + 4)) + 12;
    var y = 8, rowMid = {}, base = {};
    rowMid.logit = y + 16; y += 46;
    var minH = Math.max(30, Math.min(72, Math.floor(440 / Math.max(1, L))));
    for (l = L - 1; l >= 0; l--) { var h = Math.max(minH, lines[l] * DOT + 16); rowMid[l] = y + h / 2; base[l] = y + h - 8 - DOT / 2; y += h; }
    rowMid.token = y + 14; y += 40;
    var svg = LS.svg("svg", { width: W, height: y, "class": "attr-graph" }, body);
    var gGrid = LS.svg("g", {}, svg), gEdges = LS.svg("g", {}, svg), gNodes = LS.svg("g", {}, svg);
    [["logits", rowMid.logit], ["emb", rowMid.token]].concat(Array.apply(null, Array(L)).map(function (_, i) {
      return ["L" + i, rowMid[i]];
    })).forEach(function (r) {
      LS.text(gGrid, left - 8, r[1] + 3.5, r[0], { "text-anchor": "end", "font-size": 10, fill: "#6b7280" });
    });
    for (l = 0; l < L; l++) LS.svg("line", { x1: left, x2: left + P * cw, y1: rowMid[l], y2: rowMid[l], stroke: "#f1f3f5" }, gGrid);
    for (var p = 1; p < P; p++) LS.svg("line", { x1: left + p * cw, x2: left + p * cw, y1: rowMid.logit + 18, y2: rowMid.token,
      stroke: "#f5f6f8" }, gGrid);

    var list = LS.el("div", "tokens", null, body);
    list.setAttribute("data-role", "graph-supernodes");
    var panel = LS.el("div", "graph-detail row", null, body);
    panel.setAttribute("data-role", "graph-detail");
    nodes.forEach(function (n) {
      var el, cx, cy;
      if (n.kind === "token") {
        cx = left + n.position * cw + cw / 2; cy = rowMid.token;
        el = LS.svg("g", {}, gNodes);
        LS.svg("rect", { x: cx - cw / 2 + 3, y: cy - 11, width: cw - 6, height: 22, rx: 5, fill: "#e9ecef", stroke: "#adb5bd" }, el);
        LS.text(el, cx, cy + 4, LS.show(n.token, Math.max(3, Math.floor((cw - 10) / 7))),
          { "text-anchor": "middle", "font-size": 11, "class": "mono", fill: "#1d2230" });
        n.ax = [cx, cy - 11];
      } else if (n.kind === "logit") {
        var i = logits.indexOf(n);
        cx = x0 + i * (bw + 4) + bw / 2; cy = rowMid.logit;
        el = LS.svg("g", {}, gNodes);
        LS.svg("rect", { x: cx - bw / 2, y: cy - 15, width: bw, height: 30, rx: 6, fill: "#d3f9d8", stroke: "#2f9e44" }, el);
        LS.text(el, cx, cy - 2, LS.show(n.logit_token, 10), { "text-anchor": "middle", "font-size": 11, "class": "mono" });
        LS.text(el, cx, cy + 11, "p " + LS.fmt(n.activation, 3), { "text-anchor": "middle", "font-size": 9.5, fill: "#374151" });
        n.ax = [cx, cy + 15];
      } else {
        var c = cells[n.layer + "_" + n.position], k = c.indexOf(n);
        cx = left + n.position * cw + (cw - Math.min(c.length, cap) * DOT) / 2 + DOT / 2 + (k % cap) * DOT;
        cy = base[n.layer] - Math.floor(k / cap) * DOT;
        el = n.kind === "feature" ? LS.svg("circle", { cx: cx, cy: cy, r: 4, fill: FEAT }, gNodes)
          : LS.svg("rect", { x: cx - 3.8, y: cy - 3.8, width: 7.6, height: 7.6, fill: ERR }, gNodes);
        n.ax = [cx, cy];
      }
      n.el = el;
      el.setAttribute("data-node", n.id);
      el.setAttribute("data-kind", n.kind);
      el.classList.add("ls-click");
      LS.hover(el, function (tp) {
        LS.line(tp, [[label(n), 1], ["  " + n.id, 0]]);
        if (n.kind === "feature") LS.line(tp, [["activation ", 0], [LS.fmt(n.activation, 4), 1]]);
        if (n.kind === "error") LS.line(tp, [["error norm ", 0], [LS.fmt(n.activation, 4), 1]]);
        if (n.kind === "logit") LS.line(tp, [["probability ", 0], [LS.fmt(n.activation, 4), 1]]);
        if (n.kind !== "logit") LS.line(tp, [["influence (cumulative share) ", 0], [LS.fmt(n.influence, 4), 1]]);
        LS.line(tp, [[n.ins.length + " edges in, " + n.outs.length + " out after pruning", 0]]);
      });
      el.addEventListener("click", function (e) {
        if (e.shiftKey || e.ctrlKey || e.metaKey) { if (selected[n.id]) delete selected[n.id]; else selected[n.id] = true; }
        else { selected = {}; selected[n.id] = true; show(n); }
        paint();
      });
    });

    function shown(n) { return fixed(n) || n.influence <= thr + 1e-9; }
    function draw() {
      while (gEdges.firstChild) gEdges.removeChild(gEdges.firstChild);
      var m = 0, nn = 0, ne = 0;
      links.forEach(function (e) { m = Math.max(m, Math.abs(e.weight)); });
      nodes.forEach(function (n) { var on = shown(n); n.el.style.display = on ? "" : "none"; n.el.setAttribute("data-shown", on ? "1" : "0"); if (on) nn++; });
      links.forEach(function (e) {
        var s = byId[e.source], t = byId[e.target];
        if (!shown(s) || !shown(t)) return;
        var a = Math.sqrt(Math.abs(e.weight) / (m || 1));
        var ln = LS.svg("line", { x1: s.ax[0], y1: s.ax[1], x2: t.ax[0], y2: t.ax[1], stroke: e.weight >= 0 ? POS : NEG,
          "stroke-width": (0.5 + 2.5 * a).toFixed(2), "stroke-opacity": (0.08 + 0.82 * a).toFixed(3),
          "data-edge": e.source + ">" + e.target }, gEdges);
        LS.hover(ln, function (tp) {
          LS.line(tp, [[label(s), 1], [" \u2192 ", 0], [label(t), 1]]);
          LS.line(tp, [["weight ", 0], [LS.fmt(e.weight, 4), 1]]);
        });
        ne++;
      });
      svg.setAttribute("data-nodes", nn); svg.setAttribute("data-edges", ne);
      count.textContent = nn + " of " + nodes.length + " nodes, " + ne + " edges shown";
    }

    // details of the node clicked: its numbers and its strongest edges in and out (a click on one shows that node)
    function show(n) {
      while (panel.firstChild) panel.removeChild(panel.firstChild);
      panel.setAttribute("data-node", n.id);
      var p0 = LS.el("div", "panel", null, panel);
      LS.el("h3", null, label(n) + " \u00b7 " + n.kind, p0);
      var tb = LS.el("table", "kv", null, p0);
      var site = n.kind === "feature" ? (d.layer_sites || {})[String(n.layer)] : null;
      [["node", n.id], ["position", n.position + " " + JSON.stringify(n.token)], ["transcoder", site],
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
          var th = LS.el("th", null, null, tr), a = LS.el("span", "feature-link", label(o), th);
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
        var shape = n.el.tagName === "g" ? n.el.firstChild : n.el;
        var sel = !!selected[n.id], r = ring[n.id];
        shape.setAttribute("stroke", sel ? "#111827" : r || (n.kind === "token" ? "#adb5bd" : n.kind === "logit" ? "#2f9e44" : "none"));
        shape.setAttribute("stroke-width", sel ? 2.4 : r ? 2 : 1);
        n.el.classList.toggle("ls-sel", sel);
      });
      var k = Object.keys(selected).length;
      nsel.textContent = k + " selected (shift-click adds)";
      while (list.firstChild) list.removeChild(list.firstChild);
      supernodes.forEach(function (s, i) {
        var chip = LS.el("span", "tok", null, list), sw = LS.el("span", "sw", null, chip);
        sw.style.cssText = "display:inline-block;width:9px;height:9px;border-radius:50%;margin-right:5px;background:" + RING[i % RING.length];
        LS.el("span", null, s[0] + " (" + (s.length - 1) + ")", chip);
        chip.setAttribute("data-supernode", s[0]);
        LS.hover(chip, function (tp) {
          LS.line(tp, [["supernode ", 0], [s[0], 1]]);
          s.slice(1).forEach(function (id) { LS.line(tp, [[byId[id] ? label(byId[id]) : id, 0]]); });
        });
      });
    }
    bGroup.addEventListener("click", function () {
      var ids = Object.keys(selected), name = input.value.trim();
      if (!ids.length || !name) { say.textContent = "select nodes (click, shift-click) and type a label first"; return; }
      say.textContent = "";
      var done = function (all) { supernodes = all.map(function (s) { return s.slice(); }); selected = {}; input.value = ""; paint(); };
      if (LS.listening("supernode")) LS.emit("supernode", { label: name, ids: ids, done: done });
      else done(supernodes.concat([[name].concat(ids)]));
    });
    bClear.addEventListener("click", function () { selected = {}; paint(); });
    bSave.addEventListener("click", function () {
      var blob = new Blob([JSON.stringify({ model: d.model, tokens: toks, supernodes: supernodes }, null, 1)],
        { type: "application/json" });
      var a = LS.el("a", null, null, document.body);
      a.href = URL.createObjectURL(blob); a.download = "supernodes.json"; a.click();
      setTimeout(function () { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
    });
    draw();
    paint();
  };
})();
