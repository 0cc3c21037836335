// One sandbox: info, limits, timings, live usage, the live exec output, files, and actions.
import { useEffect, useMemo, useRef, useState } from 'preact/hooks';
import { ApiError, del, eventSource, get, post, url } from '../api.js';
import { hashFor } from '../router.js';
import {
  ChartView, ConfirmButton, ErrorBanner, fmtAgo, fmtBytes, fmtCores, fmtDuration, fmtTime, html, KV, Labels, PageHeader,
  PALETTE, Section, StateBadge, Table, usePoll,
} from '../ui/index.js';

const POLL_MS = 2000;
const ENDED = new Set(['stopped', 'failed', 'lost']);
const MAX_EXECS = 40;
const MAX_CHUNKS = 2000;
const MAX_CHARS = 200000;

const base = (id) => `/v1/sandboxes/${encodeURIComponent(id)}`;

function networkText(net) {
  if (!net) return 'none';
  if (typeof net === 'string') return net;
  return JSON.stringify(net);
}

function Info({ info }) {
  return html`<${Section} title="Info" testid="sandbox-info">
    <${KV} rows=${[
      ['kind', info.kind],
      ['image', html`<span class="mono">${info.image}</span>`],
      ['tenant', info.owner || 'operator'],
      ['node', info.node],
      ['created', `${fmtTime(info.created_at)} (${fmtAgo(info.created_at)})`],
      ['expires', `${fmtTime(info.expires_at)} (${fmtAgo(info.expires_at)}; then ${info.on_timeout})`],
      ['reason', info.reason],
      ['waiting', info.waiting],
      ['started from', info.started_from],
      ['forked from', info.forked_from],
      ['accelerator', info.accelerator],
      ['network', html`<span class="mono">${networkText(info.network)}</span>`],
      ['trajectory', info.trajectory
        ? html`<a href=${hashFor('/trajectories/view', { id: info.trajectory })}>${info.trajectory}</a>${info.trajectory_length !== null && info.trajectory_length !== undefined ? ` (${info.trajectory_length} calls)` : ''}`
        : null],
      ['labels', html`<${Labels} labels=${info.labels} />`],
      ['volumes', (info.volumes || []).length ? (info.volumes || []).map((v) => v.name || JSON.stringify(v)).join(', ') : null],
    ]} />
  <//>`;
}

function Limits({ limits }) {
  const l = limits || {};
  return html`<${Section} title="Limits" testid="sandbox-limits">
    <${KV} rows=${[
      ['cpu (request)', fmtCores(l.cpu)],
      ['cpu limit', l.cpu_limit ? fmtCores(l.cpu_limit) : 'none'],
      ['memory (limit)', fmtBytes(l.memory)],
      ['memory request', l.memory_request !== null && l.memory_request !== undefined ? fmtBytes(l.memory_request) : 'as limit'],
      ['disk', fmtBytes(l.disk)],
      ['file size', l.file_size ? fmtBytes(l.file_size) : 'none'],
      ['pids', l.pids],
      ['open files', l.nofile],
    ]} />
  <//>`;
}

function Timings({ timings }) {
  const rows = Object.entries(timings || {}).map(([phase, s]) => ({ phase, s }));
  const top = Math.max(1e-9, ...rows.map((r) => r.s));
  return html`<${Section} title="Timings" testid="sandbox-timings">
    <${Table} rows=${rows} rowKey=${(r) => r.phase} empty="No timings recorded."
      columns=${[
        { key: 'phase', label: 'Phase' },
        { key: 's', label: 'Duration', className: 'num', render: (r) => fmtDuration(r.s) },
        { key: 'bar', label: '', className: 'bar-cell', render: (r) => html`<div class="meter"><div class="meter-fill requested" style=${{ width: `${(100 * r.s) / top}%` }}></div></div>` },
      ]} />
  <//>`;
}

/** The latest sample and the series: {samples: [{at, cpu_used, memory}]} (also the single {cpu, memory, at}). */
function samplesOf(reply) {
  if (!reply) return [];
  if (Array.isArray(reply.samples)) return reply.samples;
  return reply.at ? [{ at: reply.at, cpu_used: reply.cpu, memory: reply.memory }] : [];
}

const USAGE_OPTIONS = {
  scales: {
    cpu: { type: 'linear', position: 'left', beginAtZero: true, title: { display: true, text: 'cores' } },
    mem: { type: 'linear', position: 'right', beginAtZero: true, grid: { drawOnChartArea: false },
      ticks: { callback: (v) => fmtBytes(v) } },
    x: { ticks: { maxTicksLimit: 6 } },
  },
  plugins: { legend: { position: 'bottom', labels: { boxWidth: 10 } } },
};

