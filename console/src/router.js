// Hash routing: #/<path>?<query>. The routes are the contract's; pages get {path, params}.
import { useEffect, useState } from 'preact/hooks';

const ROUTES = [
  { pattern: /^\/login$/, name: 'login' },
  { pattern: /^\/(fleet)?$/, name: 'fleet' },
  { pattern: /^\/sandboxes$/, name: 'sandboxes' },
  { pattern: /^\/sandboxes\/([^/]+)$/, name: 'sandbox', keys: ['id'] },
  { pattern: /^\/trajectories$/, name: 'trajectories' },
  { pattern: /^\/trajectories\/view$/, name: 'trajectory' },
  { pattern: /^\/trajectories\/compare$/, name: 'compare' },
  { pattern: /^\/images$/, name: 'images' },
  { pattern: /^\/audit$/, name: 'audit' },
];

/**
 * Parses a hash ("#/sandboxes/x?state=running") into {path, name, params, query}:
 * params holds the path parameters and the first value of every query key (strings);
 * query is the URLSearchParams (for repeated keys); name is null when no route matches.
 */
export function parseHash(hash) {
  const raw = (hash || '').replace(/^#/, '') || '/fleet';
  const at = raw.indexOf('?');
  const path = at < 0 ? raw : raw.slice(0, at);
  const query = new URLSearchParams(at < 0 ? '' : raw.slice(at + 1));
  const params = {};
  for (const [k, v] of query) if (!(k in params)) params[k] = v;
  for (const route of ROUTES) {
    const m = route.pattern.exec(path);
    if (!m) continue;
    (route.keys || []).forEach((key, i) => {
      params[key] = decodeURIComponent(m[i + 1]);
    });
    return { path, name: route.name, params, query };
  }
  return { path, name: null, params, query };
}

/** "#/path?k=v": query values null/undefined/'' are left out, arrays repeat the key. */
export function hashFor(path, query) {
  const qs = new URLSearchParams();
  for (const [key, value] of Object.entries(query || {})) {
    for (const v of Array.isArray(value) ? value : [value]) {
      if (v === null || v === undefined || v === '') continue;
      qs.append(key, String(v));
    }
  }
  const s = qs.toString();
  return `#${path}${s ? `?${s}` : ''}`;
}

/** The link to one sandbox's page. */
export const sandboxHash = (id) => `#/sandboxes/${encodeURIComponent(id)}`;

/** Goes to a hash ("#/fleet" or "/fleet"); replace=true does not add a history entry. */
export function navigate(hash, replace = false) {
  const target = hash.startsWith('#') ? hash : `#${hash}`;
  if (replace) {
    window.history.replaceState(null, '', target);
    window.dispatchEvent(new HashChangeEvent('hashchange'));
  } else if (window.location.hash !== target) {
    window.location.hash = target;
  }
}

/** The current route; re-renders on every hash change. */
export function useRoute() {
  const [route, setRoute] = useState(() => parseHash(window.location.hash));
  useEffect(() => {
    const onChange = () => setRoute(parseHash(window.location.hash));
    window.addEventListener('hashchange', onChange);
    return () => window.removeEventListener('hashchange', onChange);
  }, []);
  return route;
}
