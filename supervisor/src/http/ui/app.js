// dsv4's dashboard: follows GET /events (server-sent events, read with fetch so that an API
// key can go with it) and draws what it says. Everything from the daemon is written as
// text (textContent), never as markup.
"use strict";

const HOUR = 3600;
const KEY = "dsv4.key";
// The admin key lives in this page's memory only: pages of the engine's own web UI share
// dsv4d's origin, and its storage with it.
let adminKey = null;
const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

let samples = [];
let thresholds = { warn_c: null, critical_c: null };
let logLines = [];

function gib(bytes) {
  return bytes == null ? null : bytes / 2 ** 30;
}

function fixed(x, digits) {
  return x == null ? "-" : Number(x).toFixed(digits);
}

function size(bytes) {
  if (bytes == null) return "-";
  const units = [["TiB", 40], ["GiB", 30], ["MiB", 20], ["KiB", 10]];
  for (const [name, shift] of units) {
    if (bytes >= 2 ** shift) return (bytes / 2 ** shift).toFixed(1) + " " + name;
  }
  return bytes + " B";
}

function ago(at) {
  if (at == null) return "-";
  return brief(Date.now() / 1000 - at) + " ago";
}

// A restore's check by the first request that shared its tokens (empty until one has).
function checked(c) {
  if (!c) return "";
  return (c.missed ? "; MISSED: " : "; ") + "reused " + c.reused + " of " + c.shared + " shared tokens";
}

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.appendChild(td);
}

// One chart: series of [t, value] in `lines`, dashed limits, shaded spans. Time runs over
// the last hour, or from the first sample when there is less (5 s at least).
function chart(svg, lines, limits, spans) {
  const now = Date.now() / 1000;
  const first = samples.length ? samples[0].at : now;
  const t0 = Math.max(now - HOUR, Math.min(first, now - 5));
  const width = now - t0;
  const values = lines.flatMap((l) => l.points.map((p) => p[1])).concat(limits);
  let lo = Math.min(...values);
  let hi = Math.max(...values);
  if (!isFinite(lo) || !isFinite(hi)) {
    lo = 0;
    hi = 1;
  }
  if (hi - lo < 1e-9) hi = lo + 1;
  const pad = (hi - lo) * 0.08;
  lo -= pad;
  hi += pad;
  const x = (t) => ((t - t0) / width) * 600;
  const y = (v) => 140 - ((v - lo) / (hi - lo)) * 140;
  svg.replaceChildren();
  for (const [from, to] of spans) {
    const r = document.createElementNS(SVG, "rect");
    r.setAttribute("class", "throttle");
    r.setAttribute("x", x(Math.max(from, t0)));
    r.setAttribute("width", Math.max(1, x(to) - x(Math.max(from, t0))));
    r.setAttribute("y", 0);
    r.setAttribute("height", 140);
    svg.appendChild(r);
  }
  for (const v of limits) {
    const l = document.createElementNS(SVG, "line");
    l.setAttribute("class", "limit");
    l.setAttribute("x1", 0);
    l.setAttribute("x2", 600);
    l.setAttribute("y1", y(v));
    l.setAttribute("y2", y(v));
    svg.appendChild(l);
  }
  let count = 0;
  for (const line of lines) {
    const pts = line.points.filter((p) => p[0] >= t0);
    count += pts.length;
    if (pts.length === 0) continue;
    const path = document.createElementNS(SVG, "polyline");
    path.setAttribute("class", "line " + line.cls);
    path.setAttribute("points", pts.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" "));
    svg.appendChild(path);
  }
  const label = document.createElementNS(SVG, "text");
  label.setAttribute("class", "label");
  label.setAttribute("x", 2);
  label.setAttribute("y", 10);
  label.textContent = fixed(hi - pad, 1);
  svg.appendChild(label);
  svg.dataset.points = count;
}

function series(get) {
  const out = [];
  for (const s of samples) {
    const v = get(s);
    if (v != null && isFinite(v)) out.push([s.at, v]);
  }
  return out;
}

// Spans of time the hardware throttled, from the samples.
function throttleSpans() {
  const spans = [];
  let from = null;
  for (const s of samples) {
    const on = s.throttle && s.throttle.active;
    if (on && from == null) from = s.at;
    if (!on && from != null) {
      spans.push([from, s.at]);
      from = null;
    }
  }
  if (from != null) spans.push([from, Date.now() / 1000]);
  return spans;
}

