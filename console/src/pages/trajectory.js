// One trajectory: its calls in order (op, arguments, exit code, outputs, duration, notes), a timeline,
// the grade, and an export as JSONL. Everything in a call came from a sandbox: it goes in as text only.
import { html } from 'htm/preact';
import { useMemo, useState } from 'preact/hooks';
import { get } from '../api.js';
import { hashFor, sandboxHash } from '../router.js';
import { Collapsible, ErrorBanner, KV, PageHeader, Section, fmtBytes, fmtTime, useFetch } from '../ui/index.js';

const PAGE = 1000; // calls asked for per request (the API allows 5,000, and caps a page at 8 MiB)
const SHOWN = 300; // call rows rendered at first; the rest on demand
const FILE_OPS = new Set(['write', 'read', 'list', 'stat', 'mkdir', 'remove', 'move', 'upload', 'download']);
export const LANES = ['create', 'exec', 'files', 'grade', 'other'];
const LANE_FILL = { create: '#6b7280', exec: '#2563eb', files: '#0d9488', grade: '#9333ea', other: '#b45309' };
const STATUS_BADGE = { done: 'ok', error: 'bad', interrupted: 'warn', running: 'info' };
const STATUS_FILL = { error: '#dc2626', interrupted: '#ea580c', running: '#a3a3a3' };

/** Every recorded call of a trajectory, in order (the API pages them; ``next`` is where to go on). */
export async function loadCalls(id) {
  const calls = [];
  let start = 0;
  for (;;) {
    const page = await get('/v1/trajectories/calls', { id, start, limit: PAGE });
    calls.push(...page.calls);
    if (page.next === null || page.next === undefined || page.calls.length === 0) return calls;
    start = page.next;
  }
}

/** The trajectory's info and calls together. */
export async function loadTrajectory(id) {
  const [info, calls] = await Promise.all([get('/v1/trajectories/info', { id }), loadCalls(id)]);
  return { info, calls };
}

export const viewHash = (id) => hashFor('/trajectories/view', { id });

/** The last completed grade call: {score 1|0, exit, call}; null when the trajectory was not graded. */
export function gradeOf(calls) {
  for (let i = calls.length - 1; i >= 0; i -= 1) {
    const c = calls[i];
    if (c.op !== 'grade' || c.status !== 'done' || !c.result || !c.result.result) continue;
    const r = c.result.result;
    return { score: r.exit_code === 0 ? 1 : 0, exit: r.exit_code, signal: r.signal, call: c };
  }
  return null;
}

/** What a call did, on one line: an exec's command, a file call's path, else its parameters. */
export function callWhat(c) {
  const req = c.request || {};
  if (c.op === 'exec' || c.op === 'grade') {
    const cmd = req.cmd;
    return Array.isArray(cmd) ? cmd.map(String).join(' ') : String(cmd === undefined ? '' : cmd);
  }
  if (c.op === 'create') return String(req.image || '');
  if (c.op === 'snapshot') return String(req.name || '');
  if (typeof req.path === 'string') return req.path;
  const text = JSON.stringify(req);
  return text === '{}' ? '' : text;
}

/** The exec-like result of a call: an exec's own, a grade's command result; null for other ops. */
export function execResult(c) {
  if (!c.result) return null;
  if (c.op === 'exec') return c.result.error ? null : c.result;
  if (c.op === 'grade' && c.result.result) return c.result.result;
  return null;
}

export function callError(c) {
  return c.result && c.result.error ? c.result.error : null;
}

export function exitOf(c) {
  const r = execResult(c);
  if (!r) return null;
  if (r.exit_code !== null && r.exit_code !== undefined) return r.exit_code;
  return r.signal ? `signal ${r.signal}` : null;
}

/** "live" (ran once), "replayed ×N" (the daemon answered its position again from the log N times:
 * RecordedCall.replays; at #0, the resumes), or "running". */
