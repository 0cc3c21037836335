// The audit log (#/audit?sandbox=&tenant=&since=&method=&route=&status=): the API filters by sandbox,
// tenant (operator only) and time and answers the newest N before a time (`until`); method, route and
// status narrow each answer here. Newest first, a page at a time: "Older" asks the API for what precedes
// the oldest call shown, "Newer" goes back to a page already seen. Commands are the caller's text.
import { useRef, useState } from 'preact/hooks';
import { get } from '../api.js';
import { hashFor, navigate } from '../router.js';
import { ErrorBanner, PageHeader, Section, Table, fmtTime, html, useFetch } from '../ui/index.js';

const PAGE = 50;
const SEARCHED = 1000; // records asked for per page when method, route or status narrow them here
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

/**
 * One page from an answer of the API (newest first): the first `limit` records that match, plus any
 * further ones of the last one's microsecond (`until` is to the microsecond: none may be left behind).
 * `until` is where the next older page starts, null when the log holds nothing older.
 */
export function pageOf(records, f, limit, asked) {
  const rows = [];
  for (const r of records) {
    if (!matches(r, f)) continue;
    if (rows.length >= limit && r.time !== rows[rows.length - 1].time) {
      return { rows, until: rows[rows.length - 1].time };
    }
    rows.push(r);
  }
  // the whole answer was used: older records exist if it was full (it ends on a whole microsecond)
  const until = records.length >= asked ? records[records.length - 1].time : null;
  return { rows, until };
}

export default function Page({ params, caller }) {
  const f = {
    sandbox: params.sandbox || '',
    tenant: params.tenant || '',
    since: params.since || '',
    method: params.method || '',
    route: params.route || '',
    status: params.status || '',
  };
  const [draft, setDraft] = useState(f);
  // the pages before the one shown, newest first: their `until` (null: the newest) and what they held,
  // so that "Newer" shows what was seen, not the calls made since (reading this log is audited too)
  const [back, setBack] = useState([]);
  const [until, setUntil] = useState(null);
  const seen = useRef(new Map());
  const operator = !!(caller && caller.operator);
  const narrowed = !!(f.method || f.route || f.status);
  const asked = narrowed ? SEARCHED : PAGE;
  const query = { sandbox: f.sandbox, tenant: operator ? f.tenant : '', since: f.since, limit: asked };
  const key = JSON.stringify([query, f.method, f.route, f.status, until]);
  const { data, error, loading, reload } = useFetch(async () => {
    if (!seen.current.has(key)) {
      const answer = await get('/v1/audit', { ...query, until: until || '' });
      seen.current.set(key, pageOf(answer.records.slice().reverse(), f, PAGE, asked));
    }
    return seen.current.get(key);
  }, [key]);
  const rows = data ? data.rows : [];
  const toNewest = () => {
    seen.current.clear();
    setBack([]);
    setUntil(null);
  };
  const refresh = () => {
    const newest = until === null;
    toNewest();
    if (newest) reload();
  };
  const older = () => {
    setBack([until, ...back]);
    setUntil(data.until);
  };
  const newer = () => {
    setUntil(back[0]);
    setBack(back.slice(1));
  };
  const apply = (next) => {
    toNewest();
    navigate(hashFor('/audit', next), true);
  };
  const set = (field) => (e) => setDraft({ ...draft, [field]: e.currentTarget.value });
  const submit = (e) => {
    e.preventDefault();
    apply(draft);
  };
  const clear = () => {
    const empty = { sandbox: '', tenant: '', since: '', method: '', route: '', status: '' };
    setDraft(empty);
    apply(empty);
  };
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
      <button type="button" data-testid="audit-refresh" onClick=${refresh}>Refresh</button>
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
      <button type="submit" class="primary" data-testid="audit-filter-apply">Filter</button>
      <button type="button" data-testid="audit-filter-clear" onClick=${clear}>Clear</button>
    </form>
    <${ErrorBanner} error=${error} />
    <${Section}
      title=${html`<span data-testid="audit-count">${rows.length}</span> calls${until ? ` before ${fmtTime(until)}` : ', the newest'}${narrowed ? ` (matching, among ${asked} searched)` : ''}${operator ? '' : ' · your own'}`}
    >
      <${Table}
        testid="audit-table"
        columns=${columns}
        rows=${rows}
        rowKey=${(r) => `${r.time}|${r.route}|${r.method}|${r.sandbox}|${r.status}|${r.duration_ms}`}
        rowProps=${(r) => ({ 'data-testid': 'audit-row', 'data-time': r.time, 'data-route': r.route, 'data-method': r.method, 'data-sandbox': r.sandbox || '', 'data-status': r.status })}
        empty=${loading ? 'loading…' : data && data.until ? 'No audited call matches here: try older ones.' : 'No audited call matches.'}
      />
      <div class="pager">
        <button type="button" data-testid="page-prev" disabled=${back.length === 0 || loading} onClick=${newer}>‹ Newer</button>
        <span class="pager-pos" data-testid="audit-page">page ${back.length + 1}</span>
        <button type="button" data-testid="page-next" disabled=${!data || !data.until || loading} onClick=${older}>Older ›</button>
      </div>
    </${Section}>
  </div>`;
}
