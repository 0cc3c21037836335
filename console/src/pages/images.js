// Images: their lineage as a graph (base -> builds -> snapshots), one image's layers and lazy-fetch
// statistics, and the warm pools. Names, descriptions and build steps are untrusted text.
import { useEffect, useMemo, useRef, useState } from 'preact/hooks';
import { get } from '../api.js';
import { hashFor, navigate } from '../router.js';
import { ErrorBanner, KV, PageHeader, Pager, Section, Table, fmtBytes, fmtPercent, fmtTime, html, useFetch } from '../ui/index.js';

const NODE_W = 210;
const NODE_H = 34;
const COL_W = 260;
const ROW_H = 46;
const PAD = 10;
const KIND_FILL = { base: '#e0e7ff', build: '#dcfce7', snapshot: '#fef3c7' };
const KIND_STROKE = { base: '#4f46e5', build: '#16a34a', snapshot: '#d97706' };
const ROLE_BADGE = { base: 'info', toolkit: 'ok', workspace: 'warn', diff: 'bad' };

const short = (digest) => (digest ? digest.slice(0, 12) : '–');

/** What made a version: nothing under it (base), a sandbox's changes (snapshot), or a build on a parent. */
export const kindOf = (v) => (!v.parent ? 'base' : v.source_sandbox ? 'snapshot' : 'build');

/**
 * Every version the caller can see, keyed by digest: {digest, names (tags pointing at it), label, info,
 * kind}. Versions only an ancestor chain knows (a tag moved on, an untagged parent) come from
 * /v1/image/history of a name whose parent is not listed.
 */
async function loadLineage() {
  const { images } = await get('/v1/images');
  const nodes = new Map();
  const add = (info, name) => {
    let n = nodes.get(info.digest);
    if (!n) {
      n = { digest: info.digest, names: [], label: info.name, info, kind: kindOf(info) };
      nodes.set(info.digest, n);
    }
    if (name && !n.names.includes(name)) {
      n.names.push(name);
      n.label = n.names[0];
      if (!n.info.owner && info.owner) n.info = info;
    }
    return n;
  };
  const ready = images.filter((i) => i.ready && i.digest);
  for (const info of ready) add(info, info.name);
  const missing = ready.filter((i) => i.parent && !nodes.has(i.parent));
  await Promise.all(
    missing.map(async (info) => {
      try {
        const { images: chain } = await get('/v1/image/history', { name: info.name });
        for (const v of chain) if (v.digest && !nodes.has(v.digest)) add(v, null);
      } catch (_) {
        // a name removed meanwhile: its lineage stays cut, which the graph shows as a root
      }
    }),
  );
  return { nodes, unbuilt: images.filter((i) => !i.ready) };
}

const MAX_KIDS = 8; // children drawn under a parent before a "+N more" box (a base image may have hundreds)
const MAX_ROOTS = 12;

const newestFirst = (a, b) => String(b.info.created_at || '').localeCompare(String(a.info.created_at || '')) || a.label.localeCompare(b.label);

/** The names matching q and every ancestor of theirs; with the selection and its ancestors. */
function forced(nodes, q, selected) {
  const keep = new Set();
  const up = (n) => {
    for (let cur = n; cur && !keep.has(cur.digest); cur = nodes.get(cur.info.parent)) keep.add(cur.digest);
  };
  if (q) for (const n of nodes.values()) if (n.names.some((x) => x.includes(q)) || n.label.includes(q)) up(n);
  for (const n of nodes.values()) if (selected && (n.names.includes(selected) || n.digest === selected)) up(n);
  return keep;
}

/**
 * What the graph draws: with a filter, the matches and their ancestors; else every root and, under each
 * parent, its newest children up to MAX_KIDS (the rest behind a "+N more" box that expands it). The
 * selection and its ancestors are always drawn.
 */