function drawCharts() {
  chart($("chart-gtt"), [
    { cls: "a", points: series((s) => s.gpu && gib(s.gpu.gtt_used)) },
    { cls: "b", points: series((s) => s.gpu && gib(s.gpu.gtt_total)) },
  ], [], []);
  chart($("chart-memory"), [
    { cls: "a", points: series((s) => s.memory && gib(s.memory.available)) },
  ], [], []);
  const limits = [thresholds.warn_c, thresholds.critical_c].filter((v) => v != null);
  chart($("chart-temperature"), [
    { cls: "a", points: series((s) => s.temperatures && s.temperatures.edge) },
    { cls: "b", points: series((s) => s.temperatures && s.temperatures.tctl) },
  ], limits, throttleSpans());
  chart($("chart-power"), [
    { cls: "a", points: series((s) => s.power && s.power.soc) },
  ], [], []);
  const last = samples[samples.length - 1];
  if (last) {
    const t = last.temperatures || {};
    $("now").textContent =
      "now: GTT " + size(last.gpu && last.gpu.gtt_used) + " of " + size(last.gpu && last.gpu.gtt_total) +
      ", available " + size(last.memory && last.memory.available) +
      ", edge " + fixed(t.edge, 1) + " C, Tctl " + fixed(t.tctl, 1) + " C" +
      ", SoC " + fixed(last.power && last.power.soc, 1) + " W";
  }
}

function addSample(s) {
  if (!s || (samples.length && samples[samples.length - 1].at >= s.at)) return;
  samples.push(s);
  const t0 = Date.now() / 1000 - HOUR;
  while (samples.length && samples[0].at < t0) samples.shift();
}

// A count with its thousands grouped: 262,144.
function thousands(n) {
  return Number(n).toLocaleString("en-US");
}

// A measured time, as dsv4 prints every time (its Rust `duration::brief`): cut to a
// precision that fits its size: 250ms, 1.2s, 42s, 12m5s, 1h58m, 2d4h.
function brief(seconds) {
  const t = Number.isFinite(seconds) ? Math.max(0, seconds) : 0;
  const s = Math.floor(t);
  if (s === 0) return t >= 0.001 ? Math.floor(t * 1000) + "ms" : "0s";
  if (s < 10) {
    const tenth = Math.floor(t * 10) % 10;
    return tenth > 0 ? s + "." + tenth + "s" : s + "s";
  }
  const parts = [[86400, "d"], [3600, "h"], [60, "m"], [1, "s"]];
  const unit = s < 3600 ? 1 : s < 86400 ? 60 : 3600;
  let left = s - (s % unit), out = "";
  for (const [len, name] of parts) {
    if (left >= len) {
      out += Math.floor(left / len) + name;
      left %= len;
    }
  }
  return out;
}

// A time left: to the second below a minute, to the minute above.
function about(seconds) {
  const s = Math.max(0, Math.round(seconds));
  return brief(s < 60 ? s : Math.round(s / 60) * 60);
}

// A rate with four significant digits: 13.35, 122.7, 1234.
function rate(v) {
  const a = Math.abs(v);
  return Number(v).toFixed(a >= 1000 ? 0 : a >= 100 ? 1 : a >= 10 ? 2 : 3);
}

const WAITS = { start: "a start", drain: "a drain", validation: "a validation", turn: "its turn" };

// Where a request in flight is, as dsv4ctl status says it.
function phaseText(r) {
  if (r.phase === "waiting") return r.waiting_for ? "waiting for " + (WAITS[r.waiting_for] || r.waiting_for) : "waiting";
  if (r.phase === "loading") {
    let s = "loading" + (r.profile ? " " + r.profile : "");
    if (r.loading_s != null) {
      s += ": " + brief(r.loading_s);
      if (r.loading_about_s != null) s += " of about " + brief(r.loading_about_s);
    }
    return s;
  }
  if (r.phase === "prefill") {
    const p = r.prefill;
    if (!p) return "prefill";
    let s = "prefill " + thousands(p.done) + " / " + thousands(p.total) + " tokens";
    if (p.total > 0) s += " (" + (p.done * 100 / p.total).toFixed(1) + "%)";
    if (p.cached > 0) s += ", " + thousands(p.cached) + " cached";
    if (p.rate != null) s += ", " + rate(p.rate) + " tok/s";
    if (p.left_s != null) s += ", about " + about(p.left_s) + " left";
    return s;
  }
  if (r.tokens > 0) return r.phase + ", " + thousands(r.tokens) + (r.tokens === 1 ? " token" : " tokens");
  return r.phase;
}

