// The fleet: capacity against the ratios, the admission queue, sandboxes by state/kind/tenant,
// warm pools, creations and failures over the last hour and, behind a gateway, the nodes.
import { useMemo, useRef, useState } from 'preact/hooks';
import { ApiError, get } from '../api.js';
import { hashFor } from '../router.js';
import {
  ChartView, ErrorBanner, fmtAgo, fmtBytes, fmtCores, fmtDuration, fmtPercent, html, PageHeader, PALETTE,
  Section, Table, usePoll,
} from '../ui/index.js';

const POLL_MS = 2000;
const STATES = ['creating', 'running', 'paused', 'stopping', 'stopped', 'failed', 'lost'];

/** One resource: requested (fill) and used (thin bar) against allocatable; the red mark is capacity. */
function Meter({ label, capacity, allocatable, requested, used, ratio, fmt }) {
  const top = Math.max(allocatable, requested, used, capacity, 1e-9);
  const pct = (x) => `${Math.min(100, (100 * x) / top).toFixed(2)}%`;
  return html`<div class="meter-row">
    <strong>${label}</strong>
    <div class="meter" title=${`allocatable ${fmt(allocatable)}`}>
      <div class="meter-fill requested" style=${{ width: pct(requested) }}></div>
      <div class="meter-fill used" style=${{ width: pct(used) }}></div>
      <div class="meter-mark" style=${{ left: pct(capacity) }}></div>
    </div>
    <div class="meter-legend">
      <span class="legend-swatch requested"></span>requested ${fmt(requested)} (${fmtPercent(allocatable ? requested / allocatable : 0)} of allocatable)
      <span class="legend-swatch used"></span>used ${fmt(used)} (${fmtPercent(capacity ? used / capacity : 0)} of capacity)
      <span class="legend-swatch limit"></span>capacity ${fmt(capacity)} × ratio ${ratio} = allocatable ${fmt(allocatable)}
    </div>
  </div>`;
}

function Capacity({ node }) {
  const r = (key) => ({
    capacity: node.capacity[key], allocatable: node.allocatable[key], requested: node.requested[key],
    used: node.used[key], ratio: node.ratios[key],
  });
  const starting = Object.values(node.starting || {}).reduce((a, b) => a + b, 0);
  return html`<${Section} title=${`Capacity · ${node.node}`} testid="fleet-capacity">
    <div class="stat-row">
      <div class="stat"><span class="v">${fmtCores(node.free.cpu)}</span><span class="k">CPU free to admit</span></div>
      <div class="stat"><span class="v">${fmtBytes(node.free.memory)}</span><span class="k">memory free to admit</span></div>
      <div class="stat"><span class="v">${node.queued}</span><span class="k">queued</span></div>
      <div class="stat"><span class="v">${starting}</span><span class="k">starting</span></div>
      <div class="stat"><span class="v">${fmtPercent(node.memory_pressure)}</span><span class="k">host memory in use</span></div>
      <div class="stat"><span class="v">${node.evictions}</span><span class="k">evictions</span></div>
    </div>
    <${Meter} label="CPU" ...${r('cpu')} fmt=${fmtCores} />
    <${Meter} label="Memory" ...${r('memory')} fmt=${fmtBytes} />
    ${Object.keys(node.unavailable || {}).length > 0 && html`<p class="muted">Unavailable kinds: ${Object.entries(node.unavailable).map(([k, why]) => `${k} (${why})`).join('; ')}</p>`}
  <//>`;
}

function Queues({ node }) {
  return html`<${Section} title="Admission queue" testid="fleet-queues">
    <${Table} rows=${node.queues || []} rowKey=${(q) => q.tenant} empty="Nobody is waiting."
      columns=${[
        { key: 'tenant', label: 'Tenant' },
        { key: 'waiting', label: 'Waiting', className: 'num' },
        { key: 'oldest_s', label: 'Oldest', className: 'num', render: (q) => fmtDuration(q.oldest_s) },
      ]} />
  <//>`;
}