export function modeOf(c) {
  if (typeof c.replays === 'number' && c.replays > 0) return `replayed ×${c.replays}`;
  return c.status === 'running' ? 'running' : 'live';
}

/** The mode's tooltip: when the call was last answered from the log. */
export function modeTitle(c) {
  return c.replayed_at ? `ran ${fmtTime(c.started_at)}; last answered from the log ${fmtTime(c.replayed_at)}` : '';
}

export const laneOf = (op) => (LANES.includes(op) ? op : FILE_OPS.has(op) ? 'files' : 'other');

const isoUtc = (s) => (typeof s === 'string' && s.endsWith('Z') ? `${s.slice(0, -1)}+00:00` : s);

function decodeBytes(b64) {
  const raw = atob(b64);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i += 1) bytes[i] = raw.charCodeAt(i);
  try {
    return { text: new TextDecoder('utf-8', { fatal: true, ignoreBOM: true }).decode(bytes) };
  } catch (_) {
    return { text: null, size: bytes.length };
  }
}

/** A call as `dsec trajectory export --jsonl` writes it: flat, the exec fields at the top level. */
export function trainingRecord(trajectoryId, c) {
  const out = {
    trajectory: trajectoryId,
    seq: c.seq,
    op: c.op,
    status: c.status,
    request: c.request,
    started_at: isoUtc(c.started_at),
    duration_ms: c.duration_ms === undefined ? null : c.duration_ms,
  };
  const result = c.result || {};
  if (c.op === 'exec' && c.status === 'done') {
    out.command = c.request ? c.request.cmd : undefined;
    for (const key of ['exit_code', 'signal', 'stdout', 'stderr', 'truncated', 'timed_out', 'oom_killed']) {
      out[key] = key in result ? result[key] : null;
    }
  } else if ('error' in result) {
    out.error = result.error;
  } else if (Object.keys(result).length) {
    out.result = result;
  }
  if (c.result_bytes !== null && c.result_bytes !== undefined) {
    const decoded = decodeBytes(c.result_bytes);
    if (decoded.text !== null) {
      out.output = decoded.text;
    } else {
      out.output = c.result_bytes;
      out.output_encoding = 'base64';
    }
  }
  if (c.note) out.note = c.note;
  return out;
}

export function toJsonl(trajectoryId, calls) {
  return calls.map((c) => `${JSON.stringify(trainingRecord(trajectoryId, c))}\n`).join('');
}

/** Saves text as a file: a Blob behind an object URL, clicked through a detached link. */
function download(name, text) {
  const href = URL.createObjectURL(new Blob([text], { type: 'application/x-ndjson' }));
  const a = document.createElement('a');
  a.href = href;
  a.download = name;
  a.rel = 'noopener';
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(href), 30000);
}

export const exportName = (id) => `${id.replace(/[^A-Za-z0-9._-]+/g, '_')}.jsonl`;

const ms = (v) => (v === null || v === undefined ? '–' : v >= 1000 ? `${(v / 1000).toFixed(2)} s` : `${v.toFixed(1)} ms`);

/** The parameters without their empty defaults, on one line when short. */
export function argsText(req) {
  const kept = {};
  for (const [k, v] of Object.entries(req || {})) {
    if (v === null || v === undefined || v === '' || (typeof v === 'object' && !Array.isArray(v) && !Object.keys(v).length)) continue;
    kept[k] = v;
  }
  const line = JSON.stringify(kept);
  return line.length <= 140 ? line : JSON.stringify(kept, null, 2);
}

function Stream({ name, text, total, truncated }) {
  const kept = new TextEncoder().encode(text || '').length;
  const size = total === undefined ? kept : Math.max(total, kept);
  const cut = !!truncated && size > kept;
  return html`<${Collapsible}
    title=${cut ? `${name} · ${fmtBytes(kept)} of ${fmtBytes(size)} kept` : `${name} · ${fmtBytes(size)}`}
    text=${text || ''}
    testid=${`call-${name}`}
    truncated=${cut}
    truncatedTestid="call-truncated"
    className=${name === 'stderr' ? 'stderr' : ''}
  />`;
}