// The requests in flight, each with its phase and, in a prefill the engine tells, a bar.
function showInProgress(list) {
  const ul = $("in-progress");
  ul.replaceChildren();
  if (!list.length) {
    const li = document.createElement("li");
    li.className = "none";
    li.textContent = "none";
    ul.appendChild(li);
    return;
  }
  for (const r of list) {
    const li = document.createElement("li");
    li.dataset.id = r.id;
    li.dataset.phase = r.phase;
    li.appendChild(document.createTextNode("#" + r.id + " " + r.path));
    const phase = document.createElement("span");
    phase.className = "phase";
    phase.textContent = r.phase;
    li.appendChild(phase);
    if (r.phase === "prefill" && r.prefill) {
      li.dataset.done = r.prefill.done;
      li.dataset.total = r.prefill.total;
      const bar = document.createElement("progress");
      bar.max = Math.max(1, r.prefill.total);
      bar.value = r.prefill.done;
      li.appendChild(bar);
    }
    const text = document.createElement("span");
    text.className = "what";
    text.textContent = phaseText(r) + " (" + brief(r.age_s) + ")";
    li.appendChild(text);
    ul.appendChild(li);
  }
}

function showStatus(doc) {
  const state = $("state");
  state.textContent = doc.state + (doc.kv_step ? " (" + doc.kv_step + ")" : "");
  state.dataset.state = doc.state;
  $("profile").textContent = doc.engine_profile && doc.engine_profile !== doc.profile
    ? doc.profile + " (running: " + doc.engine_profile + ")"
    : doc.profile;
  $("in-flight").textContent = doc.in_flight;
  $("waiting").textContent = doc.waiting;
  showInProgress(doc.in_progress || []);
  const err = $("error");
  err.hidden = !doc.last_error;
  err.textContent = doc.last_error ? "last error: " + doc.last_error : "";

  const all = doc.requests;
  // A rate dsv4d's clock timed (or some of those it is over) is marked `~` (see #clock-note).
  let marked = false;
  const rated = (v, clock) => {
    const mark = clock && v != null;
    marked = marked || mark;
    return (mark ? "~" : "") + fixed(v, 1);
  };
  const clockAll = all.clock_timed_requests > 0;
  $("totals").textContent = all.requests === 0 ? "none yet" :
    all.requests + " requests: " + all.prompt_tokens + " prompt tokens (" + all.cached_tokens +
    " cached), " + all.generated_tokens + " generated; prefill " + rated(all.prefill_tok_s, clockAll) +
    " tok/s, decode " + rated(all.decode_tok_s, clockAll) + " tok/s (token-weighted)";
  // Totals by API (those that had requests).
  const apis = Object.entries(all.by_protocol || {});
  const apiBody = $("apis").tBodies[0];
  apiBody.replaceChildren();
  for (const [name, t] of apis) {
    const row = apiBody.insertRow();
    const clock = t.clock_timed_requests > 0;
    row.dataset.protocol = name;
    for (const v of [name, t.requests, t.prompt_tokens, t.cached_tokens, t.generated_tokens]) cell(row, v);
    cell(row, rated(t.prefill_tok_s, clock));
    cell(row, rated(t.decode_tok_s, clock));
  }
  $("apis").hidden = apis.length === 0;
  const body = $("requests").tBodies[0];
  body.replaceChildren();
  for (const r of [...doc.requests.recent].reverse()) {
    const row = body.insertRow();
    const protocol = r.protocol || "openai";
    row.dataset.protocol = protocol;
    cell(row, ago(r.at));
    cell(row, r.profile);
    cell(row, protocol);
    cell(row, r.path);
    cell(row, r.prompt_tokens);
    cell(row, r.cached_tokens);
    cell(row, r.generated_tokens);
    cell(row, rated(r.prefill_tok_s, r.clock_times));
    cell(row, rated(r.decode_tok_s, r.clock_times));
  }
  $("clock-note").hidden = !marked;

  const kv = $("kv").tBodies[0];
  kv.replaceChildren();
  for (const p of (doc.kv && doc.kv.profiles) || []) {
    const row = kv.insertRow();
    const c = p.checkpoint;
    cell(row, p.profile);
    cell(row, c ? c.tokens : "-");
    cell(row, c ? size(c.bytes) : "-");
    cell(row, c ? ago(c.saved_at) : "-");
    cell(row, p.last_save ? p.last_save.result + ", " + ago(p.last_save.at) : "-");
    cell(row, p.last_restore ? p.last_restore.result + ", " + ago(p.last_restore.at) + checked(p.last_restore.check) : "-");
  }

  const th = doc.thermal;
  $("thermal").textContent = th
    ? "thermal: " + th.level + th.sensors.filter((s) => s.level !== "normal")
      .map((s) => "; " + s.sensor + " " + s.level + (s.peak != null ? " (peak " + fixed(s.peak, 1) + " C)" : ""))
      .join("") + (th.action ? "; " + th.action : "")
    : "-";
  const pw = doc.power;
  $("power").textContent = pw && pw.method
    ? "power: " + pw.method + " (" + pw.why + "): " + (pw.cpu || "nothing applied now") +
      "; GPU level " + (pw.gpu_level || "-")
    : "power: decided at the first engine start";

  const mc = doc.model_cache;
  $("model-cache").hidden = !mc;
  $("model-cache").textContent = mc
    ? "model in page cache: " + fixed(mc.total_bytes ? 100 * mc.resident_bytes / mc.total_bytes : 100, 0) +
      "% of " + size(mc.total_bytes) + " at the start (a " + mc["class"] + " load" +
      (doc.load_seconds != null ? ", " + brief(doc.load_seconds) : "") + ")"
    : "";
  showCanary(doc.canary || []);
  showBoxes(doc.workers || [], doc.holds || []);
  addSample(doc.telemetry);
  drawCharts();
}

