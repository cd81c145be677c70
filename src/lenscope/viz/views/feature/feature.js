/* lenscope report: one feature's card (lenscope dict show, FeatureCard), headed by its label where cached.
   Its top-activating contexts from held-out text (each token coloured by the feature's activation, the maximum
   outlined), the histogram of its activations with its density, and the tokens its decoder direction promotes and
   suppresses through the readout.
   LS.featureCard(parent, card) draws one card anywhere (the features view and the app's panel use it). */
(function () {
  "use strict";
  var GREEN = "#2f9e44", RED = "#e03131", ORANGE = "#f08c2e";

  function histogram(parent, h, density) {
    var counts = h.counts, edges = h.edges, n = counts.length;
    var W = 360, H = 170, left = 46, bottom = 30, top = 8, right = 8, bw = (W - left - right) / n;
    var svg = LS.svg("svg", { width: W, height: H, "class": "feature-hist" }, parent);
    var m = Math.max.apply(null, counts.concat([1]));
    var Y = function (c) { return top + (H - top - bottom) * (1 - c / m); };
    [0, m].forEach(function (v) {
      LS.svg("line", { x1: left, x2: W - right, y1: Y(v), y2: Y(v), stroke: "#eef0f3" }, svg);
      LS.text(svg, left - 5, Y(v) + 3.5, String(v), { "text-anchor": "end", "font-size": 10, fill: "#6b7280" });
    });
    counts.forEach(function (c, i) {
      var r = LS.svg("rect", { x: left + i * bw, y: Y(c), width: Math.max(0.8, bw - 1), height: H - bottom - Y(c), fill: ORANGE }, svg);
      LS.hover(r, function (tp) { LS.line(tp, [["activation ", 0], [LS.fmt(edges[i], 3) + " \u2013 " + LS.fmt(edges[i + 1], 3), 1]]);
        LS.line(tp, [["tokens ", 0], [String(c), 1]]); });
    });
    LS.text(svg, left, H - bottom + 14, LS.fmt(edges[0], 2), { "font-size": 10, fill: "#6b7280" });
    LS.text(svg, W - right, H - bottom + 14, LS.fmt(edges[n], 2), { "text-anchor": "end", "font-size": 10, fill: "#6b7280" });
    LS.text(svg, left + (W - left - right) / 2, H - 4, "activation (active tokens only)", { "text-anchor": "middle", "font-size": 11, fill: "#6b7280" });
  }

  LS.featureCard = function (parent, d) {
    var wrap = LS.el("div", "feature-card", null, parent);
    wrap.setAttribute("data-feature", d.site + "#" + d.feature);
    var p = LS.el("p", "meta", null, wrap);
    LS.el("b", null, d.site + " #" + d.feature, p);
    if (d.label) LS.el("b", null, " " + d.label, p).setAttribute("data-role", "feature-label");
    LS.el("span", null, " \u00b7 " + d.role + " " + d.kind + " of width " + d.width + " \u00b7 density ", p);
    LS.el("b", "feature-density", LS.fmt(d.density, 5), p);
    LS.el("span", null, " (" + d.active + " of " + d.tokens + " held-out tokens) \u00b7 max " + LS.fmt(d.max_activation, 3) +
      " \u00b7 mean when active " + LS.fmt(d.mean_activation, 3), p);
    LS.el("h3", null, "Top-activating contexts (held-out text)", wrap);
    var list = LS.el("div", "feature-contexts", null, wrap);
    if (!d.contexts.length) LS.el("p", "note", "This feature is never active on these held-out tokens.", list);
    var top = d.max_activation || 1;
    d.contexts.forEach(function (c, r) {
      var row = LS.el("div", "tokens feature-context", null, list);
      var lead = LS.el("span", "meta", LS.fmt(c.max, 3), row);
      lead.style.minWidth = "52px";
      c.tokens.forEach(function (t, i) {
        if (t === null) return;
        var v = c.values[i], col = v > 0 ? LS.colour("magma", 1 - 0.8 * Math.min(1, v / top)) : "rgb(255,255,255)";
        var s = LS.el("span", "tok", LS.show(t), row);
        s.style.background = col; s.style.color = LS.ink(col);
        if (i === c.center) s.classList.add("pred");
        LS.hover(s, function (tp) { LS.line(tp, [["token ", 0], [JSON.stringify(t), 1]]);
          LS.line(tp, [["activation ", 0], [LS.fmt(v, 4), 1]]);
          LS.line(tp, [["context " + (r + 1) + " \u00b7 held-out sequence " + c.sequence + ", position " + (c.position - c.center + i), 0]]); });
      });
    });
    var rowd = LS.el("div", "row", null, wrap);
    var a = LS.el("div", "panel", null, rowd);
    LS.el("h3", null, "Activation histogram", a);
    histogram(a, d.histogram, d.density);
    var b = LS.el("div", "panel", null, rowd);
    LS.el("h3", null, "Its decoder direction promotes", b);
    LS.tokenBars(b, d.promoted, "feature-promoted", GREEN, "logit change per unit activation");
    var c2 = LS.el("div", "panel", null, rowd);
    LS.el("h3", null, "and suppresses", c2);
    LS.tokenBars(c2, d.suppressed, "feature-suppressed", RED, "logit change per unit activation");
    LS.el("p", "meta", "Logit change per unit activation along the direct path (decoder row" +
      (d.role !== "sae" || /^(attn|mlp)_out/.test(d.site) ? " through the sub-layer's write" : "") +
      ", the final norm's weight, the unembedding); text: " + d.data, wrap);
    return wrap;
  };

  LS.sections.feature = function (body, d) { LS.featureCard(body, d); };
})();
