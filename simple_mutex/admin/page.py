"""The live page's HTML (``simple-mutex serve``): one self-contained document, no asset
from anywhere else. It fetches ``/state`` every second and draws it; every value from the
cache is set as text (``textContent``), never as markup, so a key or a label cannot
inject anything into the page."""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>simple-mutex: live locks</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2em 2em; color: #1d2330; }
  h1 { font-size: 1.3em; margin: 0 0 .2em; }
  h2 { font-size: 1.05em; margin: 1.4em 0 .4em; }
  #status { color: #555; }
  #error { color: #fff; background: #b3261e; padding: .3em .6em; display: none; }
  #said { color: #0b5; min-height: 1.2em; }
  table { border-collapse: collapse; width: 100%; }
  th, td { text-align: left; padding: .25em .6em; border-bottom: 1px solid #e3e6ec; }
  th { font-weight: 600; color: #444; background: #f5f6f8; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .late { color: #b3261e; font-weight: 600; }
  .key { font-family: ui-monospace, monospace; overflow-wrap: anywhere; }
  .line { border: 1px solid #e3e6ec; border-radius: 6px; padding: .4em .7em; margin: .4em 0; }
  .calls { display: flex; flex-wrap: wrap; gap: .3em; margin-top: .3em; }
  .call { border-radius: 4px; padding: .1em .5em; font-size: .92em; background: #eef1f6; }
  .call.running { background: #d5f0dc; }
  .call.sent { background: #fdf1d2; }
  .stuck { color: #b3261e; margin-top: .2em; }
  .empty { color: #777; font-style: italic; }
  button { font: inherit; padding: .1em .6em; cursor: pointer; }
  #events li { font-family: ui-monospace, monospace; font-size: .9em; }
</style>
</head>
<body>
<h1>simple-mutex: live locks</h1>
<div id="status">connecting...</div>
<div id="error" role="alert"></div>
<div id="said" role="status"></div>
<h2>Held keys</h2>
<table id="locks"><thead><tr>
  <th>Key</th><th>Slot</th><th>Holder</th><th>Task or job</th><th>Since</th>
  <th>Held for</th><th>Lease left</th><th>Fence</th><th>Waiters</th><th class="act"></th>
</tr></thead><tbody></tbody></table>
<h2>Lines (calls in order)</h2>
<div id="lines"></div>
<h2>Recent events</h2>
<ol id="events" reversed></ol>
<script>
"use strict";
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const el = (tag, text, cls) => {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
};
const secs = (s) => {
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
};
const clock = (iso) => new Date(iso).toLocaleTimeString();
const ago = (epoch, now) => secs(now - epoch);

function release(lock) {
  const holder = lock.host + " pid " + lock.pid + (lock.label ? " (" + lock.label + ")" : "");
  if (!confirm("Free " + lock.key + " slot " + lock.slot + ", held by " + holder +
               " with fence " + lock.fence + "?\\nIts work loses its lease.")) return;
  act("/release", {key: lock.key, slot: lock.slot, fence: lock.fence});
}

async function act(path, body) {
  const said = document.getElementById("said");
  try {
    const reply = await fetch(path, {
      method: "POST",
      headers: {"Content-Type": "application/json", "X-Simple-Mutex-Token": token || ""},
      body: JSON.stringify(body),
    });
    const answer = await reply.json();
    said.textContent = answer.text || answer.error || reply.statusText;
    said.style.color = answer.done ? "#0b5" : "#b3261e";
  } catch (err) {
    said.textContent = path.slice(1) + " failed: " + err;
    said.style.color = "#b3261e";
  }
  refresh();
}

function stepOver(line, call) {
  const what = "#" + call.ticket + (call.call ? " (" + call.call + ")" : " (sent, not arrived)");
  if (!confirm("Step over " + what + " in the line of " + line.key +
               "?\\nIt will never run; the calls behind it go on.")) return;
  act("/step-over", {key: line.key, ticket: call.ticket});
}

function drawLocks(state) {
  const body = document.querySelector("#locks tbody");
  const actions = state.actions && token;
  document.querySelector("#locks th.act").textContent = actions ? "Release" : "";
  body.replaceChildren();
  if (!state.locks.length) {
    const row = el("tr"); const cell = el("td", "nothing is held", "empty");
    cell.colSpan = 10; row.append(cell); body.append(row);
  }
  for (const lock of state.locks) {
    const row = el("tr");
    row.dataset.key = lock.key;
    row.append(el("td", lock.key, "key"), el("td", lock.slot, "num"),
               el("td", lock.host + " pid " + lock.pid), el("td", lock.label || ""),
               el("td", clock(lock.acquired_at)), el("td", secs(lock.held_for), "num"),
               el("td", lock.lease_left > 0 ? secs(lock.lease_left) : "ran out",
                  lock.lease_left > 0 ? "num" : "num late"),
               el("td", lock.fence, "num"),
               el("td", lock.waiters === null ? "?" : lock.waiters ? "yes" : "no"));
    const act = el("td");
    if (actions) {
      const button = el("button", "release");
      button.addEventListener("click", () => release(lock));
      act.append(button);
    }
    row.append(act);
    body.append(row);
  }
}

function drawLines(state) {
  const box = document.getElementById("lines");
  box.replaceChildren();
  if (!state.lines.length) box.append(el("div", "no call waits in any line", "empty"));
  const now = Date.parse(state.at) / 1000;
  for (const line of state.lines) {
    const div = el("div", null, "line");
    div.dataset.key = line.key;
    const head = el("div");
    head.append(el("span", line.key, "key"),
                el("span", " \\u2014 " + line.waiting + " waiting" +
                           (line.held ? ", its lock held" : ", its lock free")));
    div.append(head);
    const calls = el("div", null, "calls");
    for (const call of line.calls) {
      const what = call.state === "sent" ? "sent, not arrived" : call.state;
      const sent = call.promoted ? " \\u00b7 sent for its turn " + ago(call.promoted, now) +
                                   " ago" : "";
      const chip = el("span", "#" + call.ticket + " " + what +
                      (call.call ? " " + call.call : "") + " \\u00b7 " + ago(call.since, now) +
                      sent, "call " + call.state);
      chip.dataset.ticket = call.ticket;
      chip.dataset.state = call.state;
      if (state.actions && token && call.state !== "running") {
        const button = el("button", "step over");
        button.addEventListener("click", () => stepOver(line, call));
        chip.append(" ", button);
      }
      calls.append(chip);
    }
    if (line.more) calls.append(el("span", "and " + line.more + " more", "call"));
    div.append(calls);
    for (const reason of line.stuck) div.append(el("div", "stuck: " + reason, "stuck"));
    box.append(div);
  }
}

function drawEvents(state) {
  const list = document.getElementById("events");
  list.replaceChildren();
  for (const event of state.events.slice(-30).reverse()) {
    const item = el("li", clock(event.at) + "  " + event.kind + "  " + event.key + ": " +
                    event.text);
    item.dataset.kind = event.kind;
    list.append(item);
  }
  if (!state.events.length) list.append(el("li", "none yet", "empty"));
}

async function refresh() {
  const error = document.getElementById("error");
  try {
    const reply = await fetch("/state", {cache: "no-store"});
    const state = await reply.json();
    drawLocks(state); drawLines(state); drawEvents(state);
    const parked = state.lines.reduce((n, line) => n + line.waiting, 0);
    document.getElementById("status").textContent =
      "refreshed " + clock(state.at) + " \\u00b7 " + state.locks.length + " held \\u00b7 " +
      parked + " parked" + (state.actions && token ? " \\u00b7 actions on" : "");
    error.textContent = state.error || "";
    error.style.display = state.error ? "block" : "none";
  } catch (err) {
    error.textContent = "the server does not answer: " + err;
    error.style.display = "block";
  }
}
refresh();
setInterval(refresh, 1000);
</script>
</body>
</html>
"""
