// tine console: a client of tine's REST API and of envd through tine's
// proxy, the same routes and checks the E2B SDKs use. The API key is kept
// in sessionStorage (this tab only) and sent as X-API-KEY; nothing is put
// into the page as HTML: every text goes in through textContent.
'use strict';

const KEY = 'tine.apiKey';
const ENVD_PORT = '49983';
const REFRESH_MS = 5000;
let timers = [];
let teardown = [];

// ---- small helpers ----
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.className = v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const kid of kids.flat()) {
    if (kid === undefined || kid === null || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}
const svgNS = 'http://www.w3.org/2000/svg';
function s(tag, attrs) {
  const el = document.createElementNS(svgNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  return el;
}
function every(ms, fn) { timers.push(setInterval(fn, ms)); }
function age(iso) {
  const t = Date.parse(iso);
  if (!t) return '';
  let secs = Math.max(0, Math.round((Date.now() - t) / 1000));
  if (secs < 120) return secs + ' s';
  if (secs < 7200) return Math.round(secs / 60) + ' min';
  if (secs < 172800) return Math.round(secs / 3600) + ' h';
  return Math.round(secs / 86400) + ' d';
}
function mib(bytes) { return (bytes / 1048576).toFixed(0) + ' MiB'; }
function b64(bytes) {
  let bin = '';
  for (let i = 0; i < bytes.length; i += 0x8000) bin += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(bin);
}
function unb64(text) {
  const bin = atob(text);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

// ---- the API ----
class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}
async function api(method, path, body) {
  const headers = { 'X-API-KEY': sessionStorage.getItem(KEY) || '' };
  const init = { method, headers };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
  if (r.status === 401 && path !== '/v2/sandboxes?limit=1') {
    signOut('The server refused the key: sign in again.');
  }
  if (!r.ok) throw new ApiError(r.status, (data && data.message) || text || r.statusText);
  return { data, headers: r.headers };
}
function showError(where, e) {
  where.replaceChildren(h('p', { class: 'error', role: 'alert' }, String(e.message || e)));
}

// ---- sign in / out, navigation ----
function signOut(why) {
  sessionStorage.removeItem(KEY);
  location.hash = '#/';
  render(why);
}
function nav() {
  const here = location.hash.split('/')[1] || 'sandboxes';
  const link = (name, label) => h('a', { href: '#/' + name, class: here.startsWith(name.replace(/s$/, '')) ? 'here' : '' }, label);
  return [
    h('span', { class: 'brand' }, 'tine'),
    link('sandboxes', 'Sandboxes'),
    link('templates', 'Templates'),
    link('hosts', 'Hosts'),
    h('span', { class: 'right' },
      h('button', { id: 'sign-out', onclick: () => signOut() }, 'Sign out')),
  ];
}
function signIn(main, why) {
  document.getElementById('top').replaceChildren(h('span', { class: 'brand' }, 'tine'));
  const input = h('input', { id: 'api-key', type: 'password', autocomplete: 'off', placeholder: 'e2b_…' });
  const msg = h('p', { class: 'error', id: 'sign-in-error' }, why || '');
  const go = async (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, input.value.trim());
    try {
      await api('GET', '/v2/sandboxes?limit=1');
      location.hash = '#/sandboxes';
      render();
    } catch (e) {
      sessionStorage.removeItem(KEY);
      msg.textContent = e.status === 401 ? 'That key is not valid here.' : String(e.message);
    }
  };
  main.replaceChildren(h('div', { class: 'signin card' },
    h('h1', {}, 'Sign in'),
    h('p', { class: 'muted' }, 'Your API key (E2B_API_KEY). It stays in this tab and is sent only to this server.'),
    h('form', { onsubmit: go }, input, h('button', { id: 'sign-in', type: 'submit' }, 'Sign in')), msg));
  input.focus();
}

function render(why) {
  timers.forEach(clearInterval);
  timers = [];
  teardown.forEach((f) => f());
  teardown = [];
  const main = document.getElementById('main');
  if (!sessionStorage.getItem(KEY)) return signIn(main, why);
  document.getElementById('top').replaceChildren(...nav());
  const [, page, a, b, c] = location.hash.split('/').map(decodeURIComponent);
  main.replaceChildren();
  switch (page) {
    case 'sandbox': return c === undefined && b === 'terminal' ? terminalPage(main, a) : sandboxPage(main, a);
    case 'templates': return templatesPage(main);
    case 'template': return templatePage(main, a);
    case 'build': return buildPage(main, a, b);
    case 'hosts': return hostsPage(main);
    default: return sandboxesPage(main);
  }
}
window.addEventListener('hashchange', () => render());
window.addEventListener('DOMContentLoaded', () => render());

// ---- sandbox actions (the SDK's calls) ----
const actions = {
  pause: (id) => api('POST', `/sandboxes/${id}/pause`),
  resume: (id) => api('POST', `/sandboxes/${id}/connect`, { timeout: 300 }),
  snapshot: (id) => api('POST', `/sandboxes/${id}/snapshots`, {}),
  kill: (id) => api('DELETE', `/sandboxes/${id}`),
  fork: (id, count) => api('POST', `/sandboxes/${id}/fork`, { count }),
  timeout: (id, secs) => api('POST', `/sandboxes/${id}/timeout`, { timeout: secs }),
};
function actionButtons(sbx, done, status) {
  const run = async (name, ...args) => {
    status.textContent = `${name} ${sbx.sandboxID}…`;
    try {
      const r = await actions[name](sbx.sandboxID, ...args);
      status.textContent = `${name} ${sbx.sandboxID}: done` + (name === 'snapshot' && r.data ? ` (${r.data.snapshotID || ''})` : '');
    } catch (e) {
      status.textContent = `${name} ${sbx.sandboxID}: ${e.message}`;
    }
    done();
  };
  const running = sbx.state === 'running';
  const btn = (name, label, enabled, fn, cls) => h('button', {
    'data-action': name, 'data-sandbox': sbx.sandboxID, class: cls, disabled: !enabled, onclick: fn,
  }, label);
  return h('span', { class: 'bar' },
    btn('pause', 'Pause', running, () => run('pause')),
    btn('resume', 'Resume', !running, () => run('resume')),
    btn('snapshot', 'Snapshot', running, () => run('snapshot')),
    btn('fork', 'Fork…', running, () => {
      const n = prompt('How many children?', '1');
      if (n !== null && Number(n) > 0) run('fork', Number(n));
    }),
    btn('timeout', 'Timeout…', running, () => {
      const t = prompt('Seconds from now until it ends:', '300');
      if (t !== null && Number(t) > 0) run('timeout', Number(t));
    }),
    btn('kill', 'Kill', true, () => { if (confirm(`Kill ${sbx.sandboxID}?`)) run('kill'); }, 'danger'));
}

// ---- the sandboxes table ----
function sandboxesPage(main) {
  const q = new URLSearchParams(location.hash.split('?')[1] || '');
  const state = h('select', { id: 'state-filter' },
    ['running,paused', 'running', 'paused'].map((v) => h('option', { value: v, selected: q.get('state') === v }, v.replace(',', ' + '))));
  const meta = h('input', { id: 'metadata-filter', placeholder: 'metadata: key=value&…', value: q.get('metadata') || '' });
  const status = h('span', { id: 'action-status', class: 'muted', role: 'status' });
  const body = h('tbody', { id: 'sandboxes' });
  const pager = h('span', { class: 'bar' });
  const tokens = [null];
  let token = null;
  const load = async () => {
    const p = new URLSearchParams({ limit: '20', state: state.value });
    if (meta.value.trim()) p.set('metadata', meta.value.trim());
    if (token) p.set('nextToken', token);
    try {
      const r = await api('GET', '/v2/sandboxes?' + p);
      const next = r.headers.get('x-next-token');
      body.replaceChildren(...r.data.map((sbx) => h('tr', { 'data-sandbox': sbx.sandboxID },
        h('td', { class: 'mono' }, h('a', { href: `#/sandbox/${sbx.sandboxID}` }, sbx.sandboxID)),
        h('td', { class: 'state-' + sbx.state }, sbx.state),
        h('td', {}, sbx.alias || sbx.templateID),
        h('td', { class: 'mono' }, sbx.nodeID || 'local'),
        h('td', {}, age(sbx.startedAt)),
        h('td', {}, sbx.cpuCount),
        h('td', {}, sbx.memoryMB + ' MiB'),
        h('td', {}, Object.entries(sbx.metadata || {}).map(([k, v]) => h('span', { class: 'tag' }, `${k}=${v}`))),
        h('td', {}, actionButtons(sbx, load, status)))));
      if (!r.data.length) body.replaceChildren(h('tr', {}, h('td', { colspan: 9, class: 'muted' }, 'No sandboxes.')));
      pager.replaceChildren(
        h('button', { id: 'prev-page', disabled: tokens.length < 2, onclick: () => { tokens.pop(); token = tokens[tokens.length - 1]; load(); } }, '← Previous'),
        h('button', { id: 'next-page', disabled: !next, onclick: () => { tokens.push(next); token = next; load(); } }, 'Next →'));
    } catch (e) { status.textContent = e.message; }
  };
  const refilter = () => { tokens.length = 1; token = null; load(); };
  state.addEventListener('change', refilter);
  meta.addEventListener('change', refilter);
  main.append(h('h1', {}, 'Sandboxes'),
    h('div', { class: 'bar' }, 'State', state, meta, h('button', { onclick: refilter }, 'Filter'), status),
    h('table', {}, h('thead', {}, h('tr', {}, ['ID', 'State', 'Template', 'Host', 'Age', 'vCPUs', 'Memory', 'Metadata', ''].map((t) => h('th', {}, t)))), body),
    pager);
  load();
  every(REFRESH_MS, load);
}

// ---- one sandbox ----
function plot(id, title, points, unit, max) {
  const W = 600, H = 160, L = 44, B = 18, T = 8;
  const svg = s('svg', { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: 'none', role: 'img', 'aria-label': title });
  const xs = points.map((p) => p[0]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const top = Math.max(max || 0, ...points.map((p) => p[1]), 1e-9);
  const X = (x) => L + (W - L - 8) * (x - x0) / (x1 - x0);
  const Y = (y) => H - B - (H - B - T) * y / top;
  svg.append(s('line', { class: 'axis', x1: L, y1: H - B, x2: W, y2: H - B }), s('line', { class: 'axis', x1: L, y1: T, x2: L, y2: H - B }));
  const label = (x, y, text, anchor) => { const t = s('text', { x, y, 'text-anchor': anchor || 'start' }); t.textContent = text; svg.append(t); };
  label(L - 4, T + 8, top.toFixed(top < 10 ? 1 : 0) + unit, 'end');
  label(L - 4, H - B, '0', 'end');
  if (points.length) {
    label(L, H - 4, new Date(x0 * 1000).toLocaleTimeString());
    label(W - 8, H - 4, new Date(x1 * 1000).toLocaleTimeString(), 'end');
    svg.append(s('polyline', { class: 'line', points: points.map((p) => `${X(p[0])},${Y(p[1])}`).join(' ') }));
    for (const p of points) svg.append(s('circle', { class: 'pt', cx: X(p[0]), cy: Y(p[1]), r: 2.5 }));
  }
  return h('div', { class: 'plot card', id }, h('h2', {}, `${title} (${points.length} samples)`), svg);
}
function sandboxPage(main, id) {
  const info = h('div', { class: 'card', id: 'sandbox-info' }, 'Loading…');
  const plots = h('div', { class: 'grid', id: 'plots' });
  const events = h('tbody', { id: 'events' });
  const logs = h('pre', { class: 'log', id: 'console-log' });
  const network = h('pre', { class: 'log', id: 'network-policy' });
  const status = h('span', { id: 'action-status', class: 'muted', role: 'status' });
  const bar = h('div', { class: 'bar' });
  const load = async () => {
    let sbx;
    try { sbx = (await api('GET', `/sandboxes/${id}`)).data; } catch (e) { return showError(info, e); }
    const kv = [['State', sbx.state], ['Template', sbx.alias || sbx.templateID], ['Host', sbx.nodeID || 'local'],
      ['Started', `${sbx.startedAt} (${age(sbx.startedAt)} ago)`], ['Ends', sbx.endAt], ['vCPUs', sbx.cpuCount],
      ['Memory', sbx.memoryMB + ' MiB'], ['Disk', sbx.diskSizeMB + ' MiB'], ['envd', sbx.envdVersion],
      ['Metadata', JSON.stringify(sbx.metadata || {})]];
    info.replaceChildren(h('dl', { class: 'kv' }, kv.flatMap(([k, v]) => [h('dt', {}, k), h('dd', { class: k === 'State' ? 'state-' + v : '' }, v)])));
    bar.replaceChildren(h('a', { id: 'open-terminal', href: `#/sandbox/${id}/terminal` }, 'Open a terminal'), actionButtons(sbx, load, status));
    network.textContent = JSON.stringify({ allowInternetAccess: sbx.allowInternetAccess, ...(sbx.network || {}) }, null, 2);
    try {
      const m = (await api('GET', `/sandboxes/${id}/metrics`)).data || [];
      plots.replaceChildren(
        plot('plot-cpu', 'CPU', m.map((x) => [x.timestampUnix, x.cpuUsedPct]), ' %', 100),
        plot('plot-mem', 'Memory', m.map((x) => [x.timestampUnix, x.memUsed / 1048576]), ' MiB', m.length ? m[m.length - 1].memTotal / 1048576 : 0),
        plot('plot-disk', 'Disk', m.map((x) => [x.timestampUnix, x.diskUsed / 1048576]), ' MiB', m.length ? m[m.length - 1].diskTotal / 1048576 : 0));
    } catch (e) { showError(plots, e); }
    try {
      const ev = (await api('GET', `/sandboxes/${id}/events`)).data || [];
      events.replaceChildren(...ev.slice(-50).reverse().map((e) => h('tr', {}, h('td', { class: 'mono' }, e.timestamp), h('td', {}, e.kind), h('td', { class: 'mono' }, e.detail))));
    } catch (e) { events.replaceChildren(h('tr', {}, h('td', { class: 'error' }, e.message))); }
    try {
      const l = (await api('GET', `/v2/sandboxes/${id}/logs?limit=100000`)).data;
      const lines = (l.logs || []).map((x) => x.line);
      logs.textContent = lines.slice(-200).join('\n') || '(empty)';
    } catch (e) { logs.textContent = e.message; }
  };
  main.append(h('h1', {}, 'Sandbox ', h('span', { class: 'mono' }, id)), bar, status, info, plots,
    h('div', { class: 'grid' },
      h('div', { class: 'card' }, h('h2', {}, 'Lifecycle events'), h('table', {}, events)),
      h('div', { class: 'card' }, h('h2', {}, 'Network policy'), network)),
    h('div', { class: 'card' }, h('h2', {}, 'Console log (last 200 lines)'), logs));
  load();
  every(REFRESH_MS, load);
}

// ---- a terminal: envd's PTY over Connect (JSON), through tine's proxy ----
function envelope(msg) {
  const json = new TextEncoder().encode(JSON.stringify(msg));
  const out = new Uint8Array(5 + json.length);
  new DataView(out.buffer).setUint32(1, json.length);
  out.set(json, 5);
  return out;
}
async function terminalPage(main, id) {
  const status = h('p', { id: 'terminal-status', class: 'muted', role: 'status' }, 'Connecting…');
  const box = h('div', { id: 'terminal' });
  main.append(h('h1', {}, 'Terminal: ', h('a', { class: 'mono', href: `#/sandbox/${id}` }, id)), status, box);
  let sbx;
  try { sbx = (await api('GET', `/sandboxes/${id}`)).data; } catch (e) { return showError(status, e); }
  if (sbx.state !== 'running') {
    status.replaceChildren(`The sandbox is ${sbx.state}. `, h('button', {
      id: 'resume-for-terminal', onclick: async () => { await actions.resume(id); render(); },
    }, 'Resume it'));
    return;
  }
  const term = new window.Terminal({ cursorBlink: true, fontSize: 14, convertEol: false });
  const fit = new window.FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(box);
  fit.fit();
  window.tineTerminal = term; // for tests and the curious
  const headers = (type) => ({
    'Content-Type': type, 'E2b-Sandbox-Id': id, 'E2b-Sandbox-Port': ENVD_PORT,
    'X-Access-Token': sbx.envdAccessToken, Authorization: 'Basic ' + btoa('user:'), 'Connect-Protocol-Version': '1',
  });
  const unary = (method, body) => fetch(`/process.Process/${method}`, {
    method: 'POST', headers: headers('application/json'), body: JSON.stringify(body),
  });
  const abort = new AbortController();
  teardown.push(() => { abort.abort(); term.dispose(); });
  let pid = null;
  let sending = Promise.resolve();
  term.onData((text) => {
    if (pid === null) return;
    const input = { process: { pid }, input: { pty: b64(new TextEncoder().encode(text)) } };
    sending = sending.then(() => unary('SendInput', input)).catch(() => {});
  });
  term.onResize(({ cols, rows }) => {
    if (pid !== null) unary('Update', { process: { pid }, pty: { size: { cols, rows } } }).catch(() => {});
  });
  const onWindow = () => fit.fit();
  window.addEventListener('resize', onWindow);
  teardown.push(() => window.removeEventListener('resize', onWindow));
  const start = {
    process: { cmd: '/bin/bash', args: ['-i', '-l'], envs: { TERM: 'xterm-256color', LANG: 'C.UTF-8' } },
    pty: { size: { cols: term.cols, rows: term.rows } },
  };
  let resp;
  try {
    resp = await fetch('/process.Process/Start', {
      method: 'POST', headers: headers('application/connect+json'), body: envelope(start), signal: abort.signal,
    });
  } catch (e) { return showError(status, e); }
  if (!resp.ok) return showError(status, new Error(`starting a shell: ${resp.status} ${await resp.text()}`));
  status.textContent = 'Connected.';
  const reader = resp.body.getReader();
  let buf = new Uint8Array(0);
  for (;;) {
    let chunk;
    try { chunk = await reader.read(); } catch (_) { break; }
    if (chunk.done) break;
    const joined = new Uint8Array(buf.length + chunk.value.length);
    joined.set(buf);
    joined.set(chunk.value, buf.length);
    buf = joined;
    while (buf.length >= 5) {
      const len = new DataView(buf.buffer, buf.byteOffset).getUint32(1);
      if (buf.length < 5 + len) break;
      const flags = buf[0];
      const msg = JSON.parse(new TextDecoder().decode(buf.subarray(5, 5 + len)) || '{}');
      buf = buf.slice(5 + len);
      if (flags & 2) {
        status.textContent = msg.error ? `The shell ended: ${msg.error.message || msg.error.code}` : 'The shell ended.';
        continue;
      }
      const ev = msg.event || {};
      if (ev.start) { pid = ev.start.pid; term.focus(); }
      if (ev.data && ev.data.pty) term.write(unb64(ev.data.pty));
      if (ev.end) status.textContent = `The shell exited (${ev.end.status || ev.end.exitCode || 'ended'}).`;
    }
  }
}

// ---- templates and builds ----
async function templatesPage(main) {
  const body = h('tbody', { id: 'templates' });
  main.append(h('h1', {}, 'Templates'), h('table', {}, h('thead', {}, h('tr', {},
    ['Template', 'Names', 'Last build', 'Status', 'vCPUs', 'Memory', 'Built'].map((t) => h('th', {}, t)))), body));
  try {
    const list = (await api('GET', '/templates')).data || [];
    body.replaceChildren(...list.map((t) => h('tr', {},
      h('td', { class: 'mono' }, h('a', { href: `#/template/${t.templateID}` }, t.templateID)),
      h('td', {}, (t.names || t.aliases || []).map((n) => h('span', { class: 'tag' }, n))),
      h('td', { class: 'mono' }, t.buildID ? h('a', { href: `#/build/${t.templateID}/${t.buildID}` }, t.buildID) : ''),
      h('td', { class: 'status-' + (t.buildStatus || '') }, t.buildStatus || ''),
      h('td', {}, t.cpuCount), h('td', {}, t.memoryMB ? t.memoryMB + ' MiB' : ''), h('td', {}, t.createdAt || ''))));
  } catch (e) { showError(body, e); }
  const builds = h('tbody', { id: 'recent-builds' });
  main.append(h('h2', {}, 'Recent builds'), h('table', {}, h('thead', {}, h('tr', {},
    ['Build', 'Template', 'Status', 'Started', 'Finished', 'Why it failed'].map((t) => h('th', {}, t)))), builds));
  try {
    const list = (await api('GET', '/builds?limit=50')).data || [];
    builds.replaceChildren(...list.map((b) => h('tr', { 'data-build': b.buildID },
      h('td', { class: 'mono' }, h('a', { href: `#/build/${b.templateID}/${b.buildID}` }, b.buildID)),
      h('td', { class: 'mono' }, h('a', { href: `#/template/${b.templateID}` }, b.templateID)),
      h('td', { class: 'status-' + b.status }, b.status), h('td', {}, b.createdAt), h('td', {}, b.finishedAt || ''),
      h('td', { class: 'error' }, b.reason ? `step ${b.reasonStep ?? '?'}: ${b.reason}` : ''))));
  } catch (e) { showError(builds, e); }
}
async function templatePage(main, id) {
  const head = h('div', { class: 'card' }, 'Loading…');
  const builds = h('tbody', { id: 'builds' });
  main.append(h('h1', {}, 'Template ', h('span', { class: 'mono' }, id)), head,
    h('h2', {}, 'Builds'), h('table', {}, h('thead', {}, h('tr', {}, ['Build', 'Status', 'Started', 'Finished'].map((t) => h('th', {}, t)))), builds));
  try {
    const t = (await api('GET', `/templates/${encodeURIComponent(id)}`)).data;
    let tags = [];
    try { tags = (await api('GET', `/templates/${encodeURIComponent(id)}/tags`)).data || []; } catch (_) { tags = []; }
    head.replaceChildren(h('dl', { class: 'kv' },
      h('dt', {}, 'Names'), h('dd', {}, (t.names || []).map((n) => h('span', { class: 'tag' }, n))),
      h('dt', {}, 'Tags'), h('dd', { id: 'tags' }, tags.map((x) => h('span', { class: 'tag' }, `${x.tag || x.name || JSON.stringify(x)}${x.buildID ? ' → ' + x.buildID : ''}`))),
      h('dt', {}, 'Created'), h('dd', {}, t.createdAt)));
    builds.replaceChildren(...(t.builds || []).map((b) => h('tr', {},
      h('td', { class: 'mono' }, h('a', { href: `#/build/${id}/${b.buildID}` }, b.buildID)),
      h('td', { class: 'status-' + b.status }, b.status), h('td', {}, b.createdAt), h('td', {}, b.finishedAt || ''))));
  } catch (e) { showError(head, e); }
}
function buildPage(main, template, build) {
  const head = h('div', { class: 'card', id: 'build-status' }, 'Loading…');
  const steps = h('div', { id: 'build-steps' });
  main.append(h('h1', {}, 'Build ', h('span', { class: 'mono' }, build), ' of ',
    h('a', { class: 'mono', href: `#/template/${template}` }, template)), head, steps);
  const entries = [];
  let reason = null;
  const draw = (status) => {
    // Steps begin at their "[k/n] KIND args" line; what comes before is
    // the set-up, what a failure names is highlighted.
    const groups = [{ title: 'Set-up', num: 0, lines: [] }];
    for (const e of entries) {
      const m = /^\[(\d+)\/(\d+)\]\s+[A-Z]+\b/.exec(e.message);
      if (m && Number(m[1]) !== groups[groups.length - 1].num) groups.push({ title: e.message, num: Number(m[1]), lines: [] });
      else groups[groups.length - 1].lines.push(e);
    }
    const failed = reason && reason.step !== undefined && reason.step !== null ? Number(reason.step) : null;
    steps.replaceChildren(...groups.filter((g) => g.num || g.lines.length).map((g) => {
      const bad = failed !== null && g.num === failed;
      return h('div', { class: 'step' + (bad ? ' failed-step' : ''), id: bad ? 'failed-step' : null, 'data-step': g.num },
        h('h3', {}, g.title, bad ? '  ← failed here' : ''),
        g.lines.length ? h('pre', { class: 'log' }, g.lines.map((e) => `${e.timestamp || ''} ${e.level || ''} ${e.message}`).join('\n')) : null);
    }));
    head.replaceChildren(h('dl', { class: 'kv' },
      h('dt', {}, 'Status'), h('dd', { class: 'status-' + status, id: 'build-state' }, status),
      reason ? [h('dt', {}, 'Failed step'), h('dd', {}, String(reason.step ?? '')),
        h('dt', {}, 'Reason'), h('dd', { class: 'error', id: 'build-reason' }, reason.message)] : null));
  };
  const poll = async () => {
    try {
      const r = (await api('GET', `/templates/${encodeURIComponent(template)}/builds/${encodeURIComponent(build)}/status?logsOffset=${entries.length}&limit=1000`)).data;
      entries.push(...(r.logEntries || []));
      reason = r.reason || null;
      draw(r.status);
      if (r.status !== 'building' && r.status !== 'waiting') timers.forEach(clearInterval);
    } catch (e) { showError(head, e); }
  };
  poll();
  every(1000, poll);
}

// ---- hosts ----
async function hostsPage(main) {
  const body = h('tbody', { id: 'hosts' });
  main.append(h('h1', {}, 'Hosts'), h('table', {}, h('thead', {}, h('tr', {},
    ['Host', 'Address', 'Up', 'Heartbeat', 'Live / capacity', 'Cores', 'Free memory', 'Free disk', 'Version'].map((t) => h('th', {}, t)))), body));
  const load = async () => {
    try {
      const hosts = (await api('GET', '/hosts')).data || [];
      body.replaceChildren(...hosts.map((n) => h('tr', { 'data-host': n.nodeID },
        h('td', { class: 'mono' }, n.nodeID), h('td', { class: 'mono' }, n.address),
        h('td', { class: n.up ? 'state-running' : 'status-error' }, n.up ? 'up' : 'down'),
        h('td', {}, (n.heartbeatAgeMs / 1000).toFixed(1) + ' s ago'),
        h('td', {}, `${n.live} / ${n.capacity}`), h('td', {}, n.cores),
        h('td', {}, mib(n.memoryFreeMB * 1048576)), h('td', {}, mib(n.diskFreeMB * 1048576)), h('td', {}, n.version))));
    } catch (e) { showError(body, e); }
  };
  load();
  every(REFRESH_MS, load);
}