function Usage({ id, info }) {
  const [samples, setSamples] = useState([]);
  const [error, setError] = useState(null);
  const live = info && !ENDED.has(info.state);
  usePoll(async () => {
    if (!live) return;
    try {
      setSamples(samplesOf(await get(`${base(id)}/usage`)));
      setError(null);
    } catch (e) {
      setError(e);
    }
  }, live ? POLL_MS : 0, [id, live]);
  const l = (info && info.limits) || {};
  const last = samples.length ? samples[samples.length - 1] : null;
  const share = (x, of, fmt) => (x !== null && x !== undefined && of ? ` (${Math.round((100 * x) / of)}% of ${fmt(of)})` : '');
  const data = useMemo(() => ({
    labels: samples.map((x) => fmtTime(x.at).slice(11)),
    datasets: [
      { label: 'cpu', yAxisID: 'cpu', data: samples.map((x) => x.cpu_used), borderColor: PALETTE[0], backgroundColor: PALETTE[0], pointRadius: 0, borderWidth: 1.5 },
      { label: 'memory', yAxisID: 'mem', data: samples.map((x) => x.memory), borderColor: PALETTE[2], backgroundColor: PALETTE[2], pointRadius: 0, borderWidth: 1.5 },
    ],
  }), [samples]);
  return html`<${Section} title="Usage" testid="sandbox-usage">
    ${error && html`<${ErrorBanner} error=${error} />`}
    ${!live && html`<p class="muted">The sandbox has ended.</p>`}
    ${live && html`<${KV} rows=${[
      ['cpu', last && last.cpu_used !== null && last.cpu_used !== undefined ? `${fmtCores(last.cpu_used)}${share(last.cpu_used, l.cpu_limit || l.cpu, fmtCores)}` : 'not sampled yet'],
      ['memory', last && last.memory !== null && last.memory !== undefined ? `${fmtBytes(last.memory)}${share(last.memory, l.memory, fmtBytes)}` : 'not sampled yet'],
      ['sampled', last ? fmtAgo(last.at) : '–'],
    ]} />`}
    ${live && samples.length > 1 && html`<${ChartView} type="line" data=${data} options=${USAGE_OPTIONS} testid="sandbox-usage-chart" height=${140} />`}
  <//>`;
}

/** Applies one event to the list of exec blocks (newest last), bounded in count and size. */
function reduceExecs(execs, type, data) {
  const list = execs.slice();
  let i = list.findIndex((x) => x.exec === data.exec);
  if (i < 0 && type !== 'lost') {
    list.push({ exec: data.exec, cmd: data.cmd || '', chunks: [], chars: 0, clipped: false, exit: undefined, error: null });
    i = list.length - 1;
  }
  const block = i >= 0 ? { ...list[i] } : null;
  if (type === 'start') block.cmd = data.cmd || '';
  if (type === 'output') {
    const text = String(data.data || '');
    if (block.chars + text.length > MAX_CHARS || block.chunks.length >= MAX_CHUNKS) block.clipped = true;
    else {
      block.chunks = [...block.chunks, { stream: data.stream === 'stderr' ? 'stderr' : 'stdout', text }];
      block.chars += text.length;
    }
  }
  if (type === 'end') {
    block.exit = data.exit_code;
    block.error = data.error;
  }
  if (block) list[i] = block;
  return list.slice(-MAX_EXECS);
}

function ExecBlock({ block }) {
  const done = block.exit !== undefined;
  const badge = !done ? html`<span class="badge info">running</span>`
    : block.error ? html`<span class="badge bad" data-testid="exec-exit">error: ${block.error}</span>`
      : html`<span class=${`badge ${block.exit === 0 ? 'ok' : 'bad'}`} data-testid="exec-exit">exit ${block.exit === null ? '?' : block.exit}</span>`;
  return html`<div class="exec-block" data-testid="exec-block" data-exec=${block.exec}>
    <div class="exec-head">
      <span class="muted">#${block.exec}</span>
      <span class="exec-cmd" data-testid="exec-cmd">${block.cmd}</span>
      ${badge}
    </div>
    ${block.chunks.length > 0 && html`<pre class="exec-out" data-testid="exec-stream">${block.chunks.map((c, i) => html`<span key=${i} class=${c.stream}>${c.text}</span>`)}${block.clipped ? html`<span class="muted">\n… more output not shown</span>` : ''}</pre>`}
  </div>`;
}