/** The body of a call: its arguments, outputs, error, bytes returned, note. */
export function CallDetail({ c }) {
  const r = execResult(c);
  const err = callError(c);
  const out = c.result_bytes ? decodeBytes(c.result_bytes) : null;
  return html`<div class="call-detail">
    <${Collapsible} title="arguments" text=${argsText(c.request)} testid="call-args" maxLines=${8} />
    ${r && (r.stdout || r.stdout_bytes) ? html`<${Stream} name="stdout" text=${r.stdout} total=${r.stdout_bytes} truncated=${r.truncated} />` : null}
    ${r && (r.stderr || r.stderr_bytes) ? html`<${Stream} name="stderr" text=${r.stderr} total=${r.stderr_bytes} truncated=${r.truncated} />` : null}
    ${r && !r.stdout && !r.stderr && !r.stdout_bytes && !r.stderr_bytes ? html`<div class="muted">no output</div>` : null}
    ${r && (r.timed_out || r.oom_killed || r.idle_timed_out)
      ? html`<div><span class="badge warn">${r.oom_killed ? 'out of memory' : r.idle_timed_out ? 'idle timeout' : 'timed out'}</span></div>`
      : null}
    ${err ? html`<div class="call-error" data-testid="call-error">${String(err.code || 'error')}: ${String(err.message || '')}</div>` : null}
    ${out
      ? html`<${Collapsible}
          title=${out.text === null ? `output · ${fmtBytes(out.size)}, binary (not shown; export it)` : `output · ${fmtBytes(new TextEncoder().encode(out.text).length)}`}
          text=${out.text === null ? '' : out.text}
          testid="call-output"
        />`
      : null}
    ${c.payload_bytes ? html`<div class="muted">sent ${fmtBytes(c.payload_bytes)}</div>` : null}
    ${c.result && !r && !err && c.op !== 'exec'
      ? html`<${Collapsible} title="result" text=${JSON.stringify(c.result, null, 2)} testid="call-result" maxLines=${8} />`
      : null}
  </div>`;
}

function CallRow({ c, open, selected, onSelect }) {
  const [expanded, setExpanded] = useState(open);
  const exit = exitOf(c);
  const mode = modeOf(c);
  const what = callWhat(c);
  const toggle = () => {
    setExpanded(!expanded);
    onSelect(c.seq);
  };
  return html`<li
    class=${`call-row status-${c.status}${selected ? ' selected' : ''}${expanded ? ' expanded' : ''}`}
    id=${`call-${c.seq}`}
    data-testid="call-row"
    data-seq=${c.seq}
    data-op=${c.op}
  >
    <button type="button" class="call-head" data-testid="call-toggle" aria-expanded=${expanded ? 'true' : 'false'} onClick=${toggle}>
      <span class="call-seq">#${c.seq}</span>
      <span class=${`badge op op-${laneOf(c.op)}`} data-testid="call-op">${c.op}</span>
      <code class="call-what" title=${what}>${what.slice(0, 200)}</code>
      <span class=${`badge ${STATUS_BADGE[c.status] || 'muted'}`} data-testid="call-status">${c.status}</span>
      <span class=${exit === 0 ? 'exit ok' : exit === null ? 'exit' : 'exit bad'} data-testid="call-exit">${exit === null ? '' : `exit ${exit}`}</span>
      <span class="call-ms" data-testid="call-duration">${ms(c.duration_ms)}</span>
      <span class=${`badge ${mode === 'live' ? 'muted' : 'info'}`} data-testid="call-mode" data-replays=${c.replays || 0} title=${modeTitle(c)}>${mode}</span>
    </button>
    ${c.note ? html`<div class="call-note" data-testid="call-note">note: ${c.note}</div>` : null}
    ${expanded ? html`<${CallDetail} c=${c} />` : null}
  </li>`;
}

