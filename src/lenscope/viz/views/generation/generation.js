/* lenscope report: a generated continuation explained token by token (lenscope.generate's to_dict()).
   (a) the text as a strip: prompt tokens grey, each generated token coloured by its probability or its prediction
   depth; clicking one shows its explanation by every method over all earlier tokens; (b) a matrix per method
   (generated token x source token); hover for the numbers, click a row to select that step. */
(function () {
  "use strict";
  var NAMES = LS.methodNames;  // core.js
  var EMPTY = "#f3f4f6", BLANK = "#e2e5e9"; // prompt tokens in the strip; matrix cells past a step's position

  function name(m) { return NAMES[m] || m; }
  function depthOf(g, key) { // a number, null (never settles), or {lens: depth} with the logit lens first
    var v = g[key || "depth"];
    if (v !== null && typeof v === "object") v = v.logit !== undefined ? v.logit : v[Object.keys(v)[0]];
    return v === undefined || v === null || v < 0 ? null : v;
  }
  function tokenRef(t) { return t ? JSON.stringify(t.token) + " #" + t.id : "\u2013"; }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  LS.sections.generation = function (body, d, meta) {
    var G = d.generated, methods = d.methods, toks = d.tokens, P = d.prompt_tokens.length;
    if (!G.length) { LS.el("p", "note", "Nothing was generated.", body); return; }
    var colourBy = "prob", method = methods[0], sel = 0, rowScale = false;
    var tuned = G.some(function (g) { return g.tuned_depth !== undefined; });
    var nLayers = (meta && typeof meta.n_layers === "number") ? meta.n_layers : null;
    if (nLayers === null) {
      nLayers = 1;
      G.forEach(function (g) { [depthOf(g), depthOf(g, "tuned_depth")].forEach(function (v) { if (v !== null && v > nLayers) nLayers = v; }); });
    }
    var stepAt = {}; G.forEach(function (g, k) { stepAt[g.position] = k; });

    // ---- (a) the strip
    var ctl = LS.el("div", "controls", null, body);
    var cw1 = LS.el("span", null, null, ctl); cw1.setAttribute("data-role", "colour");
    var colourOptions = [{ value: "prob", label: "probability" }, { value: "depth", label: "prediction depth" }];
    if (tuned) colourOptions.push({ value: "tuned_depth", label: "depth (tuned lens)" });
    LS.seg(cw1, "colour by", colourOptions, colourBy, function (v) { colourBy = v; drawStrip(); });
    var lg = LS.el("span", null, null, ctl);
    LS.el("span", "meta", G.length + " generated tokens after a prompt of " + P + "; click one (or use \u2190 \u2192) to " +
      "see what wrote it", ctl);
    var strip = LS.el("div", "tokens", null, body);
    strip.setAttribute("data-role", "strip");
    strip.tabIndex = 0; // the arrow keys step through the generated tokens
    strip.addEventListener("keydown", function (e) {
      var k = e.key === "ArrowRight" ? sel + 1 : e.key === "ArrowLeft" ? sel - 1 : null;
      if (k !== null && k >= 0 && k < G.length) { e.preventDefault(); select(k); }
    });
    var spans = toks.map(function (t, i) {
      var s = LS.el("span", "tok", LS.show(t), strip), k = stepAt[i];
      s.setAttribute("data-pos", i);
      if (k === undefined) { // a prompt token (or one never explained)
        s.style.background = EMPTY; s.style.color = "#9ca3af";
        LS.hover(s, function (tp) { LS.line(tp, [["prompt token " + i + "  ", 0], [JSON.stringify(t), 1]]); });
        return s;
      }
      var g = G[k];
      s.setAttribute("data-step", k);
      s.style.cursor = "pointer";
      s.addEventListener("click", function () { select(k); });
      LS.hover(s, function (tp) {
        LS.line(tp, [["step " + (k + 1) + " \u00b7 position " + g.position + "  ", 0], [JSON.stringify(g.token), 1]]);
        LS.line(tp, [["probability ", 0], [LS.fmt(g.prob, 4), 1], ["  entropy ", 0], [LS.fmt(g.entropy, 3) + " nats", 1]]);
        LS.line(tp, [["runner-up ", 0], [tokenRef(g.runner_up), 1]]);
        var dv = depthOf(g);
        LS.line(tp, [["prediction depth ", 0], [dv === null ? "never settles" : String(dv), 1]]);
        if (tuned) { var tv = depthOf(g, "tuned_depth"); LS.line(tp, [["tuned lens depth ", 0], [tv === null ? "never settles" : String(tv), 1]]); }
      });
      return s;
    });
    function stripColour(g) {
      if (colourBy === "prob") return LS.colour("viridis", g.prob);
      var v = depthOf(g, colourBy);
      return v === null ? "#d1d5db" : LS.colour("magma", 1 - v / Math.max(1, nLayers));
    }
    function drawStrip() {
      G.forEach(function (g, k) {
        var s = spans[g.position], c = stripColour(g);
        s.style.background = c; s.style.color = LS.ink(c);
        s.style.outline = k === sel ? "2px solid #111827" : "none";
        s.style.outlineOffset = "1px";
      });
      clear(lg);
      if (colourBy === "prob") LS.legendRamp(lg, "viridis", "probability 0", "1", 110);
      else LS.legendRamp(lg, "magma", "depth " + nLayers + " (late)", "0 (early); grey: never settles", 110);
    }

    // ---- the chosen step's explanation
    var detail = LS.el("div", "panel", null, body);
    detail.setAttribute("data-role", "detail");
    function drawDetail() {
      var g = G[sel];
      clear(detail);
      detail.setAttribute("data-step", sel);
      LS.el("h3", null, "Step " + (sel + 1) + " of " + G.length + " \u00b7 position " + g.position + " \u00b7 " +
        JSON.stringify(g.token), detail);
      var dv = depthOf(g), tv = tuned ? depthOf(g, "tuned_depth") : null;
      var facts = LS.el("div", "meta", null, detail);
      facts.setAttribute("data-role", "facts");
      facts.textContent = "id #" + g.id + " \u00b7 probability " + LS.fmt(g.prob, 4) + " \u00b7 entropy " + LS.fmt(g.entropy, 3) +
        " nats \u00b7 runner-up " + tokenRef(g.runner_up) + " \u00b7 prediction depth " + (dv === null ? "never settles" : dv) +
        (tuned ? " (tuned lens: " + (tv === null ? "never settles" : tv) + ")" : "") +
        " \u00b7 foil " + (g.foil ? tokenRef(g.foil) + " (contrastive methods explain the token rather than the foil)" : "none");
      methods.forEach(function (m) {
        var e = g.explanations[m];
        var box = LS.el("div", null, null, detail);
        box.setAttribute("data-method", m);
        var head = LS.el("div", "meta", null, box);
        LS.el("b", null, name(m), head);
        if (!e) { LS.el("span", null, "  (no explanation for this step)", head); return; }
        var sc = e.scores, mx = LS.maxAbs(sc), best = sc.map(function (v, j) { return j; })
          .sort(function (a, b) { return Math.abs(sc[b]) - Math.abs(sc[a]); }).slice(0, 3);
        LS.el("span", null, "  invariant error " + LS.fmt(e.invariant_error) + " \u00b7 strongest: " +
          best.map(function (j) { return LS.show(toks[j], 14) + " " + LS.fmt(sc[j], 3); }).join(", "), head);
        var row = LS.el("div", "tokens", null, box);
        row.style.fontSize = "12px"; row.style.margin = "2px 0 8px";
        sc.forEach(function (v, j) {
          var s = LS.el("span", "tok", LS.show(toks[j]), row), c = LS.div(v, mx);
          s.style.background = c; s.style.color = LS.ink(c);
          if (j >= P) s.style.borderBottom = "2px solid #3b5bdb"; // generated earlier
          LS.hover(s, function (tp) {
            LS.line(tp, [[name(m) + " \u00b7 source " + j + " ", 0], [JSON.stringify(toks[j]), 1]]);
            LS.line(tp, [["score ", 0], [LS.fmt(v, 5), 1], [j >= P ? "  (generated)" : "  (prompt)", 0]]);
          });
        });
      });
    }

    if (!methods.length) { drawStrip(); drawDetail(); return; }

    // ---- (b) the matrix: generated tokens x source tokens, one method at a time
    var panel = LS.el("div", "panel", null, body);
    LS.el("h3", null, "Every step at once: generated token (row) \u00d7 source token (column)", panel);
    var ctl2 = LS.el("div", "controls", null, panel);
    var mw = LS.el("span", null, null, ctl2); mw.setAttribute("data-role", "method");
    LS.seg(mw, "method", methods.map(function (m) { return { value: m, label: name(m) }; }), method,
      function (m) { method = m; drawMatrix(); drawSelection(); });
    var lab = LS.el("label", "ctl-label", null, ctl2), cb = LS.el("input", null, null, lab);
    cb.type = "checkbox"; LS.el("span", null, " each row on its own scale", lab);
    cb.addEventListener("change", function () { rowScale = cb.checked; drawMatrix(); });
    var lg2 = LS.el("span", null, null, ctl2);
    var C = 0; G.forEach(function (g) { if (g.position > C) C = g.position; });
    var cw = Math.max(10, Math.min(26, Math.floor(900 / C))), ch = 16, left = 96, top = 8;
    var hm = LS.heatmap(panel, { rows: G.length, cols: C, cw: cw, ch: ch, left: left, top: top, bottom: 76,
      rowLabels: G.map(function (g) { return LS.show(g.token, 12); }),
      colLabels: toks.slice(0, C).map(function (t) { return LS.show(t, 12); }), cls: "gen-matrix",
      tip: function (tp, r, c) {
        var g = G[r], e = g.explanations[method];
        LS.line(tp, [["step " + (r + 1) + " ", 0], [JSON.stringify(g.token), 1], ["  from source " + c + " ", 0], [JSON.stringify(toks[c]), 1]]);
        if (c >= g.position || !e) LS.line(tp, [["(after this step's position: no score)", 0]]);
        else LS.line(tp, [[name(method) + " ", 0], [LS.fmt(e.scores[c], 5), 1], ["  probability ", 0], [LS.fmt(g.prob, 3), 0]]);
      } });
    hm.svg.setAttribute("data-role", "matrix");
    hm.cells.forEach(function (row, r) { row.forEach(function (cell) { cell.style.cursor = "pointer"; cell.addEventListener("click", function () { select(r); }); }); });
    if (P > 0 && P < C) LS.svg("line", { x1: left + P * cw - 0.5, x2: left + P * cw - 0.5, y1: top - 4, y2: top + G.length * ch + 2,
      stroke: "#3b5bdb", "stroke-width": 1.5, "stroke-dasharray": "3 2", "pointer-events": "none" }, hm.svg);
    var marker = LS.svg("rect", { x: left - 2, width: C * cw + 3, height: ch + 1, fill: "none", stroke: "#111827",
      "stroke-width": 1.5, rx: 2, "pointer-events": "none", "class": "selected" }, hm.svg);
    function score(r, c) { var e = G[r].explanations[method]; return e && c < e.scores.length ? e.scores[c] : null; }
    function drawMatrix() {
      var all = 0, rowMax = G.map(function (g) { var e = g.explanations[method]; var m = e ? LS.maxAbs(e.scores) : 0; if (m > all) all = m; return m; });
      hm.draw(function (r, c) { var v = score(r, c); return v === null ? BLANK : LS.div(v, rowScale ? rowMax[r] : all); });
      hm.svg.setAttribute("data-method", method);
      clear(lg2);
      LS.legendRamp(lg2, "diverging", rowScale ? "-row max" : LS.fmt(-all, 2), rowScale ? "+row max" : LS.fmt(all, 2), 120);
    }
    function drawSelection() { marker.setAttribute("y", top + sel * ch - 1); }
    function select(k) { sel = k; drawStrip(); drawDetail(); if (methods.length) drawSelection(); }

    drawStrip(); drawDetail(); drawMatrix(); drawSelection();
  };
})();