function LiveExecs({ id, live, onGone }) {
  const [execs, setExecs] = useState([]);
  const [status, setStatus] = useState('connecting');
  const [dropped, setDropped] = useState(0);
  useEffect(() => {
    if (!live) {
      setStatus('closed');
      return undefined;
    }
    const es = eventSource(`${base(id)}/execs/live`);
    const on = (type) => (ev) => {
      let data;
      try {
        data = JSON.parse(ev.data);
      } catch (_) {
        return;
      }
      if (type === 'lost') setDropped((n) => n + (Number(data.dropped) || 0));
      else if (type === 'gone') {
        // The sandbox ended: the server closed the stream; do not let EventSource reconnect.
        es.close();
        setStatus('closed');
        if (onGone) onGone();
      } else setExecs((list) => reduceExecs(list, type, data));
    };
    ['start', 'output', 'end', 'lost', 'gone'].forEach((t) => es.addEventListener(t, on(t)));
    es.onopen = () => setStatus('live');
    es.onerror = () => setStatus(es.readyState === EventSource.CLOSED ? 'closed' : 'reconnecting');
    return () => es.close();
  }, [id, live]);
  const badge = { live: 'ok', connecting: 'info', reconnecting: 'warn', closed: 'muted' }[status];
  return html`<${Section} title="Live exec output" testid="exec-output"
    actions=${html`<span class=${`badge ${badge}`} data-testid="exec-stream-status">${status}</span>
      ${execs.length > 0 && html` <button type="button" class="link" onClick=${() => setExecs([])}>clear</button>`}`}>
    ${dropped > 0 && html`<p class="badge warn">${dropped} events dropped (the page fell behind)</p>`}
    ${execs.length === 0
      ? html`<p class="muted">${live ? 'Execs that start from now on show here as they run.' : 'The sandbox has ended.'}</p>`
      : html`<div class="exec-list">${execs.map((b) => html`<${ExecBlock} key=${b.exec} block=${b} />`)}</div>`}
  <//>`;
}

function parentOf(path) {
  const trimmed = path.replace(/\/+$/, '');
  const at = trimmed.lastIndexOf('/');
  return at <= 0 ? '/' : trimmed.slice(0, at);
}

function Files({ id, live }) {
  const [path, setPath] = useState('/');
  const [draft, setDraft] = useState('/');
  const [list, setList] = useState(null);
  const [error, setError] = useState(null);
  const asked = useRef(null); // the listing last asked for: an older one answering late is dropped
  const load = async (p) => {
    asked.current = p;
    try {
      const reply = await get(`${base(id)}/files/list`, { path: p });
      if (asked.current !== p) return;
      setList(reply.entries || []);
      setError(null);
    } catch (e) {
      if (asked.current !== p) return;
      setList([]);
      setError(e);
    }
  };
  // the box shows the directory shown, but only when that changes: what is being typed is kept
  useEffect(() => setDraft(path), [path]);
  useEffect(() => {
    if (live) load(path);
  }, [id, path, live]);
  const go = (p) => setPath(p || '/');
  const isDir = (f) => (f.type === 'dir' ? 0 : 1);
  const rows = (list || []).slice().sort((a, b) => isDir(a) - isDir(b) || a.name.localeCompare(b.name));
  return html`<${Section} title="Files" testid="files">
    ${!live ? html`<p class="muted">The sandbox has ended; its files are gone.</p>` : html`
      <form class="files-path" onSubmit=${(e) => { e.preventDefault(); go(draft.trim()); }}>
        <button type="button" disabled=${path === '/'} onClick=${() => go(parentOf(path))}>↑ up</button>
        <input data-testid="files-path" value=${draft} onInput=${(e) => setDraft(e.currentTarget.value)} spellcheck="false" />
        <button type="submit">Open</button>
        <button type="button" onClick=${() => load(path)}>Refresh</button>
      </form>
      <${ErrorBanner} error=${error} />
      <${Table} rows=${rows} rowKey=${(f) => f.path} empty=${list ? 'Empty directory.' : 'Loading…'}
        rowProps=${(f) => ({ 'data-testid': 'file-row', 'data-path': f.path })}
        columns=${[
          { key: 'name', label: 'Name', className: 'mono', render: (f) => (f.type === 'dir' || (f.type === 'symlink' && f.link_type === 'dir')
            ? html`<button type="button" class="link mono" onClick=${() => go(f.path)}>${f.name}/</button>`
            : html`<span>${f.name}</span>${f.type === 'symlink' ? html` <span class="muted">→ ${f.link_target || '?'}</span>` : ''}`) },
          { key: 'type', label: 'Type' },
          { key: 'size', label: 'Size', className: 'num', render: (f) => (f.type === 'dir' ? '–' : fmtBytes(f.size)) },
          { key: 'mode', label: 'Mode', className: 'mono', render: (f) => `0${(f.mode & 0o7777).toString(8)}` },
          { key: 'mtime', label: 'Modified', className: 'num', render: (f) => fmtTime(f.mtime) },
          { key: 'dl', label: '', render: (f) => (f.type === 'file' || (f.type === 'symlink' && f.link_type === 'file')
            ? html`<a data-testid="file-download" href=${url(`${base(id)}/files`, { path: f.path })} download=${f.name}>download</a>` : '') },
        ]} />`}
  <//>`;
}

