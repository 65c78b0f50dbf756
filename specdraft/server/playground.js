"use strict";
const $ = (id) => document.getElementById(id);
const state = { key: "", methods: [], info: null, busy: false, fixed: false };

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

function showError(msg) {
  const e = $("error");
  e.textContent = msg || "";
  e.style.display = msg ? "block" : "none";
}

async function errorText(resp) {
  try {
    const j = await resp.json();
    const e = j.error || {};
    return `HTTP ${resp.status}: ${e.message || JSON.stringify(j)}` + (e.param ? ` (param: ${e.param})` : "");
  } catch (_) {
    return `HTTP ${resp.status} ${resp.statusText}`;
  }
}

async function loadMethods() {
  const resp = await fetch("/v1/specdraft/methods", { headers: headers() });
  if (resp.status === 401) {
    $("keyrow").style.display = "flex";
    showError("This server needs an API key: enter it above.");
    return;
  }
  if (!resp.ok) { showError(await errorText(resp)); return; }
  showError("");
  const info = state.info = await resp.json();
  state.methods = info.data.filter((m) => m.available);
  $("info").textContent = `${info.model} · ${info.backend}` + (info.draft ? ` · draft ${info.draft}` : "") +
    ` · server default ${info.default_spec.method}`;
  const sel = $("method");
  sel.replaceChildren();
  for (const m of state.methods) {
    const o = new Option(m.id, m.id);
    o.title = m.summary;
    sel.add(o);
  }
  $("k").value = info.default_spec.k;
  // a fixed-mode server hides what speculation accepted: it refuses include_steps, so the page streams plain text
  state.fixed = info.stream_mode !== "normal";
  $("note").textContent = state.fixed ? `This server streams in fixed mode (${info.stream_mode}): it hides what ` +
    "speculation accepted, so tokens are not coloured and MAT, acceptance and steps are not shown." : "";
  $("note").style.display = state.fixed ? "block" : "none";
  $("legend").style.display = state.fixed ? "none" : "";
  fillKnobs();
}

async function loadLearning() {
  // a server that learns online (serve --learn) shows its acceptance curve; every server string is a text node
  const resp = await fetch("/v1/specdraft/learning", { headers: headers() });
  const info = resp.ok ? await resp.json() : { learning: false };
  $("learning").style.display = info.learning ? "block" : "none";
  if (!info.learning) return;
  const acc = info.acceptance === null ? "n/a" : Number(info.acceptance).toFixed(3);
  $("learnstate").textContent = `${info.state} · ${info.updates} updates (${info.kept} kept, ${info.rollbacks} ` +
    `rolled back) · acceptance ${acc} over the last ${info.window} drafted tokens`;
  drawCurve(info.curve.map((p) => Number(p.acceptance)));
}

function drawCurve(ys) {
  // the page's own polyline (playground.html) gets the points: numbers only, no markup
  const w = 320, h = 64;
  const pts = ys.length < 2 ? [] :
    ys.map((y, i) => `${(i / (ys.length - 1) * w).toFixed(1)},${(h - 2 - y * (h - 4)).toFixed(1)}`);
  $("learnline").setAttribute("points", pts.join(" "));
  $("learnwait").style.display = ys.length < 2 ? "" : "none";
}

function fillSelect(sel, values, preferred) {
  sel.replaceChildren();
  for (const v of values) sel.add(new Option(v, v));
  sel.value = values.includes(preferred) ? preferred : values[0];
}

function fillKnobs() {
  const m = state.methods.find((x) => x.id === $("method").value);
  if (!m) return;
  const d = state.info.default_spec;
  fillSelect($("schedule"), m.schedules, d.schedule);
  fillSelect($("tree"), m.trees, d.tree);
  $("method").title = m.summary;
}

