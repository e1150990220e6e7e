// The live page: plain JS, no libraries. It draws nothing itself: the graph and the
// histograms come from the server as SVG; this script wires clicks and polling.
"use strict";
const token = new URLSearchParams(location.search).get("token");
const poll = Number(new URLSearchParams(location.search).get("poll") || 1000);
const panels = new Map();  // "kind key" -> {element, key, kind, before}; before: null follows the newest samples
const scalarCharts = new Map();  // name -> {element, name, before}, as panels
const SCROLL = '<div class="scroll" hidden><input type="range" class="back"> <span class="window"></span></div>';
let readOnly = false;  // a finished run reopened from its history: nothing to arm
const $ = (id) => document.getElementById(id);

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (token) headers["Authorization"] = "Bearer " + token;
  const response = await fetch(path, Object.assign({}, options, {headers}));
  const type = response.headers.get("Content-Type") || "";
  const body = type.startsWith("application/json") ? await response.json() : await response.text();
  if (!response.ok) throw Object.assign(new Error(body.error || String(body)), {body});
  return body;
}

function say(text) { $("message").textContent = text || ""; }

async function loadGraph() {
  const depth = $("depth").value;
  try {
    const svg = await api("api/graph.svg?depth=" + encodeURIComponent(depth));
    $("graph").innerHTML = svg;
    for (const g of $("graph").querySelectorAll("g[data-key]")) {
      g.addEventListener("click", (event) => { event.stopPropagation(); arm(g.dataset.key); });
    }
    markArmed();
  } catch (e) {
    if (e.body && e.body.layout === false) return listLayers(e.message);  // nothing to lay out with: asked once
    $("graph").innerHTML = '<p class="note"></p>';
    $("graph").firstChild.textContent = e.message;
    setTimeout(loadGraph, 2000);  // the graph appears with the first forward
  }
}

// Where the server cannot lay out a picture (no Graphviz libraries), the layers as a list that
// a search box filters; a click arms a layer as a box in the picture would.
async function listLayers(why) {
  $("depth").disabled = true;
  $("graph").innerHTML = '<p class="note why"></p><input id="find" type="search" placeholder="find a layer">' +
                         '<ul id="layers"></ul>';
  $("graph").querySelector(".why").textContent = why;  // the server says why, and what to install
  const rows = await api("api/keys");
  for (const row of rows) {
    const item = document.createElement("li");
    item.dataset.key = row.key;
    item.textContent = row.key + (row.shapes ? "  " + JSON.stringify(row.shapes.output) : "");
    item.addEventListener("click", () => arm(row.key));
    $("layers").append(item);
  }
  $("find").addEventListener("input", () => {
    const words = $("find").value.toLowerCase().split(/\s+/).filter(Boolean);
    for (const item of $("layers").children) {
      item.hidden = !words.every((w) => item.dataset.key.toLowerCase().includes(w));
    }
  });
  markArmed();
}

function markArmed() {
  for (const g of $("graph").querySelectorAll("g.node[data-key], #layers li")) {
    const armed = [...panels.keys()].some((id) => id.endsWith(" " + g.dataset.key));
    g.classList.toggle("armed", armed);
  }
}

async function arm(key) {
  const kind = $("kind").value;
  const every = Number($("every").value) || 1;
  try {
    await api("api/sample", {method: "POST", headers: {"Content-Type": "application/json"},
                              body: JSON.stringify({key, kind, every})});
    say("");
    addPanel(key, kind);
  } catch (e) { say(e.message); }
}

async function disarm(key, kind) {
  const id = kind + " " + key;
  try { await api("api/sample?key=" + encodeURIComponent(key) + "&kind=" + kind, {method: "DELETE"}); }
  catch (e) { say(e.message); }
  const panel = panels.get(id);
  if (panel) { panel.element.remove(); panels.delete(id); }
  markArmed();
}

function addPanel(key, kind) {
  const id = kind + " " + key;
  if (panels.has(id)) return;
  const element = document.createElement("div");
  element.className = "panel";
  element.dataset.key = key;
  element.dataset.kind = kind;
  element.innerHTML = '<h3><span></span><button>disarm</button></h3><div class="counts"></div>' +
                      '<div class="charts"></div>' + SCROLL + '<table></table>';
  element.querySelector("h3 span").textContent = key + " · " + kind;
  element.querySelector("button").addEventListener("click", () => disarm(key, kind));
  element.querySelector("button").hidden = readOnly;
  $("scalars").after(element);
  const panel = {element, key, kind, before: null, what: "samples"};
  scrollBack(panel, refreshPanel);
  panels.set(id, panel);
  markArmed();
  refreshPanel(panel);
}

// Scroll back over the history on disk (a panel's or a scalar chart's range control): the range picks
// the newest step shown; at its right end the view follows the newest again.
function scrollBack(view, redraw) {
  const range = view.element.querySelector("input.back");
  range.addEventListener("input", () => {
    const step = Number(range.value);
    view.before = step >= Number(range.max) ? null : step + 1;
    labelWindow(view);
    redraw(view);
  });
}

function labelWindow(view) {
  view.element.querySelector(".window").textContent =
    view.before === null ? "newest " + view.what : view.what + " up to step " + (view.before - 1);
}

