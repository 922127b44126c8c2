// facegate console: "Try it" for tenants, "Operate" for the operator.
// Same-origin requests only; keys and tokens live in this page's memory
// (never in URLs or storage); every server-provided string goes through
// textContent, never HTML. The page state the tests read is
// window.facegateConsole.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const state = { key: null, tenant: null, token: null, faces: [], runs: 0, lastError: null,
                  tenants: [], detail: null, versions: {}, stats: null, rates: {}, history: [], mine: null, models: [] };
  window.facegateConsole = state;
  let image = null; // the chosen Blob
  let camera = null; // the webcam stream, when started

  const HINTS = {
    unauthorized: "The key is missing, wrong or revoked.",
    unknown_handler: "This tenant has no such handler.",
    body_too_large: "The image is larger than this tenant may send.",
    unsupported_image: "Send a JPEG, PNG or WebP image.",
    invalid_image: "The image is corrupt or truncated.",
    image_too_large: "The image has more pixels than the handler accepts.",
    rate_limited: "Too many requests for this tenant.",
    concurrency_limited: "Too many requests in flight for this tenant.",
    overloaded: "The gateway is busy.",
    handler_timeout: "The handler ran past its deadline.",
    invalid: "The gateway refused it.",
  };

  function el(tag, text, attrs) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    return node;
  }
  function say(target, text, kind) {
    const node = $(target);
    node.textContent = text;
    node.className = kind || "";
  }
  // The error as a user wants to read it: status, code, message, hint, Retry-After.
  async function explain(response) {
    let code = "http_" + response.status;
    let message = response.statusText || "";
    try {
      const body = await response.json();
      if (body && body.error) { code = body.error.code; message = body.error.message; }
    } catch (_) { /* not JSON */ }
    let text = `${response.status} ${code}: ${message}`;
    if (HINTS[code]) text += ` — ${HINTS[code]}`;
    const retry = response.headers.get("retry-after");
    if (retry) text += ` Retry after ${retry} s.`;
    return { code, text };
  }
  async function fail(target, response) {
    const error = await explain(response);
    state.lastError = error.code;
    say(target, error.text, "error");
    return error;
  }

  // ---- tabs ----
  function showTab(name) {
    for (const tab of ["try", "mine", "operate"]) {
      const on = tab === name;
      $("tab-" + tab).setAttribute("aria-selected", String(on));
      $(tab).hidden = !on;
    }
  }
  $("tab-try").addEventListener("click", () => showTab("try"));
  $("tab-operate").addEventListener("click", () => showTab("operate"));
  $("tab-mine").addEventListener("click", () => showTab("mine"));

  // ---- my handlers: a tenant's own, with its deploy or read key ----
  // state.mine: { key, tenant, scopes, handlers: {name: versions answer}, log: [records], since }
  const LOG_ROWS = 200;
  async function tenantApi(path, init) {
    const options = Object.assign({}, init || {});
    options.headers = Object.assign({ Authorization: "Bearer " + state.mine.key }, options.headers || {});
    return fetch("/tenant/v1/" + path, options);
  }
  $("mine-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const key = $("mine-key").value.trim();
    const me = await fetch("/v1/me", { headers: { Authorization: "Bearer " + key } });
    if (!me.ok) { await fail("mine-status", me); return; }
    const who = await me.json();
    state.mine = { key, tenant: who.tenant, scopes: who.scopes || [], handlers: {}, log: [], since: null };
    if (!state.mine.scopes.includes("deploy") && !state.mine.scopes.includes("read")) {
      say("mine-status", "This key may only call handlers: give a deploy or read key.", "error");
      return;
    }
    $("mine-title").textContent = `Tenant ${who.tenant} (${state.mine.scopes.join(", ")})`;
    $("mine-upload").hidden = !state.mine.scopes.includes("deploy");
    $("mine-body").hidden = false;
    await refreshMine();
    // The log (and each version's share of 5xx, which is read from it) needs the read scope.
    const reads = state.mine.scopes.includes("read");
    $("mine-log").hidden = !reads;
    $("mine-charts").hidden = !reads;
    say("mine-status", reads ? "Connected." : "Connected. This key has no read scope: no log, usage or error rates.", "ok");
    if (reads) { pollMineLog(); pollMineUsage(state.mine); }
  });
  async function refreshMine() {
    const response = await tenantApi("handlers");
    if (!response.ok) { await fail("mine-status", response); return; }
    const list = (await response.json()).handlers || [];
    for (const h of list) {
      const versions = await tenantApi(`handlers/${encodeURIComponent(h.name)}/versions`);
      if (versions.ok) state.mine.handlers[h.name] = await versions.json();
    }
    const settings = await tenantApi("config");
    state.mine.settings = settings.ok ? (await settings.json()).settings || [] : [];
    renderMine();
    renderMineSettings();
  }
  // The tenant's settings: values shown, secrets by name and fingerprint only (the API never returns them).
  function renderMineSettings() {
    const body = $("mine-settings").tBodies[0];
    body.replaceChildren();
    for (const s of state.mine.settings) {
      const value = s.secret ? `secret (${s.fingerprint})` : s.value;
      const row = el("tr", null, { "data-name": s.name, "data-secret": String(s.secret) });
      for (const cell of [s.handler || "all handlers", s.name, value]) row.append(el("td", cell));
      body.append(row);
    }
  }
  // ---- the tenant's usage and latency over the last 7 days, drawn as SVG
  // (no library, nothing from elsewhere: the console works offline) ----
  const SVG = "http://www.w3.org/2000/svg";
  const DAYS = 7, SLOTS = DAYS * 24, PLOT_WIDTH = 720, HOUR_MS = 3600 * 1000;
  const PALETTE = ["#1f6feb", "#8250df", "#1a7f37", "#bf3989", "#9a6700", "#0550ae", "#cf222e", "#57606a"];
  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
    if (text !== undefined) node.textContent = text;
    return node;
  }
  // Clears a plot (its <title> stays) and draws the day lines and labels under `height`.
  function plotFrame(id, height, hours, caption) {
    const plot = $(id);
    for (const child of [...plot.children]) if (child.tagName !== "title") child.remove();
    const width = PLOT_WIDTH / SLOTS;
    hours.forEach((h, i) => {
      if (new Date(h.start).getHours() !== 0) return;
      plot.append(svg("line", { x1: i * width, x2: i * width, y1: 14, y2: height - 14, stroke: "#dde2e7" }));
      plot.append(svg("text", { x: i * width + 2, y: height - 2 }, new Date(h.start).toLocaleDateString(undefined, { weekday: "short", day: "numeric" })));
    });
    plot.append(svg("text", { x: 4, y: 11 }, caption));
    return plot;
  }
  // One slot per hour of the last 7 days, from the tenant's usage rows.
  function hourSlots(report) {
    const end = Math.floor(report.to_ms / HOUR_MS) * HOUR_MS;
    const hours = Array.from({ length: SLOTS }, (_, i) => ({ start: end - (SLOTS - 1 - i) * HOUR_MS, ok: 0, client: 0, server: 0, device: 0, latency: {} }));
    const first = hours[0].start;
    for (const r of report.rows) {
      const slot = hours[Math.round((r.start_ms - first) / HOUR_MS)];
      if (!slot) continue;
      slot.ok += r.requests_2xx + r.requests_3xx; slot.client += r.requests_4xx; slot.server += r.requests_5xx;
      slot.device += r.device_us;
      // Rows from before latency was metered have none: they would pull the mean down.
      if (!r.latency_us) continue;
      const l = slot.latency[r.handler] || (slot.latency[r.handler] = { requests: 0, us: 0 });
      l.requests += r.requests_2xx + r.requests_3xx + r.requests_4xx + r.requests_5xx; l.us += r.latency_us;
    }
    return hours;
  }
  function drawRequests(hours) {
    const height = 170, room = height - 32, width = PLOT_WIDTH / SLOTS;
    const top = Math.max(1, ...hours.map((h) => h.ok + h.client + h.server));
    const plot = plotFrame("mine-usage", height, hours, `${top} requests in the busiest hour`);
    hours.forEach((h, i) => {
      let y = height - 16;
      for (const [status, count, color] of [["ok", h.ok, "#1f6feb"], ["4xx", h.client, "#bf8700"], ["5xx", h.server, "#cf222e"]]) {
        if (!count) continue;
        const tall = Math.max(1, (count / top) * room);
        y -= tall;
        const bar = svg("rect", { x: i * width, y, width: Math.max(1, width - 0.5), height: tall, fill: color, "data-status": status, "data-requests": count });
        bar.append(svg("title", {}, `${new Date(h.start).toLocaleString()}: ${count} ${status === "ok" ? "2xx/3xx" : status}`));
        plot.append(bar);
      }
    });
  }
  function drawDevice(hours) {
    const height = 130, room = height - 32, width = PLOT_WIDTH / SLOTS;
    const top = Math.max(1, ...hours.map((h) => h.device));
    const plot = plotFrame("mine-device", height, hours, `${(top / 1e6).toFixed(2)} device seconds in the busiest hour`);
    hours.forEach((h, i) => {
      if (!h.device) return;
      const tall = Math.max(1, (h.device / top) * room);
      const bar = svg("rect", { x: i * width, y: height - 16 - tall, width: Math.max(1, width - 0.5), height: tall, fill: "#8250df", "data-device-ms": Math.round(h.device / 1000) });
      bar.append(svg("title", {}, `${new Date(h.start).toLocaleString()}: ${(h.device / 1e6).toFixed(3)} s`));
      plot.append(bar);
    });
  }
  function drawLatency(hours) {
    const height = 170, room = height - 32, width = PLOT_WIDTH / SLOTS;
    const handlers = [...new Set(hours.flatMap((h) => Object.keys(h.latency)))].sort();
    const mean = (l) => (l && l.requests ? l.us / l.requests / 1000 : null);
    const top = Math.max(1, ...hours.flatMap((h) => handlers.map((name) => mean(h.latency[name]) || 0)));
    const plot = plotFrame("mine-latency", height, hours, `${top.toFixed(1)} ms at the slowest hour's mean`);
    const legend = $("mine-latency-legend");
    legend.replaceChildren();
    handlers.forEach((name, n) => {
      const color = PALETTE[n % PALETTE.length];
      const points = hours.map((h, i) => [i, mean(h.latency[name])]).filter(([, ms]) => ms !== null)
        .map(([i, ms]) => [i * width + width / 2, height - 16 - (ms / top) * room, ms, hours[i].start]);
      plot.append(svg("polyline", { points: points.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" "), fill: "none", stroke: color, "stroke-width": 1.5, "data-handler": name }));
      for (const [x, y, ms, start] of points) {
        const dot = svg("circle", { cx: x, cy: y, r: 2, fill: color, "data-handler": name, "data-ms": ms.toFixed(2) });
        dot.append(svg("title", {}, `${name}, ${new Date(start).toLocaleString()}: ${ms.toFixed(1)} ms`));
        plot.append(dot);
      }
      const item = el("li", null, { "data-handler": name });
      const swatch = el("span", "", { class: "swatch" });
      swatch.style.background = color; // CSSOM: the policy allows no style attribute
      item.append(swatch, ` ${name}`);
      legend.append(item);
    });
  }
  async function refreshMineUsage(withState) {
    const from = Math.floor(Date.now() / 1000) - DAYS * 86400;
    const response = await tenantApi(`usage?from=${from}&by=hour`);
    if (!response.ok) return;
    const hours = hourSlots(await response.json());
    state.mine.hours = hours;
    drawRequests(hours);
    drawDevice(hours);
    drawLatency(hours);
    if (!withState) return;
    const kv = await tenantApi("kv");
    if (kv.ok) {
      const held = await kv.json();
      state.mine.kv = held;
      const buckets = (held.buckets || []).map((b) => `${b.name} (${b.keys})`).join(", ");
      $("mine-state").textContent = `${held.keys} keys, ${held.bytes} bytes` + (buckets ? ` in ${buckets}` : "");
    }
  }
  // Usage is written by the nodes every flush interval: read again every
  // 10 s (the state's size, which takes one of the tenant's connections,
  // every minute), for as long as `mine` is the connected key.
  function pollMineUsage(mine) {
    let ticks = 0;
    const tick = async () => {
      if (state.mine !== mine) return;
      try { await refreshMineUsage(ticks % 6 === 0); } catch (_) { /* next tick */ }
      ticks += 1;
      setTimeout(tick, 10000);
    };
    tick();
  }
  // Each version's requests and 5xx share, from the log this page holds.
  function errorRates(handler) {
    const rates = {};
    for (const r of state.mine.log) {
      if (r.kind !== "request" || r.handler !== handler) continue;
      const v = rates[r.version] || (rates[r.version] = { requests: 0, errors: 0 });
      v.requests += 1;
      if (r.status >= 500) v.errors += 1;
    }
    return rates;
  }
  function renderMine() {
    const box = $("mine-handlers");
    box.replaceChildren();
    const deploy = state.mine.scopes.includes("deploy");
    for (const [name, info] of Object.entries(state.mine.handlers)) {
      const rates = errorRates(name);
      const section = el("section", null, { class: "mine-handler", "data-handler": name });
      section.append(el("h3", name));
      const table = el("table");
      table.append(el("thead"));
      table.tHead.append(el("tr"));
      for (const title of ["Version", "Role", "Requests", "5xx", "Source"]) table.tHead.rows[0].append(el("th", title, { scope: "col" }));
      const body = el("tbody");
      for (const v of info.versions || []) {
        const role = v.version === info.active_version ? "active"
          : (info.canary && info.canary.version === v.version ? `canary ${info.canary.percent} %` : "");
        if (!role) continue;
        const seen = rates[v.version] || { requests: 0, errors: 0 };
        const share = seen.requests ? `${(100 * seen.errors / seen.requests).toFixed(1)} %` : "—";
        const row = el("tr", null, { "data-version": String(v.version), "data-role": role.split(" ")[0] });
        for (const cell of [v.version, role, seen.requests, share, sourceOf(v)]) row.append(el("td", cell));
        body.append(row);
      }
      table.append(body);
      section.append(table);
      if (deploy && info.canary) {
        const promote = el("button", "Promote canary", { type: "button" });
        promote.addEventListener("click", () => mineChange(name, "promote"));
        const abort = el("button", "Abort canary", { type: "button" });
        abort.addEventListener("click", () => mineChange(name, "abort"));
        section.append(promote, " ", abort);
      }
      box.append(section);
    }
  }
  async function mineChange(handler, action) {
    const response = await tenantApi(`handlers/${encodeURIComponent(handler)}/${action}`, { method: "POST" });
    if (!response.ok) { await fail("mine-upload-status", response); return; }
    say("mine-upload-status", `${handler}: ${action} done.`, "ok");
    await refreshMine();
  }
  $("mine-upload").addEventListener("submit", async (e) => {
    e.preventDefault();
    const name = $("mine-name").value.trim();
    const file = $("mine-file").files[0];
    if (!file) return;
    const percent = $("mine-canary").value.trim();
    const query = percent ? `?canary=${encodeURIComponent(percent)}` : "";
    say("mine-upload-status", "Uploading and compiling…");
    const response = await tenantApi(`handlers/${encodeURIComponent(name)}${query}`, {
      method: "PUT", headers: { "Content-Type": "application/wasm" }, body: file });
    if (!response.ok) { await fail("mine-upload-status", response); return; }
    const done = await response.json();
    say("mine-upload-status", `${name}: version ${done.version} stored` + (percent ? `, a ${percent} % canary.` : ", active."), "ok");
    await refreshMine();
  });
  // The log tail of every node: what came after the cursor (where the
  // tail is on each node), every second.
  function pollMineLog() {
    const mine = state.mine;
    const tick = async () => {
      if (state.mine !== mine) return;
      const since = mine.since ? `?since=${encodeURIComponent(mine.since)}` : "";
      try {
        const response = await tenantApi("logs" + since);
        if (response.ok) {
          const text = await response.text();
          const fresh = text.split("\n").filter((l) => l).map((l) => JSON.parse(l));
          mine.since = response.headers.get("x-facegate-logs-cursor") || mine.since;
          if (fresh.length) {
            mine.log = mine.log.concat(fresh).slice(-LOG_ROWS);
            renderMineLog();
            renderMine();
          }
        }
      } catch (_) { /* next tick */ }
      setTimeout(tick, 1000);
    };
    tick();
  }
  function renderMineLog() {
    const body = $("mine-log").tBodies[0];
    body.replaceChildren();
    for (const r of state.mine.log.slice().reverse()) {
      const row = el("tr", null, { "data-kind": r.kind });
      const what = r.kind === "request"
        ? `${r.status} in ${Math.round(r.duration_ms)} ms` + (r.limit ? ` (limit ${r.limit})` : "")
        : r.line;
      for (const cell of [new Date(r.time_ms).toLocaleTimeString(), r.node, `${r.handler}@${r.version}`, r.request_id, what]) row.append(el("td", cell));
      body.append(row);
    }
  }

  // ---- try it ----
  async function loadHandlers() {
    state.key = $("key").value.trim();
    state.tenant = null;
    const response = await fetch("/v1/me", { headers: { Authorization: "Bearer " + state.key } });
    if (!response.ok) { await fail("try-status", response); return false; }
    const me = await response.json();
    state.tenant = me.tenant;
    const select = $("handler");
    select.replaceChildren(...me.handlers.map((h) => el("option", `${h.name} (v${h.version})`, { value: h.name })));
    say("try-status", `Tenant ${me.tenant}: ${me.handlers.length} handler(s).`, "ok");
    state.lastError = null;
    return true;
  }
  $("load-handlers").addEventListener("click", loadHandlers);
  $("key").addEventListener("change", loadHandlers);

  function choose(blob) {
    if (!blob) return;
    image = blob;
    say("try-status", `Image chosen (${blob.type || "unknown type"}, ${blob.size} bytes).`);
  }
  $("image").addEventListener("change", (e) => choose(e.target.files[0]));
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => { e.preventDefault(); drop.classList.remove("over"); choose(e.dataTransfer.files[0]); });
  drop.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); $("image").click(); } });

  if (navigator.mediaDevices && navigator.mediaDevices.getUserMedia) {
    $("snapshot").hidden = false;
    $("snapshot").addEventListener("click", async () => {
      const video = $("camera");
      if (!camera) {
        try { camera = await navigator.mediaDevices.getUserMedia({ video: true }); } catch (e) { say("try-status", "No webcam: " + e.message, "error"); return; }
        video.srcObject = camera; video.hidden = false;
        $("snapshot").textContent = "Take snapshot";
        return;
      }
      const canvas = document.createElement("canvas");
      canvas.width = video.videoWidth; canvas.height = video.videoHeight;
      canvas.getContext("2d").drawImage(video, 0, 0);
      canvas.toBlob((blob) => choose(blob), "image/jpeg", 0.9);
    });
  }

  function timings(header) {
    const list = $("timings");
    list.replaceChildren();
    for (const part of (header || "").split(",")) {
      const [name, ...params] = part.trim().split(";");
      const dur = params.map((p) => p.trim()).find((p) => p.startsWith("dur="));
      if (name && dur) list.append(el("dt", name), el("dd", `${dur.slice(4)} ms`));
    }
  }

  async function draw(faces, size) {
    const canvas = $("canvas");
    const bitmap = await createImageBitmap(image, { imageOrientation: "from-image" });
    canvas.width = size ? size.width : bitmap.width;
    canvas.height = size ? size.height : bitmap.height;
    const ctx = canvas.getContext("2d");
    ctx.drawImage(bitmap, 0, 0, canvas.width, canvas.height);
    const line = Math.max(2, canvas.width / 300);
    ctx.lineWidth = line;
    ctx.font = `${Math.max(12, line * 6)}px system-ui`;
    for (const face of faces) {
      const [x1, y1, x2, y2] = face.box;
      ctx.strokeStyle = "#00e676";
      ctx.strokeRect(x1, y1, x2 - x1, y2 - y1);
      ctx.fillStyle = "#00e676";
      ctx.fillText(Number(face.score).toFixed(2), x1, Math.max(12, y1 - line));
      ctx.fillStyle = "#ff4081";
      for (const [x, y] of face.landmarks || []) ctx.fillRect(x - line, y - line, 2 * line, 2 * line);
    }
    canvas.dataset.faces = String(faces.length);
  }

  async function run(event) {
    event.preventDefault();
    if (!state.tenant && !(await loadHandlers())) return;
    if (!image) { say("try-status", "Choose or drop an image first.", "error"); return; }
    const params = new URLSearchParams({ threshold: $("threshold").value, size: $("size").value, max_faces: $("max-faces").value });
    const url = `/v1/${encodeURIComponent(state.tenant)}/${encodeURIComponent($("handler").value)}?${params}`;
    say("try-status", "Running…");
    const response = await fetch(url, { method: "POST", body: image,
      headers: { Authorization: "Bearer " + state.key, "Content-Type": image.type || "application/octet-stream" } });
    timings(response.headers.get("server-timing"));
    if (!response.ok) { state.faces = []; await fail("try-status", response); return; }
    state.lastError = null;
    const type = response.headers.get("content-type") || "";
    const returned = $("returned");
    if (type.startsWith("image/")) {
      returned.src = URL.createObjectURL(await response.blob());
      returned.hidden = false;
      state.faces = [];
      say("try-status", "The handler returned an image.", "ok");
    } else {
      const body = await response.json();
      returned.hidden = true;
      state.faces = Array.isArray(body.faces) ? body.faces : [];
      await draw(state.faces, body.image);
      const list = $("faces");
      list.replaceChildren(...state.faces.map((f) => el("li", `score ${Number(f.score).toFixed(3)} at [${f.box.map((v) => Math.round(v)).join(", ")}]`)));
      say("try-status", `${state.faces.length} face(s) found.`, "ok");
    }
    state.runs += 1;
  }
  $("try-form").addEventListener("submit", run);

  // ---- operate ----
  async function admin(method, path, body, type) {
    const headers = { Authorization: "Bearer " + state.token };
    if (type) headers["Content-Type"] = type;
    const response = await fetch("/admin/v1/" + path, { method, headers, body });
    if (!response.ok) throw response;
    return response.json();
  }
  async function attempt(target, action) {
    try { return await action(); } catch (e) {
      if (e instanceof Response) await fail(target, e); else say(target, String(e), "error");
      return undefined;
    }
  }
  const json = (value) => JSON.stringify(value);
  const seg = encodeURIComponent;

  async function connect(event) {
    event.preventDefault();
    state.token = $("admin-token").value.trim();
    const list = await attempt("op-status", () => admin("GET", "tenants"));
    if (!list) {
      $("op-body").hidden = true;
      if (state.lastError === "not_found") {
        $("op-status").textContent += " The admin API is on its own listener (--admin-listen): open the console there.";
      }
      return;
    }
    $("op-body").hidden = false;
    say("op-status", "Connected.", "ok");
    state.lastError = null;
    renderTenants(list.tenants);
    refreshModels();
    poll();
  }
  $("admin-form").addEventListener("submit", connect);

  // ---- models (GET/PUT/DELETE /admin/v1/models) ----
  async function refreshModels() {
    const list = await attempt("model-status", () => admin("GET", "models"));
    if (list) renderModels(list);
  }
  function renderModels(list) {
    const active = {};
    for (const row of list.repository) if (row.active) active[row.name] = row;
    state.models = list.models.map((m) => m.name);
    $("models").tBodies[0].replaceChildren(...list.models.map((m) => {
      const row = active[m.name];
      const accuracy = row && row.accuracy && row.accuracy.accuracy;
      const version = row ? `v${row.version}, found ${accuracy.matched} of ${accuracy.reference}${row.accuracy.forced ? " (forced)" : ""}` : "–";
      const actions = el("td");
      if (m.source === "repository") {
        const remove = el("button", "Remove", { type: "button", "aria-label": `Remove model ${m.name}` });
        remove.addEventListener("click", async () => {
          if (!window.confirm(`Remove model ${m.name}? Handlers calling it get unknown_model.`)) return;
          if (await attempt("model-status", () => admin("DELETE", "models/" + seg(m.name)))) {
            say("model-status", `Model ${m.name} removed.`, "ok");
            refreshModels();
          }
        });
        actions.append(remove);
      }
      const mib = Math.ceil(m.memory_bytes / 1048576);
      return rowOf([m.name, m.source, m.loaded ? (m.pinned ? "yes, pinned" : "yes") : "no", String(mib), `${m.loads} / ${m.evictions}`, version], actions);
    }));
  }
  $("add-model").addEventListener("submit", async (e) => {
    e.preventDefault();
    const name = $("model-name").value.trim();
    const file = $("model-file").files[0];
    if (!file) return;
    say("model-status", `Adding ${name}: the accuracy gate runs the test photos…`);
    const force = $("model-force").checked ? "?force=true" : "";
    const added = await attempt("model-status", () => admin("PUT", `models/${seg(name)}${force}`, file, "application/octet-stream"));
    if (added) {
      say("model-status", `Model ${name} version ${added.version} added: found ${added.accuracy.matched} of ${added.accuracy.reference} faces.`, "ok");
      refreshModels();
    }
  });

  async function refreshTenants() {
    const list = await attempt("op-status", () => admin("GET", "tenants"));
    if (list) renderTenants(list.tenants);
  }
  function renderTenants(tenants) {
    state.tenants = tenants.map((t) => t.name);
    $("tenants").tBodies[0].replaceChildren(...tenants.map((t) => {
      const open = el("button", "Open", { type: "button", "aria-label": `Open tenant ${t.name}` });
      open.addEventListener("click", () => openTenant(t.name));
      const remove = el("button", "Delete", { type: "button", "aria-label": `Delete tenant ${t.name}` });
      remove.addEventListener("click", async () => {
        if (!window.confirm(`Delete tenant ${t.name}, its keys and handlers?`)) return;
        if (await attempt("op-status", () => admin("DELETE", "tenants/" + seg(t.name)))) {
          if (state.detail === t.name) { state.detail = null; $("detail").hidden = true; }
          refreshTenants();
        }
      });
      const actions = el("td"); actions.append(open, " ", remove);
      const rate = state.rates[t.name];
      return rowOf([t.name, t.handlers.map((h) => `${h.name} v${h.active_version}`).join(", "), rate === undefined ? "–" : rate.toFixed(1)], actions);
    }));
  }
  // Where a version's bytes came from: "upload", or the registry reference
  // pinned to its digest (shortened; the whole of it is in the API).
  function sourceOf(v) {
    const source = v.source || "upload";
    const at = source.indexOf("@sha256:");
    return at < 0 ? source : source.slice("oci://".length, at + "@sha256:".length + 12) + "…";
  }

  function rowOf(cells, last) {
    const row = el("tr");
    for (const cell of cells) row.append(el("td", cell));
    if (last) row.append(last);
    return row;
  }

  $("create-tenant").addEventListener("submit", async (e) => {
    e.preventDefault();
    const name = $("new-tenant").value.trim();
    if (await attempt("op-status", () => admin("POST", "tenants", json({ name }), "application/json"))) {
      say("op-status", `Tenant ${name} created.`, "ok");
      $("new-tenant").value = "";
      await refreshTenants();
      openTenant(name);
    }
  });

  async function openTenant(name) {
    const info = await attempt("op-status", () => admin("GET", "tenants/" + seg(name)));
    if (!info) return;
    state.detail = name;
    $("detail").hidden = false;
    $("detail-title").textContent = `Tenant ${name}`;
    $("new-key").hidden = true;
    for (const input of $("limits-form").elements) {
      if (!input.name) continue;
      const value = info.limits[input.name];
      if (input.type === "checkbox") input.checked = value === true;
      else input.value = value ?? "";
      input.dataset.was = input.type === "checkbox" ? String(input.checked) : input.value;
    }
    await Promise.all([renderKeys(name), renderHandlers(name, info.handlers), renderUsage(name)]);
  }

  // ---- usage (GET /admin/v1/usage, written by the nodes every flush interval) ----
  const HOUR = 3600 * 1000;
  async function renderUsage(name) {
    const report = await attempt("op-status", () => admin("GET", `usage?tenant=${seg(name)}&by=hour`));
    if (!report) return;
    const end = Math.floor(report.to_ms / HOUR) * HOUR;
    const hours = Array.from({ length: 24 }, (_, i) => ({ start: end - (23 - i) * HOUR, ok: 0, failed: 0 }));
    const sum = { requests: 0, errors: 0, guest: 0, device: 0, calls: 0, bytesIn: 0, bytesOut: 0 };
    for (const r of report.rows) {
      const failed = r.requests_4xx + r.requests_5xx, ok = r.requests_2xx + r.requests_3xx;
      const slot = hours.find((h) => h.start === r.start_ms);
      if (slot) { slot.ok += ok; slot.failed += failed; }
      sum.requests += ok + failed; sum.errors += failed; sum.guest += r.guest_us; sum.device += r.device_us;
      sum.calls += r.infer_calls; sum.bytesIn += r.bytes_in; sum.bytesOut += r.bytes_out;
    }
    usageChart(hours);
    state.usage = sum;
    const list = $("usage");
    list.replaceChildren(
      el("dt", "requests (4xx/5xx)"), el("dd", `${sum.requests} (${sum.errors})`),
      el("dt", "guest / device time"), el("dd", `${(sum.guest / 1e6).toFixed(2)} s / ${(sum.device / 1e6).toFixed(2)} s`),
      el("dt", "inference calls"), el("dd", sum.calls),
      el("dt", "bytes in / out"), el("dd", `${sum.bytesIn} / ${sum.bytesOut}`));
  }
  function usageChart(hours) {
    const canvas = $("usage-chart");
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const top = Math.max(1, ...hours.map((h) => h.ok + h.failed));
    const width = canvas.width / hours.length, room = canvas.height - 16;
    hours.forEach((h, i) => {
      const okHeight = (h.ok / top) * room, failedHeight = (h.failed / top) * room;
      ctx.fillStyle = "#1f6feb"; ctx.fillRect(i * width + 1, canvas.height - okHeight, width - 2, okHeight);
      ctx.fillStyle = "#cf222e"; ctx.fillRect(i * width + 1, canvas.height - okHeight - failedHeight, width - 2, failedHeight);
    });
    ctx.fillStyle = "#1b1f24"; ctx.font = "12px system-ui";
    ctx.fillText(`${top} requests in the busiest hour`, 6, 12);
  }
  $("usage-csv").addEventListener("click", async () => {
    const response = await fetch(`/admin/v1/usage?tenant=${seg(state.detail)}&by=hour&format=csv`, { headers: { authorization: `Bearer ${state.token}` } });
    if (!response.ok) return fail("op-status", response);
    const link = el("a", "", { href: URL.createObjectURL(await response.blob()), download: `usage-${state.detail}.csv` });
    link.click();
    URL.revokeObjectURL(link.href);
  });

  $("limits-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const patch = {};
    // Only what was changed becomes an override: the rest keeps following the server's defaults.
    for (const input of e.target.elements) {
      if (!input.name) continue;
      if (input.type === "checkbox") {
        if (String(input.checked) !== input.dataset.was) patch[input.name] = input.checked;
      } else if (input.value !== "" && input.value !== input.dataset.was) {
        patch[input.name] = input.type === "text" ? input.value : Number(input.value);
      }
    }
    if (await attempt("op-status", () => admin("PATCH", "tenants/" + seg(state.detail), json(patch), "application/json"))) {
      say("op-status", "Limits saved.", "ok");
    }
  });

  async function renderKeys(name) {
    const list = await attempt("op-status", () => admin("GET", `tenants/${seg(name)}/keys`));
    if (!list) return;
    $("keys").tBodies[0].replaceChildren(...list.keys.map((k) => {
      const actions = el("td");
      if (!k.revoked_at) {
        const revoke = el("button", "Revoke", { type: "button", "aria-label": `Revoke key ${k.id}` });
        revoke.addEventListener("click", async () => {
          if (await attempt("op-status", () => admin("DELETE", `tenants/${seg(name)}/keys/${seg(k.id)}`))) renderKeys(name);
        });
        actions.append(revoke);
      }
      return rowOf([k.id, date(k.created_at), k.revoked_at ? date(k.revoked_at) : "–"], actions);
    }));
  }
  const date = (seconds) => new Date(seconds * 1000).toLocaleString();

  $("create-key").addEventListener("click", async () => {
    const created = await attempt("op-status", () => admin("POST", `tenants/${seg(state.detail)}/keys`));
    if (!created) return;
    $("new-key-value").textContent = created.key;
    $("new-key").hidden = false;
    renderKeys(state.detail);
  });
  $("copy-key").addEventListener("click", async () => {
    try { await navigator.clipboard.writeText($("new-key-value").textContent); say("op-status", "Key copied.", "ok"); }
    catch (_) { say("op-status", "Copy failed: select the key and copy it by hand.", "error"); }
  });

  async function renderHandlers(name, handlers) {
    const box = $("handlers");
    box.replaceChildren();
    state.versions = {};
    for (const h of handlers) {
      const info = await attempt("op-status", () => admin("GET", `tenants/${seg(name)}/handlers/${seg(h.name)}/versions`));
      if (!info) continue;
      state.versions[h.name] = { active: info.active_version, versions: info.versions.map((v) => v.version) };
      const table = el("table");
      table.append(el("caption", `${h.name}: active version ${info.active_version ?? "none"}`));
      const head = el("tr");
      for (const title of ["Version", "sha256", "Size", "Uploaded", "Source", ""]) head.append(el("th", title, { scope: "col" }));
      table.append(head);
      for (const v of info.versions.slice().reverse()) {
        const actions = el("td");
        if (v.version === info.active_version) actions.append(el("strong", "active"));
        else {
          const activate = el("button", "Activate", { type: "button", "aria-label": `Activate ${h.name} version ${v.version}` });
          activate.addEventListener("click", () => change(name, h.name, "activate", json({ version: v.version })));
          actions.append(activate);
        }
        table.append(rowOf([`v${v.version}`, v.sha256.slice(0, 16) + "…", `${(v.size / 1024).toFixed(0)} KiB`, date(v.created_at), sourceOf(v)], actions));
      }
      const rollback = el("button", `Roll back ${h.name}`, { type: "button" });
      rollback.addEventListener("click", () => change(name, h.name, "rollback"));
      box.append(table, rollback);
    }
  }
  async function change(tenant, handler, action, body) {
    const done = await attempt("upload-status", () => admin("POST", `tenants/${seg(tenant)}/handlers/${seg(handler)}/${action}`, body, body ? "application/json" : undefined));
    if (done) { say("upload-status", `${handler}: version ${done.active_version} is active.`, "ok"); openTenant(tenant); }
  }

  $("upload-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const file = $("upload-file").files[0];
    const handler = $("upload-name").value.trim();
    if (!file) { say("upload-status", "Choose a .wasm component.", "error"); return; }
    say("upload-status", "Uploading and compiling…");
    const stored = await attempt("upload-status", () => admin("PUT", `tenants/${seg(state.detail)}/handlers/${seg(handler)}`, file, "application/wasm"));
    if (!stored) return;
    state.lastError = null;
    say("upload-status", `${handler}: version ${stored.version} stored (sha256 ${stored.sha256.slice(0, 16)}…) and active.`, "ok");
    openTenant(state.detail);
  });

  // ---- live view ----
  let polling = null;
  let ticks = 0;
  function poll() {
    if (polling) return;
    const tick = async () => {
      if (!$("operate").hidden && state.token) {
        try { live(await admin("GET", "stats")); } catch (_) { /* shown on the next action */ }
        // Usage is written every flush interval (10 s by default): look again as often.
        ticks += 1;
        if (state.detail && ticks % 5 === 0) renderUsage(state.detail);
      }
    };
    tick();
    polling = window.setInterval(tick, 2000);
  }
  function live(stats) {
    const now = Date.now() / 1000;
    const previous = state.stats;
    state.stats = { at: now, stats };
    if (previous) {
      const dt = Math.max(0.001, now - previous.at);
      for (const [tenant, t] of Object.entries(stats.tenants)) {
        const before = previous.stats.tenants[tenant];
        state.rates[tenant] = before ? Math.max(0, t.requests - before.requests) / dt : 0;
      }
      const tenant = state.detail;
      state.history.push(tenant ? state.rates[tenant] || 0 : Object.values(state.rates).reduce((a, b) => a + b, 0));
      if (state.history.length > 90) state.history.shift();
      chart();
    }
    const list = $("live");
    list.replaceChildren();
    const t = state.detail && stats.tenants[state.detail];
    if (t) {
      const errors = Object.entries(t.by_status).filter(([s]) => Number(s) >= 400).map(([s, n]) => `${s}: ${n}`).join(", ") || "none";
      list.append(el("dt", "requests"), el("dd", t.requests), el("dt", "p50 / p99 latency"), el("dd", `≤ ${ms(t.p50_seconds)} / ≤ ${ms(t.p99_seconds)}`),
        el("dt", "errors by status"), el("dd", errors), el("dt", "queue depth"), el("dd", t.queue_depth), el("dt", "device time"), el("dd", `${t.device_seconds.toFixed(2)} s`));
    }
    for (const m of stats.models) {
      list.append(el("dt", `${m.name}: batches by size`), el("dd", m.batch_sizes.map((n, i) => `${i + 1}:${n}`).filter((s) => !s.endsWith(":0")).join("  ") || "none"),
        el("dt", `${m.name}: device busy`), el("dd", m.busy_seconds.map((s) => `${s.toFixed(1)} s`).join(", ")));
    }
    if (!$("tenants").hidden) renderRates();
  }
  const ms = (seconds) => (seconds === null ? "–" : `${Math.round(seconds * 1000)} ms`);
  function renderRates() {
    for (const row of $("tenants").tBodies[0].rows) {
      const rate = state.rates[row.cells[0].textContent];
      row.cells[2].textContent = rate === undefined ? "–" : rate.toFixed(1);
    }
  }
  function chart() {
    const canvas = $("chart");
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const top = Math.max(1, ...state.history);
    ctx.strokeStyle = "#1f6feb"; ctx.lineWidth = 2; ctx.beginPath();
    state.history.forEach((v, i) => {
      const x = (i / 89) * canvas.width, y = canvas.height - (v / top) * (canvas.height - 16);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
    ctx.fillStyle = "#1b1f24"; ctx.font = "12px system-ui";
    ctx.fillText(`${(state.detail || "all tenants")}: ${top.toFixed(1)} req/s peak`, 6, 12);
  }
})();