export function visibleTree(nodes, { q = '', selected = '', expanded = new Set() } = {}) {
  const children = new Map();
  const roots = [];
  for (const n of nodes.values()) {
    const p = n.info.parent;
    if (p && nodes.has(p)) {
      if (!children.has(p)) children.set(p, []);
      children.get(p).push(n);
    } else {
      roots.push(n);
    }
  }
  const keep = forced(nodes, q, selected);
  // the forced ones first, then (for roots) those with children, then the newest
  const rank = (n, key) => (keep.has(n.digest) ? 0 : 2) + (key === '' && !children.has(n.digest) ? 1 : 0);
  const pick = (list, key) => {
    list.sort((a, b) => rank(a, key) - rank(b, key) || newestFirst(a, b));
    if (q) return list.filter((n) => keep.has(n.digest));
    if (expanded.has(key)) return list;
    const cap = key === '' ? MAX_ROOTS : MAX_KIDS;
    const shown = list.filter((n, i) => i < cap || keep.has(n.digest));
    const hidden = list.length - shown.length;
    return hidden > 0 ? [...shown, { more: true, key, count: hidden, digest: `more:${key}`, label: `+${hidden} more` }] : shown;
  };
  return {
    roots: pick(roots, ''),
    kids: (n) => (n.more ? [] : pick([...(children.get(n.digest) || [])], n.digest)),
    total: nodes.size,
  };
}

/** A tidy forest: leaves take consecutive rows, a parent sits between its first and last child. */
export function layout(tree) {
  const pos = new Map();
  const edges = [];
  const drawn = [];
  let row = 0;
  let depthMax = 0;
  const place = (n, depth) => {
    depthMax = Math.max(depthMax, depth);
    drawn.push(n);
    const kids = tree.kids(n);
    let y;
    if (!kids.length) {
      y = row;
      row += 1;
    } else {
      const ys = kids.map((k) => {
        edges.push([n, k]);
        return place(k, depth + 1);
      });
      y = (ys[0] + ys[ys.length - 1]) / 2;
    }
    pos.set(n.digest, { x: PAD + depth * COL_W, y: PAD + y * ROW_H });
    return y;
  };
  for (const r of tree.roots) place(r, 0);
  return {
    pos,
    edges,
    drawn,
    width: PAD * 2 + depthMax * COL_W + NODE_W,
    height: PAD * 2 + Math.max(row, 1) * ROW_H - (ROW_H - NODE_H),
  };
}

function MoreNode({ n, p, onExpand }) {
  return html`<g
    class="image-node more"
    data-testid="image-more"
    data-parent=${n.key}
    transform=${`translate(${p.x},${p.y})`}
    tabindex="0"
    role="button"
    onClick=${() => onExpand(n.key)}
    onKeyDown=${(e) => (e.key === 'Enter' || e.key === ' ') && onExpand(n.key)}
  >
    <title>show them all</title>
    <rect width=${NODE_W} height=${NODE_H} rx="5" fill="#f8fafc" stroke="#94a3b8" stroke-dasharray="3 3" />
    <text x="8" y="21" font-size="12" fill="#475569">${n.label}</text>
  </g>`;
}

