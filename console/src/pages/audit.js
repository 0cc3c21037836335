// The audit log (#/audit?sandbox=&tenant=&since=&method=&route=&status=&window=): the API filters by
// sandbox, tenant (operator only) and time and answers the newest N; method, route and status narrow
// those N here. Newest first, paged. Commands are the caller's text: shown as text.
import { useState } from 'preact/hooks';
import { get } from '../api.js';
import { hashFor, navigate } from '../router.js';
import { ErrorBanner, PageHeader, Pager, Section, Table, fmtTime, html, useFetch } from '../ui/index.js';

const PAGE = 50;
const WINDOWS = [100, 1000, 10000];
const METHODS = ['GET', 'POST', 'PUT', 'PATCH', 'DELETE'];
const STATUSES = { ok: [200, 399], '4xx': [400, 499], '5xx': [500, 599], refused: [401, 403] };

const statusBadge = (s) => (s >= 500 ? 'bad' : s >= 400 ? 'warn' : 'ok');

/** A datetime-local value ("2025-01-02T10:30") for an ISO time, in local time; '' if none. */
function toLocalInput(iso) {
  const d = iso ? new Date(iso) : null;
  if (!d || Number.isNaN(d.getTime())) return '';
  const p = (x) => String(x).padStart(2, '0');
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())}T${p(d.getHours())}:${p(d.getMinutes())}`;
}

export function matches(rec, { method, route, status }) {
  if (method && rec.method !== method) return false;
  if (route && !rec.route.toLowerCase().includes(route.toLowerCase())) return false;
  if (status && STATUSES[status]) {
    const [lo, hi] = STATUSES[status];
    if (rec.status < lo || rec.status > hi) return false;
  }
  return true;
}

export default function Page({ params, caller }) {
  const f = {
    sandbox: params.sandbox || '',
    tenant: params.tenant || '',
    since: params.since || '',
    method: params.method || '',
    route: params.route || '',
    status: params.status || '',
    window: WINDOWS.includes(Number(params.window)) ? Number(params.window) : 1000,
  };
  const [draft, setDraft] = useState(f);
  const [offset, setOffset] = useState(0);
  const operator = !!(caller && caller.operator);
  const { data, error, loading, reload } = useFetch(
    () =>
      get('/v1/audit', {
        sandbox: f.sandbox,
        tenant: operator ? f.tenant : '',
        since: f.since,
        limit: f.window,
      }),
    [f.sandbox, f.tenant, f.since, f.window],
  );
  const all = data ? data.records.slice().reverse() : [];
  const rows = all.filter((r) => matches(r, f));
  const apply = (next) => {
    setOffset(0);
    navigate(hashFor('/audit', { ...next, window: next.window === 1000 ? '' : next.window }), true);
  };
  const set = (key) => (e) => setDraft({ ...draft, [key]: e.currentTarget.value });
  const submit = (e) => {
    e.preventDefault();
    apply(draft);
  };
  const clear = () => {
    const empty = { sandbox: '', tenant: '', since: '', method: '', route: '', status: '', window: 1000 };
    setDraft(empty);
    apply(empty);
  };
  const page = rows.slice(offset, offset + PAGE);
  const columns = [
    { key: 'time', label: 'time', className: 'nowrap', render: (r) => html`<span title=${r.time}>${fmtTime(r.time)}</span>` },
    { key: 'tenant', label: 'tenant', render: (r) => (r.tenant === null ? html`<span class="badge bad">unknown</span>` : r.tenant) },
    { key: 'method', label: 'method' },
    { key: 'route', label: 'route', className: 'mono' },
    {
      key: 'sandbox',
      label: 'sandbox',
      className: 'mono nowrap',
      render: (r) => (r.sandbox ? html`<a href=${`#/sandboxes/${encodeURIComponent(r.sandbox)}`}>${r.sandbox}</a>` : '–'),
    },
    { key: 'status', label: 'status', className: 'num', render: (r) => html`<span class=${`badge ${statusBadge(r.status)}`}>${r.status}</span>` },
    { key: 'duration_ms', label: 'ms', className: 'num', render: (r) => r.duration_ms.toFixed(1) },
    { key: 'command', label: 'command', className: 'mono', render: (r) => r.command || '' },
  ];
  return html`<div class="page audit">
    <${PageHeader} title="Audit">
      <button type="button" data-testid="audit-refresh" onClick=${reload}>Refresh</button>
    </${PageHeader}>
    <form class="filters" onSubmit=${submit} data-testid="audit-filters">
      <label>sandbox<input data-testid="audit-filter-sandbox" value=${draft.sandbox} maxlength="64" onInput=${set('sandbox')} /></label>
      ${operator
        ? html`<label>tenant<input data-testid="audit-filter-tenant" value=${draft.tenant} maxlength="63" onInput=${set('tenant')} /></label>`
        : null}
      <label>since
        <input
          type="datetime-local"
          data-testid="audit-filter-since"
          value=${toLocalInput(draft.since)}
          onInput=${(e) => {
            const v = e.currentTarget.value;
            const d = v ? new Date(v) : null;
            setDraft({ ...draft, since: d && !Number.isNaN(d.getTime()) ? d.toISOString() : '' });
          }}
        />
      </label>
      <label>method
        <select data-testid="audit-filter-method" value=${draft.method} onChange=${set('method')}>
          <option value="">any</option>
          ${METHODS.map((m) => html`<option key=${m} value=${m}>${m}</option>`)}
        </select>
      </label>
      <label>route contains<input data-testid="audit-filter-route" value=${draft.route} placeholder="/exec" onInput=${set('route')} /></label>
      <label>status
        <select data-testid="audit-filter-status" value=${draft.status} onChange=${set('status')}>
          <option value="">any</option>
          <option value="ok">2xx/3xx</option>
          <option value="4xx">4xx</option>
          <option value="refused">401/403</option>
          <option value="5xx">5xx</option>
        </select>
      </label>
      <label>search the newest
        <select data-testid="audit-filter-window" value=${String(draft.window)} onChange=${(e) => setDraft({ ...draft, window: Number(e.currentTarget.value) })}>
          ${WINDOWS.map((w) => html`<option key=${w} value=${String(w)}>${w}</option>`)}
        </select>
      </label>
      <button type="submit" class="primary" data-testid="audit-filter-apply">Filter</button>
      <button type="button" data-testid="audit-filter-clear" onClick=${clear}>Clear</button>
    </form>
    <${ErrorBanner} error=${error} />
    <${Section}
      title=${html`<span data-testid="audit-count">${rows.length}</span> calls${all.length === f.window ? ` (among the newest ${f.window})` : ''}${operator ? '' : ' · your own'}`}
    >
      <${Table}
        testid="audit-table"
        columns=${columns}
        rows=${page}
        rowKey=${(r) => `${r.time}|${r.route}|${r.method}|${r.sandbox}|${r.status}|${r.duration_ms}`}
        rowProps=${(r) => ({ 'data-testid': 'audit-row', 'data-route': r.route, 'data-method': r.method, 'data-sandbox': r.sandbox || '', 'data-status': r.status })}
        empty=${loading ? 'loading…' : 'No audited call matches.'}
      />
      <${Pager} offset=${offset} limit=${PAGE} total=${rows.length} onChange=${setOffset} />
    </${Section}>
  </div>`;
}