/** The calls as bars over time, one lane per kind of op; a bar's title tells the call. */
export function Timeline({ calls, selected, onSelect }) {
  const layout = useMemo(() => {
    const t = calls.map((c) => Date.parse(c.started_at));
    const t0 = t.reduce((a, b) => Math.min(a, b), Infinity); // no spread: a log may hold 100,000 calls
    let t1 = t0 + 1;
    calls.forEach((c, i) => {
      t1 = Math.max(t1, t[i] + (c.duration_ms || 0));
    });
    return { t, t0, span: t1 - t0 };
  }, [calls]);
  if (!calls.length) return html`<div class="muted" data-testid="trajectory-timeline">no calls</div>`;
  const W = 1000;
  const L = 70;
  const laneH = 22;
  const H = LANES.length * laneH + 24;
  const x = (ms) => L + (ms / layout.span) * (W - L - 10);
  const ticks = [0, 0.25, 0.5, 0.75, 1].map((f) => f * layout.span);
  return html`<svg
    class="timeline"
    data-testid="trajectory-timeline"
    viewBox=${`0 0 ${W} ${H}`}
    width="100%"
    role="img"
    aria-label="calls over time"
  >
    ${LANES.map(
      (lane, i) => html`<g key=${lane}>
        <rect x="0" y=${i * laneH} width=${W} height=${laneH} fill=${i % 2 ? '#f8fafc' : '#f1f5f9'} />
        <text x="6" y=${i * laneH + 15} font-size="12" fill="#334155">${lane}</text>
      </g>`,
    )}
    ${ticks.map(
      (v) => html`<g key=${`t${v}`}>
        <line x1=${x(v)} x2=${x(v)} y1="0" y2=${LANES.length * laneH} stroke="#cbd5e1" stroke-width="1" />
        <text x=${Math.min(x(v), W - 40)} y=${H - 6} font-size="11" fill="#475569">${(v / 1000).toFixed(v < 10000 ? 2 : 1)} s</text>
      </g>`,
    )}
    ${calls.map((c, i) => {
      const lane = LANES.indexOf(laneOf(c.op));
      const start = layout.t[i] - layout.t0;
      const w = Math.max(2, x(start + (c.duration_ms || 0)) - x(start));
      const fill = STATUS_FILL[c.status] || LANE_FILL[laneOf(c.op)];
      return html`<rect
        key=${c.seq}
        data-testid="timeline-bar"
        data-seq=${c.seq}
        x=${x(start)}
        y=${lane * laneH + 3}
        width=${w}
        height=${laneH - 6}
        rx="2"
        fill=${fill}
        stroke=${selected === c.seq ? '#111827' : 'none'}
        stroke-width="2"
        class="timeline-bar"
        onClick=${() => onSelect(c.seq)}
      ><title>${`#${c.seq} ${c.op} ${callWhat(c).slice(0, 120)} · ${ms(c.duration_ms)} · ${c.status}`}</title></rect>`;
    })}
  </svg>`;
}

/** The grade: 1 (its command exited 0) or 0, from the last grade call; or "not graded". */
export function Grade({ calls }) {
  const g = gradeOf(calls);
  if (!g) {
    return html`<div class="grade none" data-testid="trajectory-grade" data-grade="">not graded</div>`;
  }
  const r = g.call.result;
  return html`<div class=${`grade grade-${g.score}`} data-testid="trajectory-grade" data-grade=${g.score}>
    <span class="grade-score">grade ${g.score}</span>
    <span class="muted">
      ${g.exit === null || g.exit === undefined ? `signal ${g.signal}` : `exit ${g.exit}`} · call #${g.call.seq} ·
      on ${r.image || ''} · ${ms(g.call.duration_ms)}
    </span>
  </div>`;
}

