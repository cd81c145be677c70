/* lenscope serve: the app page. Asks the server's API for each view and draws it with the report's own scripts
   (LS.drawSection) as its answer arrives; the views' click events (LS.emit "head", "token", "target", "feature") open
   the head, token and feature panels, and the graph view's "supernode" is kept on the server. The state (model, text,
   target, foil, corrupted; a translation model's source and gold links) lives in the URL's query string. A translation
   (encoder-decoder) model has one view, the source-target alignment (api/alignment): its text is the target. */
(function () {
  "use strict";
  var $ = function (id) { return document.getElementById(id); };
  var FIELDS = ["text", "target", "foil", "corrupted", "source", "gold"];
  // the served encoder-decoder (translation) models: a source field and the alignment view (app_html's seq2seq)
  var SEQ2SEQ = JSON.parse(document.body.getAttribute("data-seq2seq") || "[]");
  var ONE_TEXT = ["target", "foil", "corrupted"];  // the fields of a decoder's prediction, hidden for a translation
  // the page asks for these views, each group one request, in this order (fast views first): app_html's GROUPS
  var GROUPS = (document.body.getAttribute("data-groups") || "").split(";").map(function (g) { return g.split(","); });
  var TOKEN = new URLSearchParams(location.search).get("token");
  var body = document.body;

  var shown = null;      // the state whose views are on the page: {model, text, target, foil, corrupted}
  var resolved = null;   // {target: {token, id} | null, foil: ..., tokens: [...], meta} from the first answer
  var runCtl = null;     // AbortController of the run in flight
  var panelCtl = null;   // AbortController of the panel's request
  var runId = 0;
  var auto = { target: false, foil: false };  // filled in from the model's prediction, not typed
  var timer = null;

  // ---------------------------------------------------------------- the API
  function api(path, payload, signal) {
    var h = {};
    if (payload !== undefined) h["Content-Type"] = "application/json";
    if (TOKEN) h.Authorization = "Bearer " + TOKEN;
    return fetch(path, { method: payload === undefined ? "GET" : "POST", headers: h, signal: signal,
                         body: payload === undefined ? undefined : JSON.stringify(payload), cache: "no-store" })
      .then(function (r) {
        return r.text().then(function (t) {
          var j = null;
          try { j = JSON.parse(t); } catch (e) { j = null; }
          if (!r.ok) {
            var err = new Error((j && j.error) || ("the server answered " + r.status + " to " + path));
            err.status = r.status; throw err;
          }
          if (j === null) throw new Error("the server's answer to " + path + " is not JSON");
          return j;
        });
      });
  }
  function aborted(e) { return e && (e.name === "AbortError"); }

  // ---------------------------------------------------------------- messages and progress
  function say(text, info) {
    var m = $("msg");
    m.textContent = String(text).split("\n")[0];
    m.title = String(text);
    m.classList.toggle("info", !!info);
    m.hidden = false;
  }
  function unsay() { $("msg").hidden = true; $("msg").textContent = ""; }

  function cards() { return Array.prototype.slice.call(document.querySelectorAll("section.card[data-section]")); }
  function card(key) { return $("sec-" + key); }
  function setStatus(el, state, text, spin) {
    var st = el.querySelector(".status");
    el.setAttribute("data-state", state);
    while (st.firstChild) st.removeChild(st.firstChild);
    if (spin) LS.el("span", "spin", null, st);
    if (text) LS.el("span", state === "error" ? "err" : null, text, st);
  }
  function tick() { // the elapsed time of every view still computing
    var now = performance.now(), any = false;
    document.querySelectorAll("[data-state=running]").forEach(function (el) {
      var t0 = Number(el.getAttribute("data-t0")), st = el.querySelector(".status span:last-child");
      if (st && t0) st.textContent = "computing\u2026 " + ((now - t0) / 1000).toFixed(1) + " s";
      any = true;
    });
    if (!any && timer) { clearInterval(timer); timer = null; }
  }
  function running(el) {
    el.setAttribute("data-t0", String(performance.now()));
    setStatus(el, "running", "computing\u2026", true);
    if (!timer) timer = setInterval(tick, 100);
  }

  // ---------------------------------------------------------------- the state and the URL
  function read() {
    var s = { model: $("model").value };
    FIELDS.forEach(function (f) { var v = $(f).value; if (v !== "" && !(auto[f])) s[f] = v; });
    return s;
  }
  function same(a, b) {
    if (!a || !b) return false;
    return ["model"].concat(FIELDS).every(function (k) { return (a[k] || "") === (b[k] || ""); });
  }
  function query(s, withToken) {
    var q = new URLSearchParams();
    ["model"].concat(FIELDS).forEach(function (k) { if (s[k]) q.set(k, s[k]); });
    if (withToken && TOKEN) q.set("token", TOKEN);
    return q.toString();
  }
  function writeURL(s, push) {
    var url = location.pathname + "?" + query(s, true);
    if (url === location.pathname + location.search) return;
    if (push) history.pushState(null, "", url); else history.replaceState(null, "", url);
  }
  function setAuto(f, on, value) {
    auto[f] = on;
    $(f).classList.toggle("auto", on);
    if (value !== undefined) $(f).value = value;
  }
  function fromURL() {
    var q = new URLSearchParams(location.search);
    if (q.get("model")) {
      var sel = $("model"), want = q.get("model");
      if (!Array.prototype.some.call(sel.options, function (o) { return o.value === want; })) {
        var o = LS.el("option", null, want, sel); o.value = want;  // the server will say whether it knows it
      }
      sel.value = want;
    }
    FIELDS.forEach(function (f) { $(f).value = q.get(f) || ""; });
    setAuto("target", false); setAuto("foil", false);
    applyKind();
    return !!q.get("text");
  }

  // ---------------------------------------------------------------- a run: every view of one state
  function abortRun(why) {
    if (!runCtl) return;
    runCtl.abort();
    runCtl = null;
    cards().forEach(function (el) {
      var st = el.getAttribute("data-state");
      if (st === "running" || st === "queued") setStatus(el, "cancelled", why || "cancelled");
    });
  }

  // what every run does first: the previous run stopped, the panel and messages cleared, the URL written
  function beginRun(s, push) {
    abortRun();
    closePanel();
    unsay();
    var my = ++runId, ctl = runCtl = new AbortController();
    shown = s; resolved = null;
    writeURL(s, push);
    return { my: my, ctl: ctl };
  }

  function run(push) {
    var s = read();
    if (!s.text) { say("Type a prompt first.", true); $("text").focus(); return; }
    if (pairMode(s.model)) return runPair(s, push);
    if (body.getAttribute("data-token-required") === "1" && !TOKEN) {
      say("This server needs a token: open the address `lenscope serve` printed (it ends in ?token=\u2026).");
      return;
    }
    var started = beginRun(s, push), my = started.my, ctl = started.ctl;
    if (auto.target) setAuto("target", true, "");
    if (auto.foil) setAuto("foil", true, "");
    $("save").disabled = true;
    body.setAttribute("data-run", String(my));
    body.removeAttribute("data-ready");
    var runCard = card("run");
    runCard.setAttribute("data-state", "running");
    clear(runCard.querySelector(".body"));
    var t0 = performance.now();
    var groups = GROUPS.filter(function (g) { return g[0] !== "circuit" || s.corrupted; });
    document.querySelectorAll("[data-toc=circuit]").forEach(function (a) { a.hidden = !s.corrupted; });
    cards().forEach(function (el) {
      el.classList.remove("stale");
      clear(el.querySelector(".body"));
      var key = el.getAttribute("data-section");
      var asked = groups.some(function (g) { return g.indexOf(key) >= 0; });
      el.hidden = (!asked && key === "circuit") || key === "alignment";
      if (asked) setStatus(el, "queued", "waiting for the server\u2026", true);
      else setStatus(el, "idle", "");
    });
    var left = groups.length, checks = [];
    groups.forEach(function (group) {
      var req = { model: s.model, text: s.text, sections: group };
      ["target", "foil", "corrupted"].forEach(function (k) { if (s[k]) req[k] = s[k]; });
      group.forEach(function (k) { if (card(k)) running(card(k)); });
      api("api/analyze", req, ctl.signal).then(function (ans) {
        if (my !== runId) return;
        if (!resolved) first(ans, performance.now() - t0);
        group.forEach(function (k) { drawView(k, ans); });
        (ans.checks || []).forEach(function (c) { checks.push(c); });
        drawChecks(checks);
      }).catch(function (e) {
        if (aborted(e) || my !== runId) return;
        group.forEach(function (k) { if (card(k)) setStatus(card(k), "error", e.message); });
        say(e.message);
        if (!resolved) { runCard.setAttribute("data-state", "error"); }
      }).then(function () {
        if (my !== runId || ctl.signal.aborted) return;
        if (--left === 0) {
          runCtl = null;
          body.setAttribute("data-ready", "1");
          body.setAttribute("data-total-ms", String(Math.round(performance.now() - t0)));
        }
      });
    });
  }

  function clear(el) { while (el.firstChild) el.removeChild(el.firstChild); }

  // ---------------------------------------------------------------- a translation model: the alignment view
  function pairMode(model) { return SEQ2SEQ.indexOf(model) >= 0; }
  // the fields and cards of the model chosen: a translation model's source, gold links and alignment card, or the rest
  function applyKind() {
    var pm = pairMode($("model").value);
    $("pair-row").hidden = !pm;
    ONE_TEXT.forEach(function (f) { $(f).parentNode.hidden = pm; });
    $("text").placeholder = pm ? "the target: a translation of the source below; Enter runs" :
      "a prompt (at most " + body.getAttribute("data-max-tokens") + " tokens); Enter runs, Shift+Enter starts a new line";
    cards().forEach(function (el) {
      var key = el.getAttribute("data-section");
      if (pm) el.hidden = key !== "alignment";
      else if (key === "alignment") el.hidden = true;
      else if (key !== "circuit") el.hidden = false;
    });
    document.querySelectorAll("[data-toc]").forEach(function (a) {
      var key = a.getAttribute("data-toc");
      if (pm) a.hidden = key !== "alignment";
      else if (key === "alignment") a.hidden = true;
      else if (key !== "circuit") a.hidden = false;
    });
  }
  // gold links typed as "i-j i-j p2-3" (source word i, target word j; p: a possible link) -> {sure, possible}
  function parseGold(text) {
    if (!text || !text.trim()) return null;
    var gold = { sure: [], possible: [] }, bad = null;
    text.trim().split(/[\s,]+/).forEach(function (t) {
      var m = /^(p?)(\d+)-(\d+)$/.exec(t);
      if (!m) { if (bad === null) bad = t; return; }
      (m[1] ? gold.possible : gold.sure).push([Number(m[2]), Number(m[3])]);
    });
    if (bad !== null) { say("gold links: " + JSON.stringify(bad) + " is not a link i-j (p i-j: a possible one)"); return false; }
    return gold;
  }
  function runPair(s, push) {
    if (!s.source) { say("This is a translation model: give the source (the text is its target).", true); $("source").focus(); return; }
    var gold = parseGold(s.gold);
    if (gold === false) return;
    var started = beginRun(s, push), my = started.my, ctl = started.ctl;
    $("save").disabled = true;
    body.setAttribute("data-run", String(my));
    body.removeAttribute("data-ready");
    applyKind();
    var runCard = card("run"), el = card("alignment");
    runCard.setAttribute("data-state", "running");
    clear(runCard.querySelector(".body"));
    el.classList.remove("stale");
    clear(el.querySelector(".body"));
    running(el);
    var t0 = performance.now(), req = { model: s.model, source: s.source, target: s.text };
    if (gold) req.gold = gold;
    api("api/alignment", req, ctl.signal).then(function (ans) {
      if (my !== runId) return;
      body.setAttribute("data-first-ms", String(Math.round(performance.now() - t0)));
      var ok = LS.drawSection(el.querySelector(".body"), "alignment", ans.alignment, ans.meta);
      setStatus(el, ok ? "done" : "error", ok ? "computed in " + LS.fmt(ans.seconds, 2) + " s" : "this view could not be drawn");
      var b = runCard.querySelector(".body"), m = ans.meta;
      runCard.setAttribute("data-state", "done");
      LS.el("div", "run-line meta", ans.model + " \u00b7 family " + m.family + " \u00b7 " + m.n_layers + " layers \u00b7 d_model " +
        m.d_model + " \u00b7 encoder-decoder \u00b7 " + ans.source_tokens.length + " source tokens \u00b7 " +
        ans.prefix_tokens.length + " target-prefix tokens", b);
      LS.el("div", "run-line", "explaining every target token over the source and the target prefix: " +
        ans.methods.map(NAMES).join(", "), b);
      LS.el("div", "checks-holder", null, b);
      drawChecks(ans.checks || []);
      loadModels();
    }).catch(function (e) {
      if (aborted(e) || my !== runId) return;
      setStatus(el, "error", e.message);
      say(e.message);
      runCard.setAttribute("data-state", "error");
    }).then(function () {
      if (my !== runId || ctl.signal.aborted) return;
      runCtl = null;
      body.setAttribute("data-ready", "1");
      body.setAttribute("data-total-ms", String(Math.round(performance.now() - t0)));
    });
  }

  function drawView(key, ans) {
    var el = card(key);
    if (!el) return;
    var b = el.querySelector(".body");
    clear(b);
    var secs = ans.timings && ans.timings[key];
    if (ans.sections && ans.sections[key] !== undefined) {
      var ok = LS.drawSection(b, key, ans.sections[key], ans.meta);
      setStatus(el, ok ? "done" : "error", ok ? (secs !== undefined ? "computed in " + LS.fmt(secs, 2) + " s" : "") :
        "this view could not be drawn");
    } else if (ans.notes && ans.notes[key]) {
      LS.el("p", "note", ans.notes[key], b);
      setStatus(el, "note", "");
    } else {
      setStatus(el, "error", "the server sent no data for this view");
    }
  }

  // the first answer of a run: fill in the target and foil, and the run card
  function first(ans, ms) {
    resolved = { target: ans.target, foil: ans.foil, tokens: ans.tokens, meta: ans.meta };
    body.setAttribute("data-first-ms", String(Math.round(ms)));
    if (!shown.target && ans.target) setAuto("target", true, ans.target.token);
    if (!shown.foil && ans.foil && !shown.target) setAuto("foil", true, ans.foil.token);
    $("save").disabled = false;
    loadModels();  // the model is resident now: its family, layers and heads
    var rc = card("run"), b = rc.querySelector(".body");
    rc.setAttribute("data-state", "done");
    clear(b);
    var m = ans.meta || {};
    var line = LS.el("div", "run-line meta", null, b);
    line.textContent = ans.model + (m.family ? " \u00b7 family " + m.family + " \u00b7 " + m.n_layers + " layers \u00b7 d_model " +
      m.d_model + " \u00b7 " + (m.causal ? "decoder" : "encoder") : "") + " \u00b7 " + ans.tokens.length + " tokens";
    var t = LS.el("div", "run-line", null, b);
    if (ans.target) {
      LS.el("span", null, "explaining ", t); LS.el("b", null, JSON.stringify(ans.target.token), t);
      LS.el("span", null, ans.foil ? " rather than " : (shown.target ? " (given)" : " (the model's top prediction)"), t);
      if (ans.foil) LS.el("b", null, JSON.stringify(ans.foil.token), t);
    } else {
      t.textContent = "this model has no language-model head: no target";
    }
    var strip = LS.el("div", "tokens run-tokens", null, b);
    strip.setAttribute("data-role", "run-tokens");
    ans.tokens.forEach(function (tok, i) {
      var sp = LS.el("span", "tok", LS.show(tok), strip);
      if (i === ans.tokens.length - 1) sp.classList.add("pred");
      LS.clickable(sp, "token", { position: i });
      LS.hover(sp, function (tp) { LS.line(tp, [["position " + i + "  ", 0], [JSON.stringify(tok), 1]]);
        LS.line(tp, [["click: every attribution method for the prediction here", 0]]); });
    });
    LS.el("div", "checks-holder", null, b);
  }

  function drawChecks(checks) {
    var holder = document.querySelector("#sec-run .checks-holder");
    if (!holder) return;
    clear(holder);
    var bad = checks.filter(function (c) { return c.ok === false; });
    var d = LS.el("details", null, null, holder);
    if (bad.length) d.open = true;
    var sm = LS.el("summary", null, checks.length + " exactness checks ", d);
    LS.el("span", "badge " + (bad.length ? "bad" : "ok"), bad.length ? bad.length + " FAILED" : "all passed", sm);
    var tb = LS.el("table", "checks", null, d), hr = LS.el("tr", null, null, tb);
    ["view", "check", "value", "tolerance", ""].forEach(function (h) { LS.el("th", null, h, hr); });
    checks.forEach(function (c) {
      var tr = LS.el("tr", null, null, tb);
      LS.el("td", null, c.section, tr); LS.el("td", null, c.name, tr);
      LS.el("td", "num", LS.fmt(c.value, 4), tr);
      LS.el("td", "num", c.tolerance === null || c.tolerance === undefined ? "\u2013" : "\u2264 " + c.tolerance, tr);
      var td = LS.el("td", null, null, tr);
      LS.el("span", "badge " + (c.ok === null || c.ok === undefined ? "info" : c.ok ? "ok" : "bad"),
        c.ok === null || c.ok === undefined ? "reported" : c.ok ? "ok" : "FAILED", td);
    });
  }

  // ---------------------------------------------------------------- the side panel (a head, a token)
  function openPanel(title, kind) {
    if (panelCtl) panelCtl.abort();
    panelCtl = new AbortController();
    $("panel-title").textContent = title;
    $("panel").setAttribute("data-kind", kind);
    $("panel").setAttribute("data-state", "running");
    clear($("panel-body"));
    var st = $("panel-status");
    clear(st); LS.el("span", "spin", null, st); LS.el("span", null, "computing\u2026", st);
    $("panel").hidden = false;
    body.classList.add("panel-open");
    return panelCtl;
  }
  // outline what the panel shows: the head's cell, or the token in the token strips
  function mark(selector, which, index) {
    document.querySelectorAll(".ls-sel").forEach(function (e) { e.classList.remove("ls-sel"); });
    if (!selector) return;
    document.querySelectorAll(selector).forEach(function (e) {
      var strip = e.parentNode, k = Array.prototype.indexOf.call(strip.children, e);
      if (which ? e.matches(which) : k === index) e.classList.add("ls-sel");
    });
  }
  function closePanel() {
    if (panelCtl) { panelCtl.abort(); panelCtl = null; }
    mark(null);
    $("panel").hidden = true;
    body.classList.remove("panel-open");
  }
  function panelDone(ok, text) {
    $("panel").setAttribute("data-state", ok ? "done" : "error");
    var st = $("panel-status");
    clear(st);
    if (text) LS.el("span", ok ? null : "err", text, st);
  }
  // the target and foil of the views shown: as typed, else as the model's prediction resolved them ("#id")
  function contrast(req) {
    var t = shown.target || (resolved && resolved.target ? "#" + resolved.target.id : null);
    var f = shown.foil || (!shown.target && resolved && resolved.foil ? "#" + resolved.foil.id : null);
    if (t) req.target = t;
    if (f) req.foil = f;
    return req;
  }


  function openHead(d) {
    if (!shown || !resolved) return;
    var s = shown, my = runId;
    var ctl = openPanel("Head L" + d.layer + ".H" + d.head, "head");
    mark("svg.dla-heads rect", "[data-r='" + d.layer + "'][data-c='" + d.head + "']");
    $("panel").setAttribute("data-head", d.layer + "." + d.head);
    var req = contrast({ model: s.model, text: s.text, layer: d.layer, head: d.head });
    if (s.corrupted) req.corrupted = s.corrupted;
    api("api/head", req, ctl.signal).then(function (h) {
      if (my !== runId || ctl !== panelCtl) return;
      var pb = $("panel-body");
      var p = LS.el("p", null, null, pb);
      LS.el("span", "meta", "direct logit attribution" + (resolved.target ? " to " + JSON.stringify(resolved.target.token) : "") +
        (req.foil ? " \u2212 " + JSON.stringify(resolved.foil ? resolved.foil.token : req.foil) : "") + ": ", p);
      var dla = LS.el("span", "big", LS.fmt(h.dla, 4), p);
      dla.setAttribute("data-role", "head-dla");

      LS.el("h3", null, "Attention pattern (query \u00d7 key)", pb);
      var toks = h.tokens, n = toks.length, labels = toks.map(function (t) { return LS.show(t, 10); });
      var cw = Math.max(9, Math.min(24, Math.floor(420 / n)));
      var hm = LS.heatmap(pb, { rows: n, cols: n, cw: cw, ch: cw, left: 84, bottom: 70, rowLabels: labels, colLabels: labels,
        cls: "head-pattern", tip: function (tp, r, c) {
          LS.line(tp, [["query " + r + " ", 0], [JSON.stringify(toks[r]), 1], ["  key " + c + " ", 0], [JSON.stringify(toks[c]), 1]]);
          LS.line(tp, [["attention ", 0], [LS.fmt(h.pattern[r][c], 4), 1]]);
        } });
      hm.draw(function (r, c) { return LS.colour("blues", h.pattern[r][c]); });
      LS.legendRamp(pb, "blues", "0", "1", 120);

      var cols = LS.el("div", "cols", null, pb);
      var a = LS.el("div", null, null, cols), b = LS.el("div", null, null, cols);
      LS.el("h3", null, "Its write promotes", a);
      LS.tokenBars(a, h.promoted, "head-promoted", "#2f9e44", "logit change");
      LS.el("h3", null, "and suppresses", b);
      LS.tokenBars(b, h.suppressed, "head-suppressed", "#e03131", "logit change");
      LS.el("p", "meta", "at position " + h.position + ", through the final norm's traced scale and the unembedding", pb);

      LS.el("h3", null, "Patched from the corrupted prompt", pb);
      if (h.patch) {
        var tb = LS.el("table", "kv", null, pb);
        tb.setAttribute("data-role", "head-patch");
        [["clean", h.patch.clean], ["corrupted", h.patch.corrupted], ["clean with this head patched", h.patch.patched],
         ["effect (patched \u2212 clean)", h.patch.effect]].forEach(function (r) {
          var tr = LS.el("tr", null, null, tb); LS.el("th", null, r[0], tr); LS.el("td", null, LS.fmt(r[1], 4), tr);
        });
        LS.el("p", "meta", "logit(target) \u2212 logit(foil); the head's output at every position taken from the corrupted run", pb);
      } else {
        LS.el("p", "note", "Give a corrupted prompt (same number of tokens) to see what patching this head does.", pb);
      }
      panelDone(true, "");
    }).catch(function (e) { if (!aborted(e) && ctl === panelCtl) { panelDone(false, e.message); say(e.message); } });
  }

  var NAMES = function (m) { return (LS.methodNames && LS.methodNames[m]) || m; };
  function openToken(d) {
    if (!shown || !resolved) return;
    var s = shown, my = runId, pos = d.position, last = resolved.tokens.length - 1;
    var ctl = openPanel("Position " + pos + " \u00b7 " + JSON.stringify(resolved.tokens[pos]), "token");
    mark("[data-role=strip] .tok, [data-role=run-tokens] .tok", null, pos);
    $("panel").setAttribute("data-position", String(pos));
    var req = { model: s.model, text: s.text, position: pos };
    if (pos === last) contrast(req);  // the target typed (or resolved) is the last position's; elsewhere the model's own
    api("api/token", req, ctl.signal).then(function (t) {
      if (my !== runId || ctl !== panelCtl) return;
      var pb = $("panel-body");
      var p = LS.el("p", "meta", null, pb);
      p.textContent = "explaining " + JSON.stringify(t.target.token) + (t.foil ? " rather than " + JSON.stringify(t.foil.token) : "") +
        (resolved.meta && resolved.meta.causal === false ? " at position " : " after position ") + t.position + " " +
        JSON.stringify(t.token) + "; red = towards it, blue = against (each row on its own scale)";
      var methods = Object.keys(t.methods), n = 0;
      methods.forEach(function (m) { n = Math.max(n, t.methods[m].scores.length); });
      var toks = resolved.tokens.slice(0, n);
      var hm = LS.heatmap(pb, { rows: methods.length, cols: n, cw: Math.max(12, Math.min(30, Math.floor(420 / Math.max(1, n)))), ch: 18,
        left: 130, bottom: 70, rowLabels: methods.map(NAMES), colLabels: toks.map(function (x) { return LS.show(x, 10); }),
        cls: "token-methods", tip: function (tp, r, c) {
          LS.line(tp, [[NAMES(methods[r]) + " \u00b7 " + JSON.stringify(toks[c]) + ": ", 0], [LS.fmt(t.methods[methods[r]].scores[c], 4), 1]]);
        } });
      var scales = methods.map(function (m) { return LS.maxAbs(t.methods[m].scores); });
      hm.draw(function (r, c) { var v = t.methods[methods[r]].scores[c]; return v === undefined ? "#f3f4f6" : LS.div(v, scales[r]); });
      var tb = LS.el("table", "kv", null, pb);
      methods.forEach(function (m) {
        var e = t.methods[m].invariant_error, tr = LS.el("tr", null, null, tb);
        LS.el("th", null, NAMES(m), tr);
        LS.el("td", null, e === null || e === undefined ? "\u2013" : "invariant error " + LS.fmt(e), tr);
      });
      panelDone(true, "");
    }).catch(function (e) { if (!aborted(e) && ctl === panelCtl) { panelDone(false, e.message); say(e.message); } });
  }

  // a feature's card (the features view emits "feature" for a feature whose card is not in its data)
  function openFeature(d) {
    if (!shown || !resolved) return;
    var s = shown, my = runId;
    var ctl = openPanel("Feature " + d.site + " #" + d.feature, "feature");
    $("panel").setAttribute("data-feature", d.site + "#" + d.feature);
    api("api/feature", { model: s.model, site: d.site, feature: d.feature }, ctl.signal).then(function (c) {
      if (my !== runId || ctl !== panelCtl) return;
      LS.featureCard($("panel-body"), c);
      panelDone(true, "");
    }).catch(function (e) { if (!aborted(e) && ctl === panelCtl) { panelDone(false, e.message); say(e.message); } });
  }

  // a supernode grouped in the graph view: kept with the server's graph of this input (api/supernode), which answers
  // with every supernode grouped on it
  function groupNodes(d) {
    if (!shown) return;
    var req = { model: shown.model, text: shown.text, label: d.label, ids: d.ids };
    if (shown.target) req.target = shown.target;  // the graph's target as the view asked for it (typed, or none)
    api("api/supernode", req).then(function (a) { d.done(a.supernodes); }).catch(function (e) { say(e.message); });
  }

  // ---------------------------------------------------------------- save as report
  function save() {
    if (!shown) return;
    var btn = $("save");
    btn.disabled = true;
    var h = {};
    if (TOKEN) h.Authorization = "Bearer " + TOKEN;
    fetch("api/report?" + query(shown, false), { headers: h }).then(function (r) {
      if (!r.ok) return r.json().then(function (j) { throw new Error(j.error || "the report failed (" + r.status + ")"); },
                                      function () { throw new Error("the report failed (" + r.status + ")"); });
      return r.blob();
    }).then(function (blob) {
      var a = LS.el("a", null, null, document.body);
      a.href = URL.createObjectURL(blob);
      a.download = "lenscope-report.html";
      a.click();
      setTimeout(function () { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
    }).catch(function (e) { say(e.message); }).then(function () { btn.disabled = false; });
  }

  // ---------------------------------------------------------------- models
  function loadModels() {
    api("api/models").then(function (m) {
      var sel = $("model"), cur = sel.value;
      var known = {};
      m.models.forEach(function (x) { known[x.name] = x; });
      Array.prototype.forEach.call(sel.options, function (o) {
        var x = known[o.value];
        o.textContent = o.value + (x && x.loaded ? "" : x ? " (loads on first use)" : " (unknown)");
      });
      var x = known[cur];
      $("model-info").textContent = x && x.loaded ? x.family + " \u00b7 " + x.n_layers + " layers \u00b7 " + x.n_heads + " heads" : "";
    }).catch(function (e) { say(e.message); });
  }

  // ---------------------------------------------------------------- wiring
  $("ask").addEventListener("submit", function (e) { e.preventDefault(); run(true); });
  $("text").addEventListener("keydown", function (e) {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); run(true); }
  });
  FIELDS.forEach(function (f) {
    $(f).addEventListener("input", function () {
      if (f === "target" || f === "foil") setAuto(f, false);
      if (f === "target" && auto.foil) setAuto("foil", false, "");  // the runner-up of another target
      if (runCtl && !same(read(), shown)) abortRun("cancelled: the input changed (press Enter to run it)");
      if (shown && !same(read(), shown)) cards().forEach(function (el) { el.classList.add("stale"); });
      else cards().forEach(function (el) { el.classList.remove("stale"); });
    });
  });
  $("model").addEventListener("change", function () {
    applyKind();
    loadModels();
    if ($("text").value) { if (auto.target) setAuto("target", false, ""); if (auto.foil) setAuto("foil", false, ""); run(true); }
  });
  $("save").addEventListener("click", save);
  $("panel-close").addEventListener("click", closePanel);
  document.addEventListener("keydown", function (e) { if (e.key === "Escape") closePanel(); });
  window.addEventListener("popstate", function () { if (fromURL()) run(false); });
  LS.on("head", openHead);
  LS.on("token", openToken);
  LS.on("feature", openFeature);
  LS.on("supernode", groupNodes);
  LS.on("target", function (d) { setAuto("target", false, d.token); if (auto.foil) setAuto("foil", false, ""); run(true); });

  if (body.getAttribute("data-token-required") === "1" && !TOKEN)
    say("This server needs a token: open the address `lenscope serve` printed (it ends in ?token=\u2026).");
  loadModels();
  if (fromURL()) run(false);
  else $("text").focus();
  body.setAttribute("data-app", "1");
})();
