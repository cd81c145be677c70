/* lenscope report: the source-target alignment of a translation (encoder-decoder) model. For the method chosen: the
   matrix of every target token (rows) over the source tokens, beside it the same rows over the target-prefix tokens
   (the decoder's input), both on one scale; the word-level matrix with each target word's best source word (dots)
   and the gold sure (solid) / possible (dashed) links; each method's AER against them. */
(function () {
  "use strict";
  var NAMES = LS.methodNames;  // core.js
  var EMPTY = "#f3f4f6";       // a prefix token the row's prediction did not read (its own and later tokens)

  function key(i, j) { return i + "," + j; }
  function linkSet(list) { var s = {}; (list || []).forEach(function (l) { s[key(l[0], l[1])] = true; }); return s; }
  // an outline over cell (r, c) of a heat map: gold links, solid for sure and dashed for possible
  function outline(hm, r, c, cls) {
    var cell = hm.cells[r][c];
    var o = LS.svg("rect", { x: Number(cell.getAttribute("x")) + 0.5, y: Number(cell.getAttribute("y")) + 0.5,
      width: Number(cell.getAttribute("width")) - 1, height: Number(cell.getAttribute("height")) - 1, fill: "none",
      "class": cls, "pointer-events": "none" }, hm.svg);
    o.setAttribute("data-gold", r + "," + c);
    return o;
  }

  LS.sections.alignment = function (body, d) {
    var methods = Object.keys(d.methods), current = methods[0], S = d.n_source;
    var M = {}; methods.forEach(function (m) { M[m] = LS.matrix(d.methods[m].scores); });
    var rows = d.target_tokens, src = d.source_tokens, pre = d.prefix_tokens, R = rows.length;
    var W = d.words, sure = linkSet(d.gold && d.gold.sure), poss = linkSet(d.gold && d.gold.possible);
    var ctl = LS.el("div", "controls", null, body);
    var seg = LS.seg(ctl, "method", methods.map(function (m) { return { value: m, label: NAMES[m] || m }; }), current,
      function (m) { current = m; draw(); });
    seg.buttons[current].parentNode.setAttribute("data-role", "align-methods");
    LS.el("span", "meta", "row i: the prediction of target token i (the reference's own); red = towards it, blue = " +
      "against; one scale for the source and the prefix", ctl);

    Object.keys(d.notes || {}).forEach(function (m) {
      LS.el("p", "note", (NAMES[m] || m) + " is left out: " + d.notes[m], body).setAttribute("data-role", "align-note");
    });
    var row = LS.el("div", "row", null, body);
    var rowLabels = rows.map(function (t, i) { return i + " " + LS.show(t, 10); });
    var cw = Math.max(14, Math.min(28, Math.floor(560 / Math.max(S, 1)))), ch = Math.max(12, Math.min(20, Math.floor(420 / R)));
    function tipAt(part) {
      return function (tp, r, c) {
        var col = part === "source" ? c : S + c, tok = part === "source" ? src[c] : pre[c];
        LS.line(tp, [[(NAMES[current] || current) + " \u00b7 target " + r + " ", 0], [JSON.stringify(rows[r]), 1]]);
        LS.line(tp, [[part + " token " + c + " ", 0], [JSON.stringify(tok), 1]]);
        if (part === "prefix" && c > r) LS.line(tp, [["not read by this prediction (its own or a later token)", 0]]);
        else LS.line(tp, [["score ", 0], [LS.fmt(M[current][r][col], 5), 1]]);
        if (W && part === "source") {
          var sw = W.source_of[c], tw = W.target_of[r];
          if (sw !== null && tw !== null) {
            var k = key(sw, tw);
            LS.line(tp, [["words ", 0], [JSON.stringify(W.target[tw]) + " \u2190 " + JSON.stringify(W.source[sw]), 1],
              [sure[k] ? "  gold: sure" : poss[k] ? "  gold: possible" : "", 0]]);
          }
        }
      };
    }
    var p1 = LS.el("div", "panel", null, row);
    LS.el("h3", null, "Source", p1);
    var hs = LS.heatmap(p1, { rows: R, cols: S, cw: cw, ch: ch, left: 110, bottom: 70, rowLabels: rowLabels,
      colLabels: src.map(function (t) { return LS.show(t, 12); }), cls: "align-source", tip: tipAt("source") });
    var p2 = LS.el("div", "panel", null, row);
    LS.el("h3", null, "Target prefix", p2);
    var hp = LS.heatmap(p2, { rows: R, cols: pre.length, cw: cw, ch: ch, left: 110, bottom: 70, rowLabels: rowLabels,
      colLabels: pre.map(function (t) { return LS.show(t, 12); }), cls: "align-prefix", tip: tipAt("prefix") });
    if (W && d.gold) {  // the gold links on the token matrix: every (target token, source token) of a linked word pair
      for (var r = 0; r < R; r++) for (var c = 0; c < S; c++) {
        var sw = W.source_of[c], tw = W.target_of[r];
        if (sw === null || tw === null) continue;
        var k = key(sw, tw);
        if (sure[k]) outline(hs, r, c, "gold-sure"); else if (poss[k]) outline(hs, r, c, "gold-possible");
      }
    }
    var lg = LS.el("div", null, null, body), info = LS.el("div", "meta", null, body);

    var word = null, dots = [], links = null;
    if (W) {
      var row2 = LS.el("div", "row", null, body);
      var p3 = LS.el("div", "panel", null, row2);
      LS.el("h3", null, "Words: each target word's best source word", p3);
      var WS = {}; methods.forEach(function (m) { WS[m] = LS.matrix(W.scores[m]); });
      // with W.null: one more column, the source's end token, which links nothing (a target word it wins has no link)
      var cols = W.source.concat(W.null !== null && W.null !== undefined ? ["\u2205 end"] : []);
      var wc = Math.max(22, Math.min(44, Math.floor(480 / cols.length)));
      word = LS.heatmap(p3, { rows: W.target.length, cols: cols.length, cw: wc, ch: 22, left: 110, bottom: 70,
        rowLabels: W.target.map(function (w) { return LS.show(w, 14); }),
        colLabels: cols.map(function (w, i) { return i < W.source.length ? LS.show(w, 14) : w; }), cls: "align-words",
        tip: function (tp, r, c) {
          var k = key(c, r);
          LS.line(tp, [[JSON.stringify(W.target[r]) + " \u2190 " + (c < W.source.length ? JSON.stringify(W.source[c]) :
            "the source's end token (no link)"), 1]]);
          LS.line(tp, [["score (the source word's tokens summed, over the target word's tokens) ", 0],
            [LS.fmt(WS[current][r][c], 5), 1]]);
          LS.line(tp, [[(linkSet(d.links[current])[k] ? "the best source word" : "") +
            (sure[k] ? "  gold: sure" : poss[k] ? "  gold: possible" : ""), 0]]);
        } });
      if (d.gold) {
        d.gold.sure.forEach(function (l) { outline(word, l[1], l[0], "gold-sure"); });
        d.gold.possible.forEach(function (l) { outline(word, l[1], l[0], "gold-possible"); });
      }
      var p4 = LS.el("div", "panel", null, row2);
      LS.el("h3", null, "Links", p4);
      links = LS.el("table", "kv align-links", null, p4);
    }
    var aer = null;
    if (d.aer) {
      var p5 = LS.el("div", "panel", null, body);
      LS.el("h3", null, "Against the gold alignment", p5);
      aer = LS.el("table", "checks align-aer", null, p5);
      var hr = LS.el("tr", null, null, aer);
      ["method", "AER", "precision", "recall", "|A|", "|S|", "|A\u2229S|", "|A\u2229P|"].forEach(function (h) { LS.el("th", null, h, hr); });
      methods.forEach(function (m) {
        var a = d.aer[m], tr = LS.el("tr", null, null, aer);
        tr.setAttribute("data-method", m);
        LS.el("td", null, NAMES[m] || m, tr);
        [a.aer, a.precision, a.recall].forEach(function (v, i) {
          var td = LS.el("td", "num", LS.fmt(v, 4), tr); td.setAttribute("data-value", String(v));
          td.setAttribute("data-role", ["aer", "precision", "recall"][i]);
        });
        [a.predicted, a.sure, a.predicted_sure, a.predicted_possible].forEach(function (v) { LS.el("td", "num", String(v), tr); });
      });
      LS.el("p", "meta", "AER = 1 \u2212 (|A\u2229S| + |A\u2229P|) / (|A| + |S|): A the method's links, S the sure and P the " +
        "possible gold links (Och & Ney 2003); lower is better", p5);
    } else if (!d.gold) {
      LS.el("p", "meta", "Give gold links (lenscope report --gold FILE) to see them here and each method's AER.", body);
    }

    function draw() {
      var m = M[current], hi = 0;
      for (var r = 0; r < R; r++) for (var c = 0; c < S + r + 1 && c < m[r].length; c++) hi = Math.max(hi, Math.abs(m[r][c]));
      hs.draw(function (r, c) { return LS.div(m[r][c], hi); });
      hp.draw(function (r, c) { return c > r ? EMPTY : LS.div(m[r][S + c], hi); });
      while (lg.firstChild) lg.removeChild(lg.firstChild);
      LS.legendRamp(lg, "diverging", LS.fmt(-hi, 3), LS.fmt(hi, 3), 140);
      var inSrc = 0, all = 0;
      for (r = 0; r < R; r++) for (c = 0; c < m[r].length; c++) { all += Math.abs(m[r][c]); if (c < S) inSrc += Math.abs(m[r][c]); }
      info.textContent = (NAMES[current] || current) + ": the source holds " + LS.fmt(all > 0 ? 100 * inSrc / all : 0, 1) +
        "% of the total |score|, the target prefix the rest";
      if (aer) aer.querySelectorAll("tr[data-method]").forEach(function (tr) {
        tr.classList.toggle("on", tr.getAttribute("data-method") === current); });
      if (!word) return;
      var w = LS.matrix(W.scores[current]), wh = 0;
      w.forEach(function (rr) { rr.forEach(function (v) { wh = Math.max(wh, Math.abs(v)); }); });
      word.draw(function (r, c) { return LS.div(w[r][c], wh); });
      dots.forEach(function (x) { x.remove(); }); dots = [];
      while (links.firstChild) links.removeChild(links.firstChild);
      var best = {};
      d.links[current].forEach(function (l) {
        best[l[1]] = l[0];
        var cell = word.cells[l[1]][l[0]];
        var dot = LS.svg("circle", { cx: Number(cell.getAttribute("x")) + Number(cell.getAttribute("width")) / 2,
          cy: Number(cell.getAttribute("y")) + Number(cell.getAttribute("height")) / 2, r: 3.5, "class": "link",
          "pointer-events": "none" }, word.svg);
        dot.setAttribute("data-link", l[0] + "-" + l[1]);
        dots.push(dot);
      });
      W.target.forEach(function (tw, j) {
        var tr = LS.el("tr", null, null, links), i = best[j], k = key(i, j);
        LS.el("th", null, tw, tr);
        LS.el("td", null, "\u2190 " + (i === undefined ? "\u2013 (no link)" : W.source[i]) +
          (d.gold ? (sure[k] ? "  \u2713 sure" : poss[k] ? "  \u2713 possible" : "  \u2717") : ""), tr);
      });
    }
    draw();
  };
})();