function Graph({ tree, selected, onSelect, onExpand }) {
  const g = useMemo(() => layout(tree), [tree]);
  const box = useRef(null);
  useEffect(() => {
    const el = box.current && box.current.querySelector('[data-selected="true"]');
    if (el) el.scrollIntoView({ block: 'nearest', inline: 'nearest' });
  }, [g, selected]);
  if (!tree.roots.length) return html`<p class="muted" data-testid="image-graph">No image to show.</p>`;
  return html`<div class="graph-scroll" ref=${box}>
    <svg class="image-graph" data-testid="image-graph" width=${g.width} height=${g.height} viewBox=${`0 0 ${g.width} ${g.height}`} role="img" aria-label="image lineage">
      ${g.edges.map(([p, c]) => {
        const a = g.pos.get(p.digest);
        const b = g.pos.get(c.digest);
        const x1 = a.x + NODE_W;
        const y1 = a.y + NODE_H / 2;
        const x2 = b.x;
        const y2 = b.y + NODE_H / 2;
        const mid = (x1 + x2) / 2;
        return html`<path
          key=${`${p.digest}-${c.digest}`}
          data-testid=${c.more ? 'image-edge-more' : 'image-edge'}
          data-from=${p.label}
          data-to=${c.more ? '' : c.label}
          d=${`M${x1},${y1} C${mid},${y1} ${mid},${y2} ${x2},${y2}`}
          fill="none"
          stroke="#94a3b8"
          stroke-width="1.5"
        />`;
      })}
      ${g.drawn.map((n) => {
        const p = g.pos.get(n.digest);
        if (n.more) return html`<${MoreNode} key=${n.digest} n=${n} p=${p} onExpand=${onExpand} />`;
        const isSel = selected && (n.names.includes(selected) || n.digest === selected);
        const label = n.label.length > 30 ? `${n.label.slice(0, 29)}…` : n.label;
        const sub = `${n.kind} · ${fmtBytes(n.info.size)}${n.names.length ? '' : ' · untagged'}${n.names.length > 1 ? ` · +${n.names.length - 1} names` : ''}`;
        return html`<g
          key=${n.digest}
          class="image-node"
          data-testid="image-node"
          data-name=${n.label}
          data-names=${n.names.join(' ')}
          data-digest=${n.digest}
          data-kind=${n.kind}
          data-parent=${n.info.parent || ''}
          data-selected=${isSel ? 'true' : 'false'}
          transform=${`translate(${p.x},${p.y})`}
          tabindex="0"
          role="button"
          onClick=${() => onSelect(n)}
          onKeyDown=${(e) => (e.key === 'Enter' || e.key === ' ') && onSelect(n)}
        >
          <title>${[n.label, ...n.names.slice(1)].join('\n')}${`\n${n.digest}`}${n.info.description ? `\n${n.info.description}` : ''}</title>
          <rect width=${NODE_W} height=${NODE_H} rx="5" fill=${KIND_FILL[n.kind]} stroke=${isSel ? '#111827' : KIND_STROKE[n.kind]} stroke-width=${isSel ? 2.5 : 1} stroke-dasharray=${n.names.length ? 'none' : '4 3'} />
          <text x="8" y="14" font-size="12" font-weight="600" fill="#111827">${label}</text>
          <text x="8" y="28" font-size="10.5" fill="#475569">${sub}</text>
        </g>`;
      })}
    </svg>
  </div>`;
}

function Layers({ info }) {
  const total = info.layers.reduce((s, l) => s + l.size, 0) || 1;
  return html`<${Table}
    testid="image-layers"
    columns=${[
      { key: 'i', label: '#', className: 'num', render: (l) => String(info.layers.indexOf(l)) },
      { key: 'role', label: 'role', render: (l) => html`<span class=${`badge ${ROLE_BADGE[l.role] || 'muted'}`}>${l.role}</span>` },
      { key: 'size', label: 'size', className: 'num', render: (l) => fmtBytes(l.size) },
      { key: 'share', label: 'share', className: 'num', render: (l) => fmtPercent(l.size / total) },
      { key: 'digest', label: 'digest', className: 'mono', render: (l) => html`<span title=${l.digest}>${short(l.digest)}</span>` },
      { key: 'created_by', label: 'made by', className: 'mono', render: (l) => l.created_by || '–' },
    ]}
    rows=${info.layers}
    rowKey=${(l) => `${info.layers.indexOf(l)}-${l.digest}`}
    rowProps=${(l) => ({ 'data-testid': 'image-layer', 'data-role': l.role })}
    empty="No layers."
  />`;
}