function num(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function requestBody(spec) {
  const chat = $("mode").value === "chat";
  const text = $("prompt").value;
  const body = chat ? { messages: [{ role: "user", content: text }] } : { prompt: text };
  body.max_tokens = num("max_tokens");
  body.temperature = num("temperature");
  body.top_p = num("top_p");
  const seed = num("seed");
  if (seed !== null) body.seed = seed;
  if ($("logprobs").checked) body.logprobs = chat ? true : 0;
  body.spec = spec;
  body.stream = true;
  body.stream_options = state.fixed ? { include_usage: true } : { include_usage: true, include_steps: true };
  return { chat, body };
}

function chosenSpec() {
  const spec = { method: $("method").value, schedule: $("schedule").value, tree: $("tree").value };
  const k = num("k");
  if (k !== null) spec.k = k;
  return spec;
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  Object.assign(e, attrs || {});
  e.append(...children);  // strings become text nodes: nothing the server sends is parsed as HTML
  return e;
}

function makeColumn(title, id) {
  const stat = (label, cls, v) => el("span", {}, label + " ", el("b", { className: cls }, v));
  const col = el("section", { className: "col", id },
    el("h2", {}, title),
    el("div", { className: "stats" }, stat("tok/s", "tps", "–"), stat("MAT", "mat", "–"),
       stat("acceptance", "acc", "–"), stat("steps", "steps", "0"), stat("tokens", "ntok", "0"),
       stat("prompt cached", "cached", "–")),
    el("div", { className: "hist", title: "tokens per step" }), el("div", { className: "text" }));
  $("cols").appendChild(col);
  return { el: col, title, text: col.querySelector(".text"), tokens: {}, steps: 0, drafted: 0, accepted: 0,
           emitted: 0, hist: {}, t0: null, n0: 0, tLast: null, all: "", usage: null, rate: null };
}

function tooltip(t) {
  let s = `step ${t.step}, ` + (t.accepted ? `draft position ${t.position + 1}, accepted draft`
                                          : `the target's own token (after ${t.position} accepted)`);
  if (t.arm) s += `, drafted by ${t.arm}`;
  if (t.logprob !== undefined) s += `, logprob ${t.logprob.toFixed(3)}`;
  return s;
}

function addPieces(col, pieces) {
  for (const [text, i] of pieces) {
    const t = col.tokens[i] || { step: 0, position: 0, accepted: false };
    const span = document.createElement("span");
    span.className = "t " + (t.accepted ? "acc" : "own") + (t.position === 0 && !t.shown ? " sb" : "");
    span.dataset.i = i;
    span.dataset.step = t.step;
    span.title = tooltip(t);
    span.textContent = text;
    t.shown = true;
    col.text.appendChild(span);
  }
}

function onStep(col, sd) {
  for (const t of sd.tokens) col.tokens[t.index] = t;
  const s = sd.step;
  if (s) {
    col.steps += 1;
    col.drafted += s.drafted;
    col.accepted += s.accepted;
    col.emitted += s.emitted;
    col.hist[s.emitted] = (col.hist[s.emitted] || 0) + 1;
    const now = performance.now();
    if (col.t0 === null) { col.t0 = now; col.n0 = col.emitted; }
    col.tLast = now;
  }
  addPieces(col, sd.pieces);
}

function onText(col, text) {
  // plain streaming (fixed mode): the text as it comes, timed by its chunks; usage gives the token count
  const now = performance.now();
  if (col.t0 === null) col.t0 = now;
  col.tLast = now;
  col.text.append(text);
}

function rate(col) {
  if (col.t0 === null || col.tLast <= col.t0) return null;
  return (col.emitted - col.n0) / ((col.tLast - col.t0) / 1000);
}

function render(col) {
  const q = (c) => col.el.querySelector(c);
  col.rate = rate(col);
  q(".tps").textContent = col.rate === null ? "–" : col.rate.toFixed(1);
  q(".mat").textContent = col.steps ? ((col.accepted + col.steps) / col.steps).toFixed(2) : "–";
  q(".acc").textContent = col.drafted ? (100 * col.accepted / col.drafted).toFixed(0) + "%" : "–";
  q(".steps").textContent = state.fixed ? "–" : col.steps;
  q(".ntok").textContent = col.emitted;
  const u = col.usage;  // prompt tokens the prefix cache held (not computed again) out of the prompt's
  q(".cached").textContent = u && u.prompt_tokens_details
    ? `${u.prompt_tokens_details.cached_tokens}/${u.prompt_tokens}` : "–";
  const h = q(".hist");
  const max = Math.max(1, ...Object.values(col.hist));
  const top = Math.max(1, ...Object.keys(col.hist).map(Number));
  h.replaceChildren();
  for (let n = 1; n <= top; n++) {
    const bar = document.createElement("div");
    bar.style.height = (100 * (col.hist[n] || 0) / max) + "%";
    bar.title = `${col.hist[n] || 0} steps emitted ${n} token(s)`;
    bar.append(el("span", {}, String(n)));
    h.appendChild(bar);
  }
}

function onEvent(col, chat, obj) {
  if (obj.error) throw new Error(obj.error.message + (obj.error.param ? ` (param: ${obj.error.param})` : ""));
  if (obj.usage) col.usage = obj.usage;
  const ch = (obj.choices || [])[0];
  const text = ch ? (chat ? ch.delta && ch.delta.content : ch.text) || "" : "";
  col.all += text;
  if (obj.specdraft) onStep(col, obj.specdraft);
  else if (text) onText(col, text);
  if (obj.usage && state.fixed) col.emitted = obj.usage.completion_tokens;
  render(col);
}

async function run(col, spec) {
  const { chat, body } = requestBody(spec);
  const url = chat ? "/v1/chat/completions" : "/v1/completions";
  const resp = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!resp.ok) throw new Error(await errorText(resp));
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      // an event's data lines; a fixed-mode stream pads each event with a comment line (":...")
      const data = buf.slice(0, cut).split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim())
        .join("\n");
      buf = buf.slice(cut + 2);
      if (!data || data === "[DONE]") continue;
      onEvent(col, chat, JSON.parse(data));
    }
  }
  col.el.dataset.done = "1";
  return col;
}