function States({ node }) {
  const kinds = Object.keys(node.sandboxes || {}).sort();
  const present = STATES.filter((s) => kinds.some((k) => node.sandboxes[k][s]));
  const link = (query, n) => html`<a href=${hashFor('/sandboxes', query)}>${n}</a>`;
  const rows = kinds.map((kind) => ({ kind, counts: node.sandboxes[kind] }));
  return html`<${Section} title="Sandboxes" testid="fleet-states">
    <${Table} rows=${rows} rowKey=${(r) => r.kind} empty="No live sandboxes."
      columns=${[
        { key: 'kind', label: 'Kind', render: (r) => link({ kind: r.kind }, r.kind) },
        ...present.map((s) => ({
          key: s, label: s, className: 'num',
          render: (r) => (r.counts[s] ? link({ kind: r.kind, state: s }, r.counts[s]) : html`<span class="muted">0</span>`),
        })),
        { key: 'starting', label: 'starting', className: 'num', render: (r) => (node.starting || {})[r.kind] || 0 },
      ]} />
    ${node.owners && html`<h2 class="sub">By tenant</h2>
      <${Table} rows=${Object.entries(node.owners).sort((a, b) => b[1] - a[1])} rowKey=${(t) => t[0]} empty="No live sandboxes."
        columns=${[
          { key: 'name', label: 'Tenant', render: (t) => link({ owner: t[0] }, t[0]) },
          { key: 'live', label: 'Live', className: 'num', render: (t) => t[1] },
        ]} />`}
  <//>`;
}

function WarmPools({ pools }) {
  return html`<${Section} title="Warm pools" testid="fleet-warm-pools">
    <${Table} rows=${pools || []} rowKey=${(p) => p.name} empty="No warm pools."
      columns=${[
        { key: 'name', label: 'Pool' },
        { key: 'image', label: 'Image', render: (p) => (p.spec && p.spec.image) || '–' },
        { key: 'idle', label: 'Idle', className: 'num' },
        { key: 'filling', label: 'Filling', className: 'num' },
        { key: 'claims', label: 'Claims', className: 'num' },
        { key: 'misses', label: 'Misses', className: 'num' },
        { key: 'failures', label: 'Failures', className: 'num' },
      ]} />
  <//>`;
}

const HEALTH = { healthy: 'ok', starting: 'info', suspect: 'warn', lost: 'bad' };

function Nodes({ cluster }) {
  return html`<${Section} title="Nodes" testid="fleet-nodes">
    <${Table} rows=${cluster.nodes} rowKey=${(n) => n.name}
      columns=${[
        { key: 'name', label: 'Node' },
        { key: 'health', label: 'Health', render: (n) => html`<span class=${`badge ${HEALTH[n.health] || 'muted'}`}>${n.health}</span>${n.reason ? html` <span class="muted">${n.reason}</span>` : ''}` },
        { key: 'since', label: 'Since', render: (n) => fmtAgo(n.since) },
        { key: 'routed', label: 'Sandboxes', className: 'num' },
        { key: 'cpu', label: 'CPU req / alloc', className: 'num', render: (n) => (n.status ? `${fmtCores(n.status.requested.cpu)} / ${fmtCores(n.status.allocatable.cpu)}` : '–') },
        { key: 'mem', label: 'Memory req / alloc', className: 'num', render: (n) => (n.status ? `${fmtBytes(n.status.requested.memory)} / ${fmtBytes(n.status.allocatable.memory)}` : '–') },
        { key: 'queued', label: 'Queued', className: 'num', render: (n) => (n.status ? n.status.queued : '–') },
        { key: 'placed', label: 'Placed', className: 'num' },
        { key: 'refused', label: 'Refused', className: 'num' },
        { key: 'url', label: 'URL', className: 'mono' },
      ]} />
  <//>`;
}

function minuteLabel(at) {
  const d = new Date(at * 1000);
  return `${String(d.getHours()).padStart(2, '0')}:${String(d.getMinutes()).padStart(2, '0')}`;
}