function Actions({ id, info, onDone, onError }) {
  const state = info ? info.state : null;
  const ended = !info || ENDED.has(state);
  const act = (fn) => async (extra) => onDone(await fn(extra));
  return html`<span class="page-actions">
    <${ConfirmButton} label="Pause" testid="action-pause" disabled=${state !== 'running'}
      message=${`Pause ${id}? Its processes stop until it is resumed.`}
      onConfirm=${act(() => post(`${base(id)}/pause`))} onError=${onError} />
    <${ConfirmButton} label="Resume" testid="action-resume" disabled=${state !== 'paused'}
      message=${`Resume ${id}?`} onConfirm=${act(() => post(`${base(id)}/resume`))} onError=${onError} />
    <${ConfirmButton} label="Snapshot" testid="action-snapshot" disabled=${ended || state === 'creating'}
      title="Snapshot" message="Save the sandbox's filesystem as a new image." initial=${{ name: '' }}
      renderExtra=${(x, set) => html`<label class="muted">image name<input data-testid="snapshot-name" value=${x.name}
        placeholder="name:tag" onInput=${(e) => set({ ...x, name: e.currentTarget.value })} /></label>`}
      onConfirm=${async (x) => {
        const reply = await post(`${base(id)}/snapshot`, { name: x.name.trim() });
        onDone(null, `Snapshot saved${reply && reply.name ? ` as ${reply.name}` : ''}.`);
      }} onError=${onError} />
    <${ConfirmButton} label="Kill" testid="action-kill" danger=${true} disabled=${ended}
      message=${`Kill ${id}? Its processes and files are gone for good.`}
      onConfirm=${act(() => del(base(id)))} onError=${onError} />
  </span>`;
}

export default function Sandbox({ params }) {
  const id = params.id;
  const [info, setInfo] = useState(null);
  const [error, setError] = useState(null);
  const [gone, setGone] = useState(false);
  const [notice, setNotice] = useState(null);
  const infoRef = useRef(null);
  infoRef.current = info;

  const poll = usePoll(async () => {
    try {
      const next = await get(base(id));
      setInfo(next);
      setGone(false);
      setError(null);
    } catch (e) {
      // A killed sandbox may vanish from the API: keep what we knew and show it ended.
      if (e instanceof ApiError && e.status === 404 && infoRef.current) {
        setGone(true);
        setInfo((old) => (old && !ENDED.has(old.state) ? { ...old, state: 'stopped' } : old));
      } else setError(e);
    }
  }, POLL_MS, [id]);

  const onDone = (next, message) => {
    if (next && next.id) setInfo(next);
    setNotice(message || null);
    poll();
  };
  const live = !!info && !ENDED.has(info.state);
  return html`<div>
    <${PageHeader} title=${html`<span class="mono" data-testid="sandbox-id">${id}</span>
      ${info && html` <${StateBadge} state=${info.state} testid="sandbox-state" />`}`}>
      <${Actions} id=${id} info=${info} onDone=${onDone} onError=${setError} />
    <//>
    <p><a href="#/sandboxes">← all sandboxes</a>${gone ? html` <span class="muted">· no longer known to the server</span>` : ''}</p>
    <${ErrorBanner} error=${error} onDismiss=${info ? () => setError(null) : null} />
    ${notice && html`<div class="notice">${notice}</div>`}
    ${info && html`
      <div class="grid">
        <${Info} info=${info} />
        <div>
          <${Limits} limits=${info.limits} />
          <${Usage} id=${id} info=${info} />
        </div>
        <${Timings} timings=${info.timings} />
      </div>
      <${LiveExecs} id=${id} live=${live} onGone=${poll} />
      <${Files} id=${id} live=${live} />`}
  </div>`;
}