// The range control spans the first to the last step kept on disk (spans: /api/history's rows of the view).
function spanRange(view, spans) {
  spans = spans.filter((s) => s.first_step !== null);
  if (!spans.length) return;
  const range = view.element.querySelector("input.back");
  range.min = Math.min(...spans.map((s) => s.first_step));
  range.max = Math.max(...spans.map((s) => s.last_step));
  if (view.before === null) range.value = range.max;
  view.element.querySelector(".scroll").hidden = false;
  labelWindow(view);
}

function showHistory(history) {
  for (const panel of panels.values()) {
    spanRange(panel, history.series.filter((s) => s.key === panel.key && s.kind === panel.kind));
  }
  for (const chart of scalarCharts.values()) spanRange(chart, history.scalars.filter((s) => s.name === chart.name));
}

const COLUMNS = ["count", "mean", "std", "min", "max", "nan", "inf"];

function number(x) { return x === null || x === undefined ? "-" : (Number.isInteger(x) ? String(x) : x.toPrecision(4)); }

function escape(text) {
  const div = document.createElement("div");
  div.textContent = text;
  return div.innerHTML;
}

// One chart and one table row per series: a layer's inputs and outputs (output[1][0] for a
// layer returning several), or a parameter of the module for the weight kinds.
async function refreshPanel(panel) {
  const q = "key=" + encodeURIComponent(panel.key) + "&kind=" + panel.kind;
  const info = await api("api/samples?" + q + "&since=" + Number.MAX_SAFE_INTEGER);  // the counts, no samples
  const calls = panel.kind.startsWith("weight") ? "backwards" : "calls";
  panel.element.querySelector(".counts").textContent = readOnly ?
    `${info.taken} sampled · ${info.samples} kept on disk · steps ${info.first_step} to ${info.last_step}` :
    `every ${info.every} · ${info.taken} sampled of ${info.calls} ${calls} · ${info.samples} kept · ${info.dropped} dropped` +
    (info.over_budget ? ` · ${info.over_budget} over the memory budget` : "") +
    (info.armed ? "" : " · disarmed") + (info.error ? " · " + info.error : "");
  const charts = [];
  const rows = [];
  const before = panel.before === null ? "" : "&before=" + panel.before;  // scrolled back: from disk
  for (const role of info.roles) {
    const r = q + "&role=" + encodeURIComponent(role);
    charts.push('<div class="chart"><div>' + escape(role) + "</div>" + await api("api/chart.svg?" + r + before) + "</div>");
    const stats = await api("api/stats?" + r);
    rows.push("<tr><th>" + escape(role) + "</th>" + COLUMNS.map((c) => "<td>" + number(stats.stats[c]) + "</td>").join("") + "</tr>");
  }
  if (!info.roles.length) charts.push('<p class="note">waiting for the first sample</p>');
  panel.element.querySelector(".charts").innerHTML = charts.join("");
  panel.element.querySelector("table").innerHTML =
    "<tr><th></th>" + COLUMNS.map((c) => "<th>" + c + "</th>").join("") + "</tr>" + rows.join("");
}

// Scalar curves: log_scalar's and the health arm's, one chart each, drawn by the server; each
// scrolls back over the history on disk as the panels do.
async function refreshScalars() {
  const answer = await api("api/scalars?since=" + Number.MAX_SAFE_INTEGER);  // the names, no points
  for (const name of answer.names) {
    let chart = scalarCharts.get(name);
    if (!chart) {
      const element = document.createElement("div");
      element.className = "chart scalar";
      element.dataset.name = name;
      element.innerHTML = '<div class="name"></div><div class="plot"></div>' + SCROLL;
      element.querySelector(".name").textContent = name;
      $("scalars").append(element);
      chart = {element, name, before: null, what: "points"};
      scrollBack(chart, refreshScalar);
      scalarCharts.set(name, chart);
    }
    await refreshScalar(chart);
  }
}

async function refreshScalar(chart) {
  const before = chart.before === null ? "" : "&before=" + chart.before;  // scrolled back: from disk
  chart.element.querySelector(".plot").innerHTML =
    await api("api/scalar.svg?name=" + encodeURIComponent(chart.name) + before);
}

let root = null;

async function toggleHealth() {
  if (!root) return;
  const q = "api/sample";
  try {
    if ($("health").checked) {
      await api(q, {method: "POST", headers: {"Content-Type": "application/json"},
                    body: JSON.stringify({key: root, kind: "health", every: Number($("every").value) || 1})});
    } else {
      await api(q + "?key=" + encodeURIComponent(root) + "&kind=health", {method: "DELETE"});
    }
    say("");
  } catch (e) { say(e.message); }
}

async function tick() {
  try {
    const status = await api("api/status");
    $("step").textContent = status.step;
    $("rank").textContent = status.rank + " / " + status.world_size;
    $("model").textContent = status.model + (status.read_only ? " · reopened from " + status.history.logdir : "");
    readOnly = status.read_only;
    root = status.root;
    $("health").checked = status.arms.some((a) => a.kind === "health" && a.key === root && a.armed);
    for (const arm of status.arms) if ((arm.armed || readOnly) && arm.kind !== "health") addPanel(arm.key, arm.kind);
    for (const panel of panels.values()) await refreshPanel(panel);
    if (status.history) showHistory(await api("api/history"));
    await refreshScalars();
  } catch (e) { say(e.message); }
  setTimeout(tick, poll);
}

$("health").addEventListener("change", toggleHealth);
$("depth").addEventListener("change", loadGraph);
loadGraph();
tick();