function summarize(main, plain) {
  const s = $("summary");
  if (!plain) { s.textContent = ""; return; }
  const greedy = (num("temperature") || 0) === 0;
  const same = main.all === plain.all;
  const speed = main.rate && plain.rate && !state.fixed ? (main.rate / plain.rate).toFixed(2) + "×" : "n/a";
  const why = state.fixed ? "fixed stream mode paces both" : `decode tok/s after the first step, ${main.title} over plain`;
  const mark = el("span", { id: "identical", className: same ? "same" : "diff" },
    same ? "✓ identical texts" : (greedy ? "✗ texts differ" : "texts differ (sampling: not expected to match)"));
  mark.dataset.identical = same ? "true" : "false";
  s.replaceChildren("speedup ", el("b", { id: "speedup" }, speed), ` (${why}) · `, mark);
}

async function generate() {
  if (state.busy || !state.methods.length) return;
  state.busy = true;
  $("generate").disabled = true;
  showError("");
  $("summary").textContent = "";
  const cols = $("cols");
  cols.replaceChildren();
  delete cols.dataset.done;
  const race = $("race").checked;
  cols.className = race ? "race" : "";
  const spec = chosenSpec();
  const main = makeColumn(spec.method, "col-main");
  const plain = race ? makeColumn("plain", "col-plain") : null;
  try {
    const jobs = [run(main, spec)];
    if (plain) jobs.push(run(plain, { method: "plain" }));
    await Promise.all(jobs);
    summarize(main, plain);
    loadLearning().catch(() => {});
  } catch (e) {
    showError(e.message);
  } finally {
    cols.dataset.done = "1";
    state.busy = false;
    $("generate").disabled = false;
  }
}

$("method").addEventListener("change", fillKnobs);
$("generate").addEventListener("click", generate);
$("apikey").addEventListener("change", () => { state.key = $("apikey").value; loadMethods().then(loadLearning); });
document.addEventListener("keydown", (e) => {
  if ((e.ctrlKey || e.metaKey) && e.key === "Enter") { e.preventDefault(); generate(); }
});
loadMethods().then(loadLearning).catch((e) => showError(e.message));