// Each profile's last correctness canary: passed, waiting for a quiet engine after a change,
// or drifted (where, and whether its requests are refused until accepted).
function showCanary(checks) {
  const p = $("canary");
  p.hidden = checks.length === 0;
  p.className = checks.some((c) => c.state === "drifted") ? "error" : "";
  p.textContent = checks.map((c) => {
    const r = c.result;
    const on = r && r.run && r.run.engine ? " on " + r.run.engine : "";
    const d = r && r.drift;
    let line = "canary " + c.profile + ": " + c.state + on;
    if (c.state === "drifted" && d) {
      line += ": answers changed at prompt " + d.prompt + ", token " + d.position +
        " (expected " + d.expected + ", got " + d.got + ")" +
        (c.held ? "; requests refused until dsv4ctl canary accept " + c.profile : "");
    } else if ((c.state === "waiting" || c.state === "running") && c.changed && c.changed.length) {
      line += " (the engine changed: " + c.changed.join("; ") + ")";
    } else if (c.state === "failed" && c.error) {
      line += ": " + c.error;
    }
    return line;
  }).join("\n");
}

// The boxes this engine spans: each worker box with what it said of itself, and the
// coordinators that hold this box.
function showBoxes(workers, holds) {
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of workers) {
    const row = body.insertRow();
    row.dataset.box = w.box;
    const t = w.telemetry;
    const gpu = t && t.gpu;
    const temps = t ? Object.entries(t.temperatures || {}).filter(([, c]) => c != null)
      .map(([s, c]) => s + " " + fixed(c, 1) + " C").join(", ") : "";
    cell(row, w.box);
    cell(row, w.profile);
    cell(row, w.state + (w.error ? ": " + w.error : ""));
    cell(row, ago(w.since));
    cell(row, w.load_seconds != null ? brief(w.load_seconds) : "-");
    cell(row, gpu && gpu.gtt_used != null ? size(gpu.gtt_used) : "-");
    cell(row, temps || "-");
    cell(row, t && t.power && t.power.soc != null ? fixed(t.power.soc, 1) + " W" : "-");
    cell(row, w.thermal ? w.thermal.level : "-");
  }
  $("workers").hidden = workers.length === 0;
  $("holds").hidden = holds.length === 0;
  $("holds").textContent = "held by " +
    holds.map((h) => h.from + " (" + h.profile + ") " + ago(h.since)).join(", ");
  $("boxes").hidden = workers.length === 0 && holds.length === 0;
}