function Stats({ name }) {
  const { data, error, loading } = useFetch(() => get('/v1/image/stats', { name }), [name]);
  if (error) return html`<div data-testid="image-stats"><${ErrorBanner} error=${error} /></div>`;
  if (!data) return html`<p class="muted" data-testid="image-stats">${loading ? 'loading…' : ''}</p>`;
  const byDigest = new Map(data.layers.map((l) => [l.digest, l]));
  return html`<div data-testid="image-stats">
    <div class="stat-row">
      <div class="stat"><span class="v" data-testid="image-exposed">${fmtPercent(data.exposed_fraction)}</span><span class="k">exposed (fetched / size)</span></div>
      <div class="stat"><span class="v" data-testid="image-hit-rate">${data.chunk_hit_rate === null ? '–' : fmtPercent(data.chunk_hit_rate)}</span><span class="k">chunk hit rate</span></div>
      <div class="stat"><span class="v">${fmtBytes(data.fetched_bytes)}</span><span class="k">fetched of ${fmtBytes(data.size)}</span></div>
      <div class="stat"><span class="v">${data.fetch_wait_seconds.toFixed(2)} s</span><span class="k">waiting on fetches</span></div>
      <div class="stat"><span class="v">${data.mode}</span><span class="k">mode</span></div>
    </div>
    <${Table}
      columns=${[
        { key: 'digest', label: 'layer', className: 'mono', render: (l) => html`<span title=${l.digest}>${short(l.digest)}</span>` },
        { key: 'size', label: 'size', className: 'num', render: (l) => fmtBytes(l.size) },
        { key: 'fetched_bytes', label: 'fetched', className: 'num', render: (l) => fmtBytes(l.fetched_bytes) },
        { key: 'read_bytes', label: 'read', className: 'num', render: (l) => fmtBytes(l.read_bytes) },
        { key: 'exposed', label: 'exposed', className: 'num', render: (l) => fmtPercent(l.size ? l.fetched_bytes / l.size : 0) },
        { key: 'hits', label: 'hit rate', className: 'num', render: (l) => (l.chunk_hits + l.chunk_misses ? fmtPercent(l.chunk_hits / (l.chunk_hits + l.chunk_misses)) : '–') },
        { key: 'wait', label: 'wait', className: 'num', render: (l) => `${l.fetch_wait_seconds.toFixed(2)} s` },
        { key: 'errors', label: 'errors', className: 'num' },
      ]}
      rows=${[...byDigest.values()]}
      rowKey=${(l) => l.digest}
      empty="No layer fetched on this node yet."
    />
  </div>`;
}

function Detail({ node }) {
  const info = node.info;
  const tagged = node.names.length > 0;
  return html`<${Section} title=${node.label} testid="image-detail">
    <${KV}
      testid="image-info"
      rows=${[
        ['names', node.names.length ? node.names.join(', ') : `(untagged; was ${info.name})`],
        ['made as', node.kind],
        ['digest', html`<span class="mono">${node.digest}</span>`],
        ['parent', info.parent ? html`<span class="mono">${info.parent}</span>` : 'none'],
        ['snapshot of', info.source_sandbox ? html`<a href=${`#/sandboxes/${encodeURIComponent(info.source_sandbox)}`}>${info.source_sandbox}</a>` : null],
        ['size', fmtBytes(info.size)],
        ['created', fmtTime(info.created_at)],
        ['owner', info.owner || (tagged ? 'public' : null)],
        ['description', info.description || null],
        ['scrubbed', info.scrubbed && info.scrubbed.length ? info.scrubbed.join(', ') : null],
      ]}
    />
    <h3 class="sub">Layers (lowest first)</h3>
    <${Layers} info=${info} />
    <h3 class="sub">Lazy fetching on this node</h3>
    ${tagged ? html`<${Stats} name=${node.names[0]} />` : html`<p class="muted" data-testid="image-stats">Statistics are kept per name; this version has none now.</p>`}
  </${Section}>`;
}

function Pools() {
  const { data, error } = useFetch(() => get('/v1/warm-pools'), [], 5000);
  const pools = data ? data.pools : [];
  const limits = (l) => Object.entries(l || {}).filter(([, v]) => v !== null && v !== undefined).map(([k, v]) => `${k}=${v}`).join(', ');
  return html`<${Section} title="Warm pools" testid="warm-pools">
    <${ErrorBanner} error=${error} />
    <${Table}
      columns=${[
        { key: 'name', label: 'pool', className: 'mono' },
        { key: 'image', label: 'image', className: 'mono', render: (p) => p.spec.image },
        { key: 'kind', label: 'kind', render: (p) => p.spec.kind },
        { key: 'limits', label: 'limits', className: 'mono', render: (p) => limits(p.spec.limits) || '–' },
        { key: 'tenant', label: 'tenant', render: (p) => p.spec.tenant || '(operator)' },
        { key: 'ready', label: 'idle / size', className: 'num', render: (p) => `${p.idle} / ${p.spec.size}` },
        { key: 'filling', label: 'filling', className: 'num' },
        { key: 'claims', label: 'claims', className: 'num' },
        { key: 'misses', label: 'misses', className: 'num' },
        { key: 'refills', label: 'refills', className: 'num' },
        { key: 'drained', label: 'drained', className: 'num' },
        { key: 'reclaimed', label: 'reclaimed', className: 'num' },
        { key: 'failures', label: 'failures', className: 'num' },
        { key: 'waiting', label: 'waiting', render: (p) => (p.waiting ? html`<span class="badge warn">${p.waiting}</span>` : '') },
      ]}
      rows=${pools}
      rowKey=${(p) => p.name}
      rowProps=${(p) => ({ 'data-testid': 'warm-pool', 'data-name': p.name })}
      empty="No warm pool (dsec serve --warm IMAGE=N, or dsec pool set)."
    />
  </${Section}>`;
}

