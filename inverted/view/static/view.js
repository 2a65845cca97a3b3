// inverted view: what the three pages share (fetching, the key-free header, formatting).
"use strict";

const COLOURS = { prompt: "rgb(232, 232, 232)", sampled: "rgb(186, 218, 255)", masked: "rgb(255, 214, 153)" };

async function getJSON(path, params) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params || {})) {
    if (Array.isArray(v)) v.forEach((x) => url.searchParams.append(k, x));
    else if (v !== null && v !== undefined && v !== "") url.searchParams.set(k, v);
  }
  const response = await fetch(url, { credentials: "same-origin" });
  if (!response.ok) {
    const body = await response.json().catch(() => null);
    const message = (body && (body.detail || (body.error && body.error.message))) || response.statusText;
    throw new Error(`${response.status} ${typeof message === "string" ? message : JSON.stringify(message)}`);
  }
  return response.json();
}

function header(active) {
  const links = [["/", "Run"], ["/samples", "Samples"]]
    .map(([href, name]) => `<a href="${href}"${name === active ? ' style="font-weight:600"' : ""}>${name}</a>`).join("");
  document.body.insertAdjacentHTML("afterbegin",
    `<header><span class="title">inverted view</span><span id="run-title"></span>${links}</header>`);
  getJSON("/api/run").then((run) => { document.getElementById("run-title").textContent = run.title; }).catch(() => {});
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "—";
  if (typeof value === "number" && !Number.isInteger(value)) return value.toFixed(digits);
  return String(value);
}

function escapeHTML(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function showError(error) {
  console.warn(error);
  const box = document.getElementById("error");
  if (box) box.textContent = String(error.message || error);
}

function trajectoryLink(row, text) {
  return `<a href="/trajectory?group=${row.group_index}&index=${row.sample_index}&branch=${row.branch}">${text}</a>`;
}