function showLog(lines) {
  logLines = logLines.concat(lines).slice(-200);
  const pre = $("log");
  pre.textContent = logLines.join("\n");
  pre.scrollTop = pre.scrollHeight;
}

// One line in the alerts list, newest on top (at most 50 kept).
function addEvent(kind, message, at) {
  const list = $("alerts");
  const none = list.querySelector(".none");
  if (none) none.remove();
  const li = document.createElement("li");
  const k = document.createElement("span");
  k.className = "kind";
  k.textContent = kind;
  li.appendChild(k);
  li.appendChild(document.createTextNode(message + " (" + ago(at) + ")"));
  list.prepend(li);
  while (list.children.length > 50) list.lastChild.remove();
}

function thermalEvent(t) {
  const temp = t.celsius != null && isFinite(t.celsius) ? " " + fixed(t.celsius, 1) + " C" : "";
  addEvent("thermal " + t.level, t.sensor + temp + ": " + t.message, Date.now() / 1000);
}

// The newest run that was a matrix: a row per cell, its verdict and the change it suggests.
function showMatrix(runs) {
  const run = runs.find((r) => r.matrix);
  const table = $("matrix");
  $("matrix-none").hidden = !!run;
  table.hidden = !run;
  $("matrix-snippet").hidden = !run || !run.matrix.snippet;
  $("matrix-verdict").textContent = "";
  if (!run) return;
  const m = run.matrix;
  const body = table.tBodies[0];
  body.replaceChildren();
  const rate = (t) => (t ? fixed(t.mean, 2) + " ± " + fixed(t.sd, 2) : "-");
  for (const c of m.cells) {
    const row = body.insertRow();
    if (m.verdict && m.verdict.pick === c.index) row.className = "picked";
    cell(row, String(c.index));
    cell(row, c.settings);
    cell(row, rate(c.decode));
    cell(row, rate(c.prefill));
    cell(row, c.soc_w != null ? fixed(c.soc_w, 1) : "-");
    cell(row, c.joules_per_token != null ? fixed(c.joules_per_token, 3) : "-");
    cell(row, c.error || "");
  }
  $("matrix-verdict").textContent = run.profile + ", " + ago(run.started) + ", " + m.cells.length +
    " of " + m.planned + " cells. " +
    (m.verdict ? "Verdict: cell " + m.verdict.pick + ": " + m.verdict.reason +
      (m.verdict.prefill ? ". Long prefills: " + m.verdict.prefill.reason : "") : "No verdict.");
  $("matrix-snippet").textContent = m.snippet || "";
}

function showValidations(runs) {
  showMatrix(runs);
  const body = $("validations").tBodies[0];
  body.replaceChildren();
  for (const r of runs) {
    const row = body.insertRow();
    cell(row, ago(r.started));
    cell(row, r.profile);
    cell(row, r.tests.map((t) => t.name + " " + fixed(t.mean, 1) + " " + t.unit).join("; ") || "-");
    cell(row, r.error || "");
  }
  // The trend: oldest left, one step per run.
  const ordered = [...runs].reverse();
  const trend = (name) => ordered
    .map((r, i) => [i, (r.tests.find((t) => t.name === name) || {}).mean])
    .filter((p) => p[1] != null);
  trendChart($("chart-validation"), [
    { cls: "a", points: trend("decode") },
    { cls: "b", points: trend("prefill") },
  ], Math.max(1, ordered.length - 1));
}

// A chart over run numbers 0..last rather than time.
function trendChart(svg, lines, last) {
  const values = lines.flatMap((l) => l.points.map((p) => p[1]));
  let lo = Math.min(...values, 0);
  let hi = Math.max(...values, 1);
  const x = (i) => (i / last) * 600;
  const y = (v) => 140 - ((v - lo) / (hi - lo)) * 140;
  svg.replaceChildren();
  let count = 0;
  for (const line of lines) {
    count += line.points.length;
    if (!line.points.length) continue;
    const path = document.createElementNS(SVG, "polyline");
    path.setAttribute("class", "line " + line.cls);
    path.setAttribute("points", line.points.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" "));
    svg.appendChild(path);
  }
  svg.dataset.points = count;
}

