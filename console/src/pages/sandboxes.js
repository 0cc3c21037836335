// The sandbox list: filters in the hash, paged on the server (one page in the DOM), polled so new
// sandboxes appear without a reload.
import { useEffect, useRef, useState } from 'preact/hooks';
import { get } from '../api.js';
import { hashFor, navigate, sandboxHash } from '../router.js';
import {
  ErrorBanner, fmtAgo, html, Labels, PageHeader, Pager, Section, StateBadge, Table, usePoll,
} from '../ui/index.js';

const POLL_MS = 2000;
const PAGE = 50;
const STATES = ['', 'creating', 'running', 'paused', 'stopping', 'stopped', 'failed', 'lost'];
const TEXT_FILTERS = ['kind', 'image', 'owner', 'label'];
// the API lists live sandboxes unless asked for the finished ones too: asking for an ended state asks for them
const ENDED = ['stopped', 'failed', 'lost'];

function filtersFrom(params) {
  return {
    state: params.state || '', kind: params.kind || '', image: params.image || '', owner: params.owner || '',
    label: params.label || '',
  };
}

/** The page of sandboxes; a server without paging (no "total") is paged here instead. */
async function loadPage(filters, offset) {
  const query = { ...filters, limit: PAGE, offset, all: ENDED.includes(filters.state) ? 'true' : '' };
  const reply = await get('/v1/sandboxes', query);
  const all = reply.sandboxes || [];
  if (typeof reply.total === 'number') return { rows: all, total: reply.total };
  return { rows: all.slice(offset, offset + PAGE), total: all.length };
}

export default function Sandboxes({ params, caller }) {
  const applied = filtersFrom(params);
  const [draft, setDraft] = useState(applied);
  const [offset, setOffset] = useState(Number(params.offset) > 0 ? Number(params.offset) : 0);
  const [page, setPage] = useState(null);
  const [error, setError] = useState(null);
  const debounce = useRef(null);
  const key = JSON.stringify(applied);

  // The hash changed from outside (a link, back button): show its filters in the inputs.
  useEffect(() => {
    setDraft(applied);
  }, [key]);
  useEffect(() => () => clearTimeout(debounce.current), []);

  const apply = (next, delay) => {
    setDraft(next);
    clearTimeout(debounce.current);
    debounce.current = setTimeout(() => {
      setOffset(0);
      navigate(hashFor('/sandboxes', next), true);
    }, delay);
  };

  const poll = usePoll(async () => {
    try {
      const result = await loadPage(applied, offset);
      // A page emptied by kills: step back to the last page that has rows.
      if (result.rows.length === 0 && offset > 0 && result.total > 0) {
        setOffset(Math.max(0, Math.floor((result.total - 1) / PAGE) * PAGE));
        return;
      }
      setPage(result);
      setError(null);
    } catch (e) {
      setError(e);
    }
  }, POLL_MS, [key, offset]);

  const columns = [
    { key: 'id', label: 'Sandbox', className: 'mono', render: (s) => html`<a href=${sandboxHash(s.id)}>${s.id}</a>` },
    { key: 'state', label: 'State', render: (s) => html`<${StateBadge} state=${s.state} />${s.reason ? html` <span class="muted">${s.reason}</span>` : ''}` },
    { key: 'kind', label: 'Kind' },
    { key: 'image', label: 'Image', className: 'mono' },
    caller && caller.operator ? { key: 'owner', label: 'Tenant', render: (s) => s.owner || html`<span class="muted">operator</span>` } : null,
    { key: 'labels', label: 'Labels', render: (s) => html`<${Labels} labels=${s.labels} />` },
    { key: 'created_at', label: 'Created', className: 'num', render: (s) => fmtAgo(s.created_at) },
    { key: 'node', label: 'Node', render: (s) => s.node || '–' },
  ].filter(Boolean);

  const input = (name, placeholder) => html`<label>${name === 'owner' ? 'tenant' : name}
    <input data-testid=${`sandbox-filter-${name}`} value=${draft[name]} placeholder=${placeholder} spellcheck="false"
      onInput=${(e) => apply({ ...draft, [name]: e.currentTarget.value.trim() }, 350)} /></label>`;

  return html`<div>
    <${PageHeader} title="Sandboxes">
      <span class="muted" data-testid="sandbox-total">${page ? `${page.total} sandbox${page.total === 1 ? '' : 'es'}` : '…'}</span>
      <button type="button" onClick=${poll}>Refresh</button>
    <//>
    <${ErrorBanner} error=${error} />
    <${Section}>
      <div class="filters">
        <label>state
          <select data-testid="sandbox-filter-state" value=${draft.state}
            onChange=${(e) => apply({ ...draft, state: e.currentTarget.value }, 0)}>
            ${STATES.map((s) => html`<option key=${s} value=${s}>${s || 'any'}</option>`)}
          </select></label>
        ${input('kind', 'container')}
        ${input('image', 'name:tag')}
        ${caller && caller.operator && input('owner', 'tenant name')}
        ${input('label', 'key=value')}
        ${TEXT_FILTERS.some((f) => draft[f]) || draft.state ? html`<button type="button" class="link"
          onClick=${() => apply(filtersFrom({}), 0)}>clear</button>` : ''}
      </div>
      <${Table} columns=${columns} rows=${page ? page.rows : []} rowKey=${(s) => s.id}
        empty=${page ? 'No sandboxes match.' : 'Loading…'}
        rowProps=${(s) => ({ 'data-testid': 'sandbox-row', 'data-id': s.id, class: 'clickable',
          onClick: (e) => { if (!e.target.closest('a')) navigate(sandboxHash(s.id)); } })} />
      ${page && html`<${Pager} offset=${offset} limit=${PAGE} total=${page.total} onChange=${setOffset} />`}
    <//>
  </div>`;
}
