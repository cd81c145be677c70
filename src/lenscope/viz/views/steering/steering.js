/* lenscope report: a steering evaluation (lenscope steer eval --html). Per layer (a switch): the mean effect against
   the multiplier with its bootstrap interval, the damage on held-out text (change in loss, KL) against the
   multiplier, and every held-out input's slope, sorted (red: anti-steerable, grey: unmoved; hover for the text). */
(function () {
  "use strict";
  var GREEN = "#2f9e44", RED = "#e03131", GREY = "#adb5bd", BLUE = "#3b6fd4";

  // a small line chart: series [{xs, ys, colour, band: [[lo, hi], ...] or null, label}] -> svg
  function chart(parent, title, series, xlabel, ylabel) {
    var panel = LS.el("div", "panel", null, parent);
    LS.el("h3", null, title, panel);
    var W = 360, H = 240, left = 54, right = 12, top = 10, bottom = 38;
    var svg = LS.svg("svg", { width: W, height: H, "class": "steer-chart" }, panel);
    var xs = [], ys = [];
    series.forEach(function (s) {
      s.xs.forEach(function (x, i) {
        if (s.ys[i] === null) return;
        xs.push(x); ys.push(s.ys[i]);
        if (s.band && s.band[i][0] !== null) { ys.push(s.band[i][0]); ys.push(s.band[i][1]); }
      });
    });
    if (!xs.length) { LS.el("p", "note", "nothing to draw", panel); return; }
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
    var y0 = Math.min(0, Math.min.apply(null, ys)), y1 = Math.max(0, Math.max.apply(null, ys));
    if (x1 === x0) { x1 += 1; x0 -= 1; }
    if (y1 === y0) { y1 += 1; }
    var X = function (v) { return left + (W - left - right) * (v - x0) / (x1 - x0); };
    var Y = function (v) { return top + (H - top - bottom) * (y1 - v) / (y1 - y0); };
    [y0, 0, y1].forEach(function (v) {
      LS.svg("line", { x1: left, x2: W - right, y1: Y(v), y2: Y(v), stroke: v === 0 ? "#9ca3af" : "#eef0f3" }, svg);
      LS.text(svg, left - 5, Y(v) + 3.5, LS.fmt(v, 2), { "text-anchor": "end", "font-size": 10, fill: "#6b7280" });
    });
    series[0].xs.forEach(function (v) {
      LS.text(svg, X(v), H - bottom + 14, String(v), { "text-anchor": "middle", "font-size": 10, fill: "#6b7280" });
    });
    LS.text(svg, left + (W - left - right) / 2, H - 6, xlabel, { "text-anchor": "middle", "font-size": 11, fill: "#6b7280" });
    LS.text(svg, 12, top + (H - top - bottom) / 2, ylabel, { "text-anchor": "middle", "font-size": 11, fill: "#6b7280",
      transform: "rotate(-90 12 " + (top + (H - top - bottom) / 2) + ")" });
    series.forEach(function (s) {
      if (s.band) {
        var up = [], dn = [];
        s.xs.forEach(function (x, i) { if (s.band[i][0] !== null) { up.push(X(x) + "," + Y(s.band[i][1])); dn.unshift(X(x) + "," + Y(s.band[i][0])); } });
        LS.svg("polygon", { points: up.concat(dn).join(" "), fill: s.colour, "fill-opacity": 0.16, stroke: "none" }, svg);
      }
      var pts = [];
      s.xs.forEach(function (x, i) { if (s.ys[i] !== null) pts.push(X(x) + "," + Y(s.ys[i])); });
      LS.svg("polyline", { points: pts.join(" "), fill: "none", stroke: s.colour, "stroke-width": 1.6 }, svg);
      s.xs.forEach(function (x, i) {
        if (s.ys[i] === null) return;
        var c = LS.svg("circle", { cx: X(x), cy: Y(s.ys[i]), r: 3.2, fill: s.colour }, svg);
        LS.hover(c, function (tp) {
          LS.line(tp, [[s.label + " at \u03b1 = ", 0], [String(x), 1]]);
          LS.line(tp, [["value ", 0], [LS.fmt(s.ys[i], 4), 1]].concat(s.band ? [["   interval ", 0],
            ["[" + LS.fmt(s.band[i][0], 3) + ", " + LS.fmt(s.band[i][1], 3) + "]", 1]] : []));
          if (s.extra) LS.line(tp, [[s.extra.label, 0], [LS.fmt(s.extra.values[i], 3), 1]]);
        });
      });
    });
  }

  function slopes(parent, r, inputs) {
    var panel = LS.el("div", "panel", null, parent);
    LS.el("h3", null, "Per-input slopes (sorted)", panel);
    var order = r.slopes.map(function (s, i) { return i; }).sort(function (a, b) { return r.slopes[a] - r.slopes[b]; });
    var n = order.length, W = 380, H = 220, left = 54, top = 10, bottom = 24, bw = Math.max(1, (W - left - 10) / n);
    var lo = Math.min(0, Math.min.apply(null, r.slope_ci.map(function (c) { return c[0]; }))),
      hi = Math.max(0, Math.max.apply(null, r.slope_ci.map(function (c) { return c[1]; })));
    if (hi === lo) hi = lo + 1;
    var Y = function (v) { return top + (H - top - bottom) * (hi - v) / (hi - lo); };
    var svg = LS.svg("svg", { width: W, height: H, "class": "steer-slopes" }, panel);
    [lo, 0, hi].forEach(function (v) {
      LS.svg("line", { x1: left, x2: W - 10, y1: Y(v), y2: Y(v), stroke: v === 0 ? "#9ca3af" : "#eef0f3" }, svg);
      LS.text(svg, left - 5, Y(v) + 3.5, LS.fmt(v, 3), { "text-anchor": "end", "font-size": 10, fill: "#6b7280" });
    });
    var top_a = Math.max.apply(null, r.multipliers.map(Math.abs)), minEff = r.min_effect;
    order.forEach(function (i, k) {
      var s = r.slopes[i], moved = Math.abs(s) * top_a >= minEff;
      var col = !moved ? GREY : s > 0 ? GREEN : RED;
      var x = left + k * bw;
      LS.svg("line", { x1: x + bw / 2, x2: x + bw / 2, y1: Y(r.slope_ci[i][0]), y2: Y(r.slope_ci[i][1]), stroke: col,
        "stroke-opacity": 0.35 }, svg);
      var b = LS.svg("rect", { x: x, y: Math.min(Y(s), Y(0)), width: Math.max(0.8, bw - 0.4), height: Math.max(0.8, Math.abs(Y(s) - Y(0))),
        fill: col }, svg);
      LS.hover(b, function (tp) {
        var inp = inputs[i];
        LS.line(tp, [["row " + inp.row + ": ", 0], [LS.show(inp.text, 80), 1]]);
        LS.line(tp, [["answers ", 0], [JSON.stringify(inp.answer_positive) + " vs " + JSON.stringify(inp.answer_negative), 1]]);
        LS.line(tp, [["slope ", 0], [LS.fmt(s, 4), 1], ["  interval ", 0], ["[" + LS.fmt(r.slope_ci[i][0], 4) + ", " + LS.fmt(r.slope_ci[i][1], 4) + "]", 1]]);
        LS.line(tp, [["unsteered measure ", 0], [LS.fmt(inp.base_measure, 3), 1]]);
      });
    });
    LS.text(svg, left + (W - left) / 2, H - 6, "held-out input", { "text-anchor": "middle", "font-size": 11, fill: "#6b7280" });
  }

  LS.sections.steering = function (body, d) {
    var keys = Object.keys(d.layers), current = keys[0];
    var dir = d.direction || {};
    var p = LS.el("p", "meta", null, body);
    LS.el("b", null, (dir.method || "?") + " direction at " + (dir.site || "?"), p);
    LS.el("span", null, " · " + d.n_inputs + " held-out inputs · built from " + (dir.n_pairs || "?") + " pairs · damage on " +
      (d.damage && d.damage.data ? d.damage.data + " (" + d.damage.tokens + " tokens)" : "no held-out text"), p);
    var ctl = LS.el("div", "controls", null, body);
    if (keys.length > 1) LS.seg(ctl, "layer", keys, current, function (k) { current = k; redraw(); });
    var out = LS.el("div", null, null, body);
    function redraw() {
      while (out.firstChild) out.removeChild(out.firstChild);
      var r = d.layers[current];
      r.min_effect = (d.settings || {}).min_effect || 0;
      var summary = LS.el("p", "meta", null, out);
      [["steerable ", r.steerable_fraction, r.fraction_ci.steerable], ["   anti-steerable ", r.anti_steerable_fraction, r.fraction_ci.anti_steerable],
        ["   unmoved ", r.unmoved_fraction, r.fraction_ci.unmoved]].forEach(function (f) {
        LS.el("span", null, f[0], summary);
        LS.el("b", null, LS.fmt(f[1], 3), summary);
        LS.el("span", null, " [" + LS.fmt(f[2][0], 2) + ", " + LS.fmt(f[2][1], 2) + "]", summary);
      });
      LS.el("span", null, "   mean slope ", summary);
      LS.el("b", null, LS.fmt(r.mean_slope, 4), summary);
      var row = LS.el("div", "row", null, out);
      chart(row, "Mean effect", [{ xs: r.multipliers, ys: r.mean_effect, band: r.effect_ci, colour: BLUE, label: "mean effect",
        extra: r.wrong_way_fraction ? { label: "inputs moved the wrong way: ", values: r.wrong_way_fraction } : null }],
        "multiplier \u03b1", "effect on logit(+) \u2212 logit(\u2212)");
      if (r.delta_loss) {
        chart(row, "Damage on held-out text", [
          { xs: r.multipliers, ys: r.delta_loss, band: null, colour: RED, label: "\u0394 loss" },
          { xs: r.multipliers, ys: r.kl, band: null, colour: "#f08c2e", label: "KL to unsteered" }],
          "multiplier \u03b1", "nats (red: \u0394 loss, orange: KL)");
      } else {
        LS.el("p", "note", "No damage measured: " + ((d.damage || {}).note || "no held-out text"), row);
      }
      slopes(row, r, d.inputs);
    }
    redraw();
  };
})();
