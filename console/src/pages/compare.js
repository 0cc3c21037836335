// Two trajectories side by side (#/trajectories/compare?a=&b=), aligned by position: the same task
// rewarded 1 and 0, say. A row is marked where the calls ask different things or got different answers.
import { useState } from 'preact/hooks';
import { hashFor, navigate } from '../router.js';
import { ErrorBanner, PageHeader, html, useFetch } from '../ui/index.js';
import { CallDetail, Grade, callWhat, execResult, exitOf, laneOf, loadTrajectory, viewHash } from './trajectory.js';

const SHOWN = 300;

/** How two calls at one position differ: 'same', 'result' (same request, other answer), 'request', 'left'/'right' (one side only). */
export function diffKind(l, r) {
  if (!l) return 'right';
  if (!r) return 'left';
  if (l.op !== r.op) return 'request';
  if (l.op === 'create') {
    // a create's parameters name its own trajectory: compare what it makes, not who asked
    const what = (c) => JSON.stringify([c.request.image, c.request.kind, c.request.limits]);
    return what(l) !== what(r) ? 'request' : l.status !== r.status ? 'result' : 'same';
  }
  if (l.digest !== r.digest) return 'request';
  if (l.status !== r.status) return 'result';
  if (l.op === 'kill') return 'same'; // its answer is the sandbox's info: ids and times, never alike
  const a = execResult(l);
  const b = execResult(r);
  if (a || b) {
    if (!a || !b || a.exit_code !== b.exit_code || a.signal !== b.signal || a.stdout !== b.stdout || a.stderr !== b.stderr) return 'result';
    return 'same';
  }
  if (l.result_bytes !== r.result_bytes) return 'result';
  return JSON.stringify(l.result || null) === JSON.stringify(r.result || null) ? 'same' : 'result';
}

const KIND_LABEL = { same: 'same', result: 'answer differs', request: 'call differs', left: 'only left', right: 'only right' };
const KIND_BADGE = { same: 'muted', result: 'warn', request: 'bad', left: 'info', right: 'info' };

/** The first line of output worth showing: stdout's, else stderr's; a kept error's message. */
function preview(c) {
  const r = execResult(c);
  if (r) {
    const lines = (r.stdout || r.stderr || '').split('\n');
    return lines.find((x) => x.trim()) || '';
  }
  const err = c.result && c.result.error;
  return err ? String(err.message || err.code || '') : '';
}

function Cell({ c, other, side, open }) {
  if (!c) return html`<div class=${`cmp-cell empty ${side}`} data-side=${side}>—</div>`;
  const exit = exitOf(c);
  const otherExit = other ? exitOf(other) : undefined;
  const firstLine = preview(c);
  const otherLine = other ? preview(other) : firstLine;
  return html`<div class=${`cmp-cell ${side}`} data-side=${side}>
    <div class="cmp-head">
      <span class=${`badge op op-${laneOf(c.op)}`}>${c.op}</span>
      <code class=${`call-what${other && callWhat(other) !== callWhat(c) ? ' changed' : ''}`} title=${callWhat(c)}>${callWhat(c).slice(0, 160)}</code>
      ${exit === null ? null : html`<span class=${`exit ${exit === 0 ? 'ok' : 'bad'}${other && otherExit !== exit ? ' changed' : ''}`} data-testid="compare-exit">exit ${exit}</span>`}
      ${c.status !== 'done' ? html`<span class="badge bad">${c.status}</span>` : null}
    </div>
    ${firstLine && !open ? html`<div class=${`cmp-preview mono${otherLine !== firstLine ? ' changed' : ''}`}>${firstLine.slice(0, 160)}</div>` : null}
    ${c.note ? html`<div class="call-note">note: ${c.note}</div>` : null}
    ${open ? html`<${CallDetail} c=${c} />` : null}
  </div>`;
}