/** Chart.js data for the history: creations per second per kind (lines), failures per reason (stacked bars). */
function historyCharts(history) {
  const buckets = (history && history.buckets) || [];
  const step = (history && history.step_s) || 60;
  const labels = buckets.map((b) => minuteLabel(b.at));
  const keys = (field) => [...new Set(buckets.flatMap((b) => Object.keys(b[field] || {})))].sort();
  const created = {
    labels,
    datasets: keys('created').map((kind, i) => ({
      label: kind, data: buckets.map((b) => ((b.created || {})[kind] || 0) / step),
      borderColor: PALETTE[i % PALETTE.length], backgroundColor: PALETTE[i % PALETTE.length], pointRadius: 0, borderWidth: 1.5, tension: 0.2,
    })),
  };
  const failed = {
    labels,
    datasets: keys('failed').map((reason, i) => ({
      label: reason, data: buckets.map((b) => (b.failed || {})[reason] || 0),
      backgroundColor: PALETTE[(i + 1) % PALETTE.length], stack: 'failed',
    })),
  };
  return { created, failed };
}

const CREATED_OPTIONS = {
  scales: { y: { beginAtZero: true, title: { display: true, text: 'creations / s' } }, x: { ticks: { maxTicksLimit: 12 } } },
  plugins: { legend: { position: 'bottom', labels: { boxWidth: 10 } } },
};
const FAILED_OPTIONS = {
  scales: { y: { beginAtZero: true, stacked: true, ticks: { precision: 0 }, title: { display: true, text: 'failures / min' } }, x: { stacked: true, ticks: { maxTicksLimit: 12 } } },
  plugins: { legend: { position: 'bottom', labels: { boxWidth: 10 } } },
};

export default function Fleet({ caller }) {
  const [node, setNode] = useState(null);
  const [history, setHistory] = useState(null);
  const [cluster, setCluster] = useState(null);
  const [error, setError] = useState(null);
  // Only a gateway's console asks for its nodes; stop asking for what a daemon says it lacks.
  const absent = useRef({ cluster: false, history: false });
  const historyAt = useRef(0);

  usePoll(async () => {
    const optional = (key, path) => (absent.current[key] ? Promise.resolve(null) : get(path).catch((e) => {
      if (e instanceof ApiError && (e.status === 404 || e.status === 405)) absent.current[key] = true;
      else throw e;
      return null;
    }));
    try {
      // The history moves once a minute: a fetch every 10 s is plenty.
      const wantHistory = Date.now() - historyAt.current > 10000;
      const [n, c, h] = await Promise.all([
        get('/v1/node'),
        caller && caller.cluster ? optional('cluster', '/v1/cluster') : Promise.resolve(null),
        wantHistory ? optional('history', '/v1/node/history') : Promise.resolve(undefined),
      ]);
      setNode(n);
      setCluster(c);
      if (h !== undefined) {
        historyAt.current = Date.now();
        setHistory(h);
      }
      setError(null);
    } catch (e) {
      setError(e);
    }
  }, POLL_MS);

  const charts = useMemo(() => historyCharts(history), [history]);
  const shown = cluster && cluster.total ? cluster.total : node;
  return html`<div>
    <${PageHeader} title="Fleet">
      ${node && html`<span class="muted">dsec ${node.version} · kinds ${node.kinds.join(', ')}</span>`}
    <//>
    <${ErrorBanner} error=${error} />
    ${!node && !error && html`<p class="muted">Loading…</p>`}
    ${shown && html`<${Capacity} node=${shown} />`}
    ${cluster && cluster.nodes && html`<${Nodes} cluster=${cluster} />`}
    <div class="grid">
      <${Section} title="Creations per second (last hour)">
        <${ChartView} type="line" data=${charts.created} options=${CREATED_OPTIONS} testid="fleet-chart-created" />
        ${absent.current.history && html`<p class="muted">This server keeps no history.</p>`}
      <//>
      <${Section} title="Failures by reason (last hour)">
        <${ChartView} type="bar" data=${charts.failed} options=${FAILED_OPTIONS} testid="fleet-chart-failed" />
      <//>
    </div>
    ${shown && html`<div class="grid">
      <${States} node=${shown} />
      <${Queues} node=${shown} />
    </div>
    <${WarmPools} pools=${shown.warm_pools} />`}
  </div>`;
}
