// Tables, key/value lists, the pager and the state badge.
import { html } from 'htm/preact';

/**
 * columns: [{key, label, render?(row), className?}]; rows: array; rowKey(row) -> key;
 * rowProps(row) -> extra attributes for the <tr> (data-testid, data-id, onClick, class).
 */
export function Table({ columns, rows, rowKey, rowProps, empty = 'Nothing here.', testid, className = '' }) {
  return html`<table class=${`table ${className}`} data-testid=${testid}>
    <thead><tr>${columns.map((c) => html`<th key=${c.key} class=${c.className || ''}>${c.label}</th>`)}</tr></thead>
    <tbody>
      ${rows && rows.length
        ? rows.map((row, i) => html`<tr key=${rowKey ? rowKey(row) : i} ...${rowProps ? rowProps(row) : {}}>
            ${columns.map((c) => html`<td key=${c.key} class=${c.className || ''}>${c.render ? c.render(row) : fmtCell(row[c.key])}</td>`)}
          </tr>`)
        : html`<tr><td class="empty" colspan=${columns.length}>${empty}</td></tr>`}
    </tbody>
  </table>`;
}

function fmtCell(v) {
  if (v === null || v === undefined) return '–';
  if (typeof v === 'object') return JSON.stringify(v);
  return String(v);
}

/** rows: [[label, value], ...]; values are rendered as given (text or vnodes). */
export function KV({ rows, testid }) {
  return html`<dl class="kv" data-testid=${testid}>
    ${rows.filter(Boolean).map(([k, v]) => html`<dt key=${`k-${k}`}>${k}</dt><dd key=${`v-${k}`}>${v === null || v === undefined || v === '' ? '–' : v}</dd>`)}
  </dl>`;
}

/** offset/limit/total paging (page-prev / page-next); onChange(newOffset). */
export function Pager({ offset, limit, total, onChange }) {
  const first = total === 0 ? 0 : offset + 1;
  const last = Math.min(offset + limit, total);
  return html`<div class="pager">
    <button type="button" data-testid="page-prev" disabled=${offset <= 0} onClick=${() => onChange(Math.max(0, offset - limit))}>‹ Prev</button>
    <span class="pager-pos">${first}–${last} of ${total}</span>
    <button type="button" data-testid="page-next" disabled=${offset + limit >= total} onClick=${() => onChange(offset + limit)}>Next ›</button>
  </div>`;
}

const STATE_CLASS = {
  running: 'ok', creating: 'info', paused: 'warn', stopping: 'warn', stopped: 'muted', failed: 'bad', lost: 'bad',
};

export function StateBadge({ state, testid }) {
  return html`<span class=${`badge ${STATE_CLASS[state] || 'muted'}`} data-testid=${testid}>${state || '–'}</span>`;
}

/** Labels {k: v} as small chips (text only). */
export function Labels({ labels }) {
  const entries = Object.entries(labels || {});
  if (!entries.length) return html`<span class="muted">–</span>`;
  return html`<span class="chips">${entries.map(([k, v]) => html`<span key=${k} class="chip">${k}=${v}</span>`)}</span>`;
}