function Row({ seq, l, r, kind }) {
  const [open, setOpen] = useState(false);
  return html`<div class=${`cmp-row diff-${kind}`} data-testid="compare-row" data-seq=${seq} data-diff=${kind}>
    <button type="button" class="cmp-seq" aria-expanded=${open ? 'true' : 'false'} title="show both calls in full" onClick=${() => setOpen(!open)}>
      #${seq}<br /><span class=${`badge ${KIND_BADGE[kind]}`}>${KIND_LABEL[kind]}</span>
    </button>
    <${Cell} c=${l} other=${r} side="left" open=${open} />
    <${Cell} c=${r} other=${l} side="right" open=${open} />
  </div>`;
}

function Side({ id, t, testid }) {
  return html`<section class="section cmp-side" data-testid=${testid} data-id=${id}>
    <div class="section-head"><h2><a href=${viewHash(id)}>${id}</a></h2></div>
    ${t
      ? html`<${Grade} calls=${t.calls} />
          <div class="muted">${t.info.length} calls · ${t.info.image} · ${t.info.kind}${t.info.rebuilds ? ` · ${t.info.rebuilds} rebuilds` : ''}</div>`
      : null}
  </section>`;
}

export default function Page({ params }) {
  const a = params.a || '';
  const b = params.b || '';
  const { data, error, loading } = useFetch(async () => {
    if (!a || !b) return null;
    const [left, right] = await Promise.all([loadTrajectory(a), loadTrajectory(b)]);
    return { left, right };
  }, [a, b]);
  const [onlyDiff, setOnlyDiff] = useState(false);
  const [shown, setShown] = useState(SHOWN);
  if (!a || !b) {
    return html`<div class="page"><${PageHeader} title="Compare trajectories" />
      <p>Tick two trajectories in the <a href="#/trajectories">list</a> to compare them.</p></div>`;
  }
  let rows = [];
  if (data) {
    const n = Math.max(data.left.calls.length, data.right.calls.length);
    const bySeq = (calls) => new Map(calls.map((c) => [c.seq, c]));
    const L = bySeq(data.left.calls);
    const R = bySeq(data.right.calls);
    for (let seq = 0; seq < n; seq += 1) {
      const l = L.get(seq);
      const r = R.get(seq);
      if (l || r) rows.push({ seq, l, r, kind: diffKind(l, r) });
    }
  }
  const differing = rows.filter((x) => x.kind !== 'same');
  const first = differing.length ? differing[0].seq : null;
  const visible = onlyDiff ? differing : rows;
  return html`<div class="page compare">
    <${PageHeader} title="Compare trajectories">
      <button type="button" data-testid="compare-swap" onClick=${() => navigate(hashFor('/trajectories/compare', { a: b, b: a }))}>Swap sides</button>
    </${PageHeader}>
    <${ErrorBanner} error=${error} />
    <div class="cmp-sides">
      <${Side} id=${a} t=${data && data.left} testid="compare-left" />
      <${Side} id=${b} t=${data && data.right} testid="compare-right" />
    </div>
    ${loading && !data ? html`<p class="muted">loading…</p>` : null}
    ${data
      ? html`<section class="section">
          <div class="section-head">
            <h2 data-testid="compare-summary">
              ${rows.length} positions · ${differing.length} differ${first === null ? '' : ` · first at #${first}`}
            </h2>
            <label class="muted"><input type="checkbox" data-testid="compare-only-diff" checked=${onlyDiff} onChange=${(e) => setOnlyDiff(e.currentTarget.checked)} /> differences only</label>
          </div>
          <div class="cmp-rows">
            ${visible.slice(0, shown).map((x) => html`<${Row} key=${x.seq} ...${x} />`)}
          </div>
          ${visible.length > shown
            ? html`<button type="button" onClick=${() => setShown(shown + SHOWN)}>Show ${Math.min(SHOWN, visible.length - shown)} more</button>`
            : null}
        </section>`
      : null}
  </div>`;
}