function Header({ info, calls }) {
  const notes = calls.filter((c) => c.note).length;
  return html`<${KV}
    testid="trajectory-info"
    rows=${[
      ['sandbox', html`<a href=${sandboxHash(info.sandbox_id)}>${info.sandbox_id}</a>`],
      ['kind', info.kind],
      ['image', info.image],
      ['calls', String(info.length)],
      ['rebuilds', `${info.rebuilds}${notes ? ` (${notes} ${notes === 1 ? 'call' : 'calls'} with a note)` : ''}`],
      ['closed', info.closed ? 'yes (a recorded kill ended it)' : 'no'],
      ['created', fmtTime(info.created_at)],
      ['updated', fmtTime(info.updated_at)],
    ]}
  />`;
}

/** The prefix of an id's siblings: "job-17/rollout-3" -> "job-17/". */
export const parentPrefix = (id) => (id.includes('/') ? id.slice(0, id.lastIndexOf('/') + 1) : '');

export default function Page({ params }) {
  const id = params.id || '';
  const { data, error, loading } = useFetch(() => (id ? loadTrajectory(id) : Promise.resolve(null)), [id]);
  const [selected, setSelected] = useState(null);
  const [shown, setShown] = useState(SHOWN);
  const [openAll, setOpenAll] = useState(false);
  if (!id) {
    return html`<div class="page"><${PageHeader} title="Trajectory" />
      <p>No trajectory given: pick one among the <a href="#/trajectories">trajectories</a>.</p></div>`;
  }
  const calls = data ? data.calls : [];
  const select = (seq) => {
    setSelected(seq);
    if (seq >= shown) setShown(seq + 50);
    setTimeout(() => {
      const el = document.getElementById(`call-${seq}`);
      if (el) el.scrollIntoView({ block: 'nearest' });
    }, 0);
  };
  return html`<div class="page trajectory">
    <${PageHeader} title=${html`Trajectory <span data-testid="trajectory-id">${id}</span>`}>
      <a class="button" href=${hashFor('/trajectories', { prefix: parentPrefix(id) })}>All under “${parentPrefix(id) || '(all)'}”</a>
      <button type="button" data-testid="trajectory-export" disabled=${!data} onClick=${() => download(exportName(id), toJsonl(id, calls))}>
        Export JSONL
      </button>
    </${PageHeader}>
    <${ErrorBanner} error=${error} />
    ${loading && !data ? html`<p class="muted">loading…</p>` : null}
    ${data
      ? html`
          <${Section} title="Grade"><${Grade} calls=${calls} /></${Section}>
          <${Section} title="Trajectory"><${Header} info=${data.info} calls=${calls} /></${Section}>
          <${Section} title="Timeline">
            <${Timeline} calls=${calls} selected=${selected} onSelect=${select} />
            <div class="legend">
              ${LANES.map((l) => html`<span key=${l} class="legend-item"><svg width="12" height="12"><rect width="12" height="12" fill=${LANE_FILL[l]} /></svg> ${l}</span>`)}
              <span class="legend-item"><svg width="12" height="12"><rect width="12" height="12" fill=${STATUS_FILL.error} /></svg> error</span>
              <span class="legend-item"><svg width="12" height="12"><rect width="12" height="12" fill=${STATUS_FILL.interrupted} /></svg> interrupted</span>
            </div>
          </${Section}>
          <${Section}
            title=${`Calls (${calls.length})`}
            actions=${html`<button type="button" data-testid="calls-expand" onClick=${() => setOpenAll(!openAll)}>
              ${openAll ? 'Collapse all' : 'Expand all'}</button>`}
          >
            <ol class="calls" key=${openAll ? 'open' : 'closed'}>
              ${calls.slice(0, shown).map(
                (c) => html`<${CallRow} key=${c.seq} c=${c} open=${openAll} selected=${selected === c.seq} onSelect=${setSelected} />`,
              )}
            </ol>
            ${calls.length > shown
              ? html`<button type="button" data-testid="calls-more" onClick=${() => setShown(shown + SHOWN)}>
                  Show ${Math.min(SHOWN, calls.length - shown)} more (${calls.length - shown} left)
                </button>`
              : null}
          </${Section}>
        `
      : null}
  </div>`;
}