function handle(name, data) {
  const v = JSON.parse(data);
  if (name === "hello") {
    samples = v.history || [];
    thresholds = v.thresholds || thresholds;
    for (const a of v.alerts || []) addEvent(a.kind, a.message, a.at);
    for (const t of v.thermal || []) thermalEvent(t);
    showValidations(v.validations || []);
    showActions(v);
    drawCharts();
  } else if (name === "status") {
    showStatus(v);
  } else if (name === "log") {
    showLog(v);
  } else if (name === "alert") {
    addEvent(v.kind, v.message, v.at);
  } else if (name === "thermal") {
    thermalEvent(v);
  } else if (name === "validations") {
    showValidations(v);
  }
}

async function follow() {
  const key = sessionStorage.getItem(KEY);
  const headers = key ? { Authorization: "Bearer " + key } : {};
  let resp;
  try {
    resp = await fetch("/events", { headers, cache: "no-store" });
  } catch (e) {
    return false;
  }
  if (resp.status === 401) {
    sessionStorage.removeItem(KEY);
    $("key-form").hidden = false;
    return "key";
  }
  if (!resp.ok || !resp.body) return false;
  $("key-form").hidden = true;
  $("live").textContent = "live";
  $("live").classList.add("on");
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data.push(line.slice(6));
      }
      if (data.length) handle(name, data.join("\n"));
    }
  }
  return false;
}

async function run() {
  for (;;) {
    const how = await follow();
    $("live").textContent = "offline";
    $("live").classList.remove("on");
    if (how === "key") return;
    await new Promise((r) => setTimeout(r, 2000));
  }
}

// The actions, when the daemon allows them (api.admin_keys_file): each is a POST to
// /ui/actions/NAME with the admin key, which is kept for the tab only.
function options(select, names) {
  const keep = select.value;
  select.replaceChildren();
  for (const n of names) {
    const o = document.createElement("option");
    o.value = n;
    o.textContent = n;
    select.appendChild(o);
  }
  if (names.includes(keep)) select.value = keep;
}

function showActions(v) {
  $("actions-on").hidden = !v.actions;
  $("actions-off").hidden = !!v.actions;
  if (v.actions_error) {
    $("actions-why").textContent =
      "The admin keys cannot be read, so this page only looks: " + v.actions_error;
  }
  const profiles = v.profiles || [];
  options($("profile-choice"), profiles);
  options($("drop-choice"), ["all"].concat(profiles));
  options($("validate-choice"), profiles);
  if (profiles.includes(v.validation_profile)) $("validate-choice").value = v.validation_profile;
}

function said(text, bad) {
  const p = $("action-result");
  p.textContent = text;
  p.classList.toggle("error", !!bad);
}

async function act(name, body) {
  const input = $("admin-key");
  if (input.value) {
    adminKey = input.value;
    input.value = "";
  }
  const key = adminKey;
  if (!key) {
    said("enter the admin key first", true);
    return;
  }
  said(name + "...");
  let resp;
  try {
    resp = await fetch("/ui/actions/" + name, {
      method: "POST",
      headers: { Authorization: "Bearer " + key, "Content-Type": "application/json" },
      body: JSON.stringify(body || {}),
      cache: "no-store",
    });
  } catch (e) {
    said(name + ": " + e, true);
    return;
  }
  let v = {};
  try {
    v = await resp.json();
  } catch (e) {
    v = {};
  }
  if (resp.ok) {
    if (v.cancelled === false) {
      said(name + ": no validation was running");
      return;
    }
    const more = v.profile ? " " + v.profile : v.dropped ? ": " + v.dropped.length + " dropped" : "";
    said(name + more + ": done");
    return;
  }
  if (resp.status === 401) adminKey = null;
  said(name + ": " + (v.error ? v.error.message : "HTTP " + resp.status), true);
}

for (const b of document.querySelectorAll("button[data-action]")) {
  b.addEventListener("click", () => act(b.dataset.action));
}
$("profile-form").addEventListener("submit", (e) => {
  e.preventDefault();
  act("profile", { profile: $("profile-choice").value });
});
$("drop-form").addEventListener("submit", (e) => {
  e.preventDefault();
  act("drop-checkpoint", { what: $("drop-choice").value });
});
$("validate-form").addEventListener("submit", (e) => {
  e.preventDefault();
  act("validate", { profile: $("validate-choice").value, runs: Number($("validate-runs").value) });
});

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY, $("key").value);
  $("key").value = "";
  run();
});

run();
