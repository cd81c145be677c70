/* lenscope report: shared helpers. Every section script registers LS.sections[key] = function (body, data, meta).
   Used by the static report (its data block, drawn by LS.start) and by the app of `lenscope serve` (no data block:
   it draws each view with LS.drawSection as its answer arrives, and listens to the views' LS.emit events). */
(function () {
  "use strict";
  var LS = window.LS = { sections: {}, data: null };
  // the context-attribution methods' names in words (lenscope.attribution.methods is the method table; a method
  // not named here is shown by its name), for every view drawing them (attribution, generation, the app's token panel)
  LS.methodNames = { "alti-logit": "ALTI-Logit", logit: "Logit", "grad-x-input": "grad \u00d7 input",
    "grad-norm": "grad norm", ig: "integrated gradients", erasure: "erasure", alti: "ALTI rollout",
    "value-zeroing": "value zeroing" };
  var NS = "http://www.w3.org/2000/svg";

  // events for exploration: a view calls LS.emit("head", {layer, head}) or LS.emit("token", {position}) when one is
  // clicked; the app listens with LS.on; in the static report nothing listens and a click does nothing
  var listeners = {};
  LS.on = function (name, fn) { (listeners[name] = listeners[name] || []).push(fn); };
  LS.emit = function (name, detail) {
    (listeners[name] || []).forEach(function (fn) {
      try { fn(detail); } catch (e) { console.error("lenscope: a " + name + " listener failed: " + e); }
    });
  };
  // whether anything listens to `name` (a view that can keep what it emits itself, when nothing does)
  LS.listening = function (name) { return !!(listeners[name] && listeners[name].length); };
  // make `node` emit `name` with `detail` on click; class "ls-click" (the app's stylesheet gives it a pointer)
  LS.clickable = function (node, name, detail) {
    node.classList.add("ls-click");
    node.setAttribute("data-emit", name);
    node.addEventListener("click", function () { LS.emit(name, typeof detail === "function" ? detail() : detail); });
    return node;
  };

  // a packed float32 array {shape, f32: base64} -> {shape, data: Float32Array, get(i, j, ...)}
  LS.unpack = function (p) {
    var bin = atob(p.f32), n = bin.length, bytes = new Uint8Array(n);
    for (var i = 0; i < n; i++) bytes[i] = bin.charCodeAt(i);
    var data = new Float32Array(bytes.buffer);
    var shape = p.shape, strides = [], s = 1;
    for (var d = shape.length - 1; d >= 0; d--) { strides[d] = s; s *= shape[d]; }
    return {
      shape: shape, data: data,
      get: function () { var o = 0; for (var k = 0; k < arguments.length; k++) o += arguments[k] * strides[k]; return data[o]; },
      slice2: function (a) { // the matrix at index a of the first axis, as an array of rows
        var rows = [], R = shape[1], C = shape[2], base = a * strides[0];
        for (var r = 0; r < R; r++) rows.push(Array.prototype.slice.call(data, base + r * C, base + (r + 1) * C));
        return rows;
      }
    };
  };
  LS.matrix = function (p) { // a packed 2-D array as rows
    var u = LS.unpack(p), rows = [], C = u.shape[1];
    for (var r = 0; r < u.shape[0]; r++) rows.push(Array.prototype.slice.call(u.data, r * C, (r + 1) * C));
    return rows;
  };

  LS.el = function (tag, cls, text, parent) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  };
  LS.svg = function (tag, attrs, parent) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) if (Object.prototype.hasOwnProperty.call(attrs, k)) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  };
  LS.text = function (parent, x, y, s, attrs) {
    var a = attrs || {}; a.x = x; a.y = y;
    var t = LS.svg("text", a, parent); t.textContent = s; return t;
  };

  // tokens with visible whitespace
  LS.show = function (s, max) {
    if (s === null || s === undefined) return "\u2205";
    var out = s.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5")
      .replace(/[\u0000-\u001f\u007f]/g, function (c) { return "\\x" + ("0" + c.charCodeAt(0).toString(16)).slice(-2); });
    if (!out.length) out = "\u2205";
    if (max && out.length > max) out = out.slice(0, max - 1) + "\u2026";
    return out;
  };
  LS.fmt = function (x, d) {
    if (x === null || x === undefined || !isFinite(x)) return "\u2013";
    if (x !== 0 && Math.abs(x) < 1e-3) return x.toExponential(1);
    return x.toFixed(d === undefined ? 3 : d);
  };

  // colour maps: key colours of viridis / magma, and a blue-white-red diverging ramp
  var RAMPS = {
    viridis: ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"],
    magma: ["#000004", "#1c1044", "#4f127b", "#812581", "#b5367a", "#e55964", "#fb8761", "#fec287", "#fcfdbf"],
    blues: ["#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b"],
    diverging: ["#2b59c3", "#6f93da", "#b3c8ee", "#f7f7f7", "#f4b6a6", "#e3735b", "#c0281b"]
  };
  function hex(h) { return [parseInt(h.substr(1, 2), 16), parseInt(h.substr(3, 2), 16), parseInt(h.substr(5, 2), 16)]; }
  LS.rgb = function (name, t) {
    var stops = RAMPS[name];
    t = Math.max(0, Math.min(1, isFinite(t) ? t : 0));
    var x = t * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(x)), f = x - i;
    var a = hex(stops[i]), b = hex(stops[i + 1]);
    return [0, 1, 2].map(function (j) { return Math.round(a[j] + (b[j] - a[j]) * f); });
  };
  LS.colour = function (name, t) { var c = LS.rgb(name, t); return "rgb(" + c[0] + "," + c[1] + "," + c[2] + ")"; };
  LS.div = function (v, scale) { return LS.colour("diverging", 0.5 + 0.5 * (scale > 0 ? v / scale : 0)); };
  LS.ink = function (rgbstr) { // black or white text on a background
    var m = rgbstr.match(/\d+/g).map(Number);
    var l = m.map(function (v) { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
    return 0.2126 * l[0] + 0.7152 * l[1] + 0.0722 * l[2] > 0.36 ? "#111827" : "#ffffff";
  };
  // horizontal bars of tokens {token, id, value} (a head's or a feature's promoted / suppressed tokens); the
  // tooltip names the value as `label`
  LS.tokenBars = function (parent, items, cls, colour, label) {
    var rowH = 19, left = 120, w = 150, W = left + w + 70, H = items.length * rowH + 4;
    var svg = LS.svg("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, "class": cls }, parent);
    var m = LS.maxAbs(items.map(function (x) { return x.value; })) || 1;
    items.forEach(function (it, i) {
      var y = 2 + i * rowH, bw = Math.max(1.5, w * Math.abs(it.value) / m);
      LS.text(svg, left - 6, y + 13, LS.show(it.token, 16), { "text-anchor": "end", "font-size": 12, "class": "mono" });
      var r = LS.svg("rect", { x: left, y: y + 2, width: bw, height: rowH - 5, rx: 2, fill: colour }, svg);
      LS.text(svg, left + bw + 5, y + 13, LS.fmt(it.value, 3), { "font-size": 11, fill: "#374151" });
      LS.hover(r, function (tp) { LS.line(tp, [["token ", 0], [JSON.stringify(it.token), 1], ["  #" + it.id, 0]]);
        LS.line(tp, [[label + " ", 0], [LS.fmt(it.value, 4), 1]]); });
    });
    return svg;
  };
  LS.maxAbs = function (xs) { var m = 0; xs.forEach(function (x) { if (Math.abs(x) > m) m = Math.abs(x); }); return m; };

  // the tooltip
  var tip = null;
  LS.tip = function (evt, build) {
    if (!tip) { tip = LS.el("div", null, null, document.body); tip.id = "ls-tip"; }
    while (tip.firstChild) tip.removeChild(tip.firstChild);
    build(tip);
    tip.style.display = "block";
    var w = tip.offsetWidth, h = tip.offsetHeight, x = evt.clientX + 14, y = evt.clientY + 14;
    if (x + w > window.innerWidth - 8) x = evt.clientX - w - 14;
    if (y + h > window.innerHeight - 8) y = evt.clientY - h - 14;
    tip.style.left = Math.max(4, x) + "px"; tip.style.top = Math.max(4, y) + "px";
  };
  LS.untip = function () { if (tip) tip.style.display = "none"; };
  LS.hover = function (node, build) {
    node.addEventListener("mousemove", function (e) { LS.tip(e, build); });
    node.addEventListener("mouseleave", LS.untip);
  };
  LS.line = function (parent, parts) { // a tooltip line from [text, bold?] pairs
    var d = LS.el("div", null, null, parent);
    parts.forEach(function (p) { LS.el(p[1] ? "b" : "span", null, p[0], d); });
    return d;
  };

  // segmented buttons: returns {set(value)}; onchange(value) runs on click
  LS.seg = function (parent, label, options, current, onchange) {
    var wrap = LS.el("span", null, null, parent);
    if (label) LS.el("span", "ctl-label", label, wrap);
    var seg = LS.el("span", "seg", null, wrap), buttons = {};
    options.forEach(function (o) {
      var b = LS.el("button", null, o.label || o, seg);
      var v = o.value !== undefined ? o.value : o;
      b.type = "button"; b.setAttribute("data-value", v); buttons[v] = b;
      b.addEventListener("click", function () { set(v); onchange(v); });
    });
    function set(v) { for (var k in buttons) buttons[k].classList.toggle("on", k === String(v)); }
    set(current);
    return { set: set, buttons: buttons };
  };
  LS.slider = function (parent, label, min, max, step, value, onchange, show) {
    var wrap = LS.el("span", null, null, parent);
    LS.el("span", "ctl-label", label, wrap);
    var r = LS.el("input", null, null, wrap);
    r.type = "range"; r.min = min; r.max = max; r.step = step; r.value = value;
    var out = LS.el("span", "readout", null, wrap);
    function upd() { out.textContent = show ? show(Number(r.value)) : r.value; }
    r.addEventListener("input", function () { upd(); onchange(Number(r.value)); });
    upd();
    return r;
  };

  // a heat map: rows x cols of coloured cells with optional labels; returns {svg, draw(values, colourFn)}
  LS.heatmap = function (parent, opts) {
    var R = opts.rows, C = opts.cols, cw = opts.cw || 18, ch = opts.ch || 16;
    var left = opts.left || 60, top = opts.top || 8, bottom = opts.bottom || 60, right = opts.right || 8;
    var W = left + C * cw + right, H = top + R * ch + bottom;
    var svg = LS.svg("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, "class": opts.cls || "heat" }, parent);
    var cells = [], texts = [];
    for (var r = 0; r < R; r++) {
      cells.push([]); texts.push([]);
      for (var c = 0; c < C; c++) {
        var rect = LS.svg("rect", { x: left + c * cw, y: top + r * ch, width: cw - 1, height: ch - 1, rx: 1.5, fill: "#eee" }, svg);
        rect.setAttribute("data-r", r); rect.setAttribute("data-c", c);
        cells[r].push(rect);
        if (opts.cellText) {
          var t = LS.text(svg, left + c * cw + (cw - 1) / 2, top + r * ch + ch / 2 + 3.5, "",
            { "text-anchor": "middle", "font-size": opts.cellFont || 9, "class": "mono", "pointer-events": "none" });
          texts[r].push(t);
        }
        if (opts.tip) (function (rr, cc, node) { LS.hover(node, function (tp) { opts.tip(tp, rr, cc); }); })(r, c, rect);
      }
    }
    (opts.rowLabels || []).forEach(function (s, r) {
      LS.text(svg, left - 5, top + r * ch + ch / 2 + 3.5, s, { "text-anchor": "end", "font-size": 10, fill: "#6b7280", "class": "mono" });
    });
    (opts.colLabels || []).forEach(function (s, c) {
      var x = left + c * cw + cw / 2, y = top + R * ch + 6;
      LS.text(svg, x, y, s, { "text-anchor": "end", "font-size": 10, fill: "#374151", "class": "mono",
        transform: "rotate(-55 " + x + " " + y + ")" });
    });
    return {
      svg: svg, cells: cells,
      draw: function (colourAt, textAt) {
        for (var r = 0; r < R; r++) for (var c = 0; c < C; c++) {
          var col = colourAt(r, c);
          cells[r][c].setAttribute("fill", col);
          if (opts.cellText && textAt) { texts[r][c].textContent = textAt(r, c); texts[r][c].setAttribute("fill", LS.ink(col)); }
        }
      }
    };
  };

  LS.legendRamp = function (parent, name, lo, hi, w) {
    var span = LS.el("span", "legend", null, parent);
    LS.el("span", null, lo, span);
    var svg = LS.svg("svg", { width: w || 140, height: 11 }, span), n = 24, ww = (w || 140) / n;
    for (var i = 0; i < n; i++) LS.svg("rect", { x: i * ww, y: 0, width: ww + 0.5, height: 11, fill: LS.colour(name, i / (n - 1)) }, svg);
    var hiEl = LS.el("span", null, hi, span);
    return { setHi: function (s) { hiEl.textContent = s; } };
  };

  // draw one view into `body` (emptied first); false (with the reason written in `body`) when it cannot be drawn
  LS.drawSection = function (body, key, data, meta) {
    while (body.firstChild) body.removeChild(body.firstChild);
    var draw = LS.sections[key];
    if (!draw) { console.error("lenscope report: no renderer for section " + key); body.textContent = "No renderer for this view."; return false; }
    try { draw(body, data, meta || {}); return true; }
    catch (e) {
      console.error("lenscope report: section " + key + " failed: " + e);
      while (body.firstChild) body.removeChild(body.firstChild);
      body.textContent = "This view could not be drawn: " + e;
      return false;
    }
  };

  // the static report: draw every section of its data block (read here, not when this script loads)
  LS.start = function () {
    var block = document.getElementById("lenscope-data");
    LS.data = block ? JSON.parse(block.textContent) : { meta: {}, sections: [] };
    LS.data.sections.forEach(function (sec) {
      if (sec.note || !sec.data) return;
      var body = document.querySelector('#sec-' + sec.key + ' .body');
      if (!body) { console.error("lenscope report: no card for section " + sec.key); return; }
      LS.drawSection(body, sec.key, sec.data, LS.data.meta);
    });
    document.body.setAttribute("data-ready", "1");
  };
})();