const LIST_PAGE = 50;

export default function Page({ params }) {
  const { data, error, loading, reload } = useFetch(loadLineage, []);
  const picked = params.name || '';
  const q = params.q || '';
  const [typed, setTyped] = useState(q);
  const [expanded, setExpanded] = useState(() => new Set());
  const [offset, setOffset] = useState(0);
  useEffect(() => setTyped(q), [q]);
  const go = (next) => navigate(hashFor('/images', { q, name: picked, ...next }), true);
  const select = (n) => go({ name: n.names[0] || n.digest });
  const expand = (key) => setExpanded(new Set([...expanded, key]));
  const tree = useMemo(() => (data ? visibleTree(data.nodes, { q, selected: picked, expanded }) : null), [data, q, picked, expanded]);
  const node = data && picked ? [...data.nodes.values()].find((n) => n.names.includes(picked) || n.digest === picked) : null;
  const list = data
    ? [...data.nodes.values()].filter((n) => n.names.length && (!q || n.names.some((x) => x.includes(q)))).sort((a, b) => a.label.localeCompare(b.label))
    : [];
  return html`<div class="page images">
    <${PageHeader} title="Images"><button type="button" onClick=${reload}>Refresh</button></${PageHeader}>
    <form
      class="filters"
      onSubmit=${(e) => {
        e.preventDefault();
        setOffset(0);
        go({ q: typed });
      }}
    >
      <label>name contains<input data-testid="image-filter" value=${typed} placeholder="dsec/debian" onInput=${(e) => setTyped(e.currentTarget.value)} /></label>
      <button type="submit">Show</button>
      ${q ? html`<button type="button" onClick=${() => go({ q: '' })}>All</button>` : null}
    </form>
    <${ErrorBanner} error=${error} />
    ${loading && !data ? html`<p class="muted">loading…</p>` : null}
    ${data
      ? html`<${Section} title=${`Lineage (${data.nodes.size} versions)`}>
            <div class="legend">
              ${['base', 'build', 'snapshot'].map((k) => html`<span key=${k} class="legend-item"><svg width="12" height="12"><rect width="12" height="12" rx="2" fill=${KIND_FILL[k]} stroke=${KIND_STROKE[k]} /></svg> ${k}</span>`)}
              <span class="legend-item muted">dashed: a version no name points at now · newest children first · click an image for its layers and statistics</span>
            </div>
            <${Graph} tree=${tree} selected=${picked} onSelect=${select} onExpand=${expand} />
          </${Section}>
          ${node ? html`<${Detail} key=${node.digest} node=${node} />` : null}
          <${Section} title=${`Images (${list.length})`}>
            <${Table}
              testid="image-list"
              columns=${[
                { key: 'label', label: 'name', className: 'mono', render: (n) => n.names.join(', ') },
                { key: 'kind', label: 'made as' },
                { key: 'size', label: 'size', className: 'num', render: (n) => fmtBytes(n.info.size) },
                { key: 'layers', label: 'layers', className: 'num', render: (n) => String(n.info.layers.length) },
                { key: 'owner', label: 'owner', render: (n) => n.info.owner || 'public' },
                { key: 'created', label: 'created', render: (n) => fmtTime(n.info.created_at) },
                { key: 'description', label: 'description', render: (n) => n.info.description || '' },
              ]}
              rows=${list.slice(offset, offset + LIST_PAGE)}
              rowKey=${(n) => n.digest}
              rowProps=${(n) => ({ 'data-testid': 'image-row', 'data-name': n.label, class: 'clickable', onClick: () => select(n) })}
            />
            <${Pager} offset=${offset} limit=${LIST_PAGE} total=${list.length} onChange=${setOffset} />
            ${data.unbuilt.length
              ? html`<p class="muted">Built in, built on first use: ${data.unbuilt.map((i) => i.name).join(', ')}</p>`
              : null}
          </${Section}>`
      : null}
    <${Pools} />
  </div>`;
}
