// The trajectories under a prefix (#/trajectories?prefix=job-17/), most recently written first; each
// row opens the viewer, and two ticked rows open side by side.
import { useEffect, useState } from 'preact/hooks';
import { get } from '../api.js';
import { hashFor, navigate } from '../router.js';
import { ErrorBanner, PageHeader, Section, Table, fmtAgo, fmtTime, html, useFetch } from '../ui/index.js';
import { viewHash } from './trajectory.js';

const LIMIT = 1000;

export const compareHash = (a, b) => hashFor('/trajectories/compare', { a, b });

export default function Page({ params }) {
  const prefix = params.prefix || '';
  const [typed, setTyped] = useState(prefix);
  const [picked, setPicked] = useState([]);
  useEffect(() => setTyped(prefix), [prefix]);
  const { data, error, loading, reload } = useFetch(() => get('/v1/trajectories', { prefix, limit: LIMIT }), [prefix], 10000);
  const rows = data ? data.trajectories : [];

  const submit = (e) => {
    e.preventDefault();
    navigate(hashFor('/trajectories', { prefix: typed }));
  };
  const toggle = (id) =>
    setPicked((p) => (p.includes(id) ? p.filter((x) => x !== id) : [...p.slice(-1), id])); // keep the last two
  const columns = [
    {
      key: 'pick',
      label: 'compare',
      render: (t) => html`<input
        type="checkbox"
        aria-label=${`compare ${t.id}`}
        data-testid="trajectory-pick"
        checked=${picked.includes(t.id)}
        onClick=${(e) => e.stopPropagation()}
        onChange=${() => toggle(t.id)}
      />`,
    },
    { key: 'id', label: 'id', className: 'mono', render: (t) => html`<a href=${viewHash(t.id)} data-testid="trajectory-link">${t.id}</a>` },
    { key: 'length', label: 'calls', className: 'num' },
    { key: 'sandbox_id', label: 'sandbox', className: 'mono', render: (t) => html`<a href=${`#/sandboxes/${encodeURIComponent(t.sandbox_id)}`}>${t.sandbox_id}</a>` },
    { key: 'kind', label: 'kind' },
    { key: 'image', label: 'image', className: 'mono' },
    { key: 'rebuilds', label: 'rebuilds', className: 'num' },
    { key: 'closed', label: 'closed', render: (t) => (t.closed ? html`<span class="badge muted">closed</span>` : '') },
    { key: 'updated_at', label: 'updated', render: (t) => html`<span title=${fmtTime(t.updated_at)}>${fmtAgo(t.updated_at)}</span>` },
  ];
  return html`<div class="page trajectories">
    <${PageHeader} title="Trajectories">
      <button
        type="button"
        class="primary"
        data-testid="trajectory-compare"
        disabled=${picked.length !== 2}
        title="Tick two trajectories to see them side by side"
        onClick=${() => navigate(compareHash(picked[0], picked[1]))}
      >
        Compare ${picked.length}/2
      </button>
    </${PageHeader}>
    <form class="filters" onSubmit=${submit}>
      <label>id prefix
        <input
          data-testid="trajectory-prefix"
          value=${typed}
          placeholder="job-17/"
          maxlength="200"
          onInput=${(e) => setTyped(e.currentTarget.value)}
        />
      </label>
      <button type="submit" data-testid="trajectory-search">Show</button>
      ${prefix ? html`<button type="button" onClick=${() => navigate('#/trajectories')}>All</button>` : null}
      <button type="button" onClick=${reload}>Refresh</button>
    </form>
    <${ErrorBanner} error=${error} />
    <${Section} title=${`${rows.length}${rows.length === LIMIT ? '+' : ''} trajectories${prefix ? ` under “${prefix}”` : ''}`}>
      <${Table}
        testid="trajectory-table"
        columns=${columns}
        rows=${rows}
        rowKey=${(t) => t.id}
        rowProps=${(t) => ({ 'data-testid': 'trajectory-row', 'data-id': t.id, class: picked.includes(t.id) ? 'picked' : '' })}
        empty=${loading ? 'loading…' : 'No trajectory here. A sandbox created with trajectory="…" records one.'}
      />
    </${Section}>
  </div>`;
}
