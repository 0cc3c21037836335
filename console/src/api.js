// The one way the console talks to the daemon: same origin, the session cookie, JSON in and out.
// Non-GET requests carry the CSRF token the session handed out; a 401 sends the page to #/login.

const SAFE = new Set(['GET', 'HEAD']);

let current = { caller: null, csrf: null };
const listeners = new Set();

export class ApiError extends Error {
  constructor(status, code, message, detail) {
    super(message || code || `HTTP ${status}`);
    this.name = 'ApiError';
    this.status = status;
    this.code = code || 'error';
    this.detail = detail || {};
  }
}

function setSession(caller, csrf) {
  current = { caller, csrf };
  for (const fn of listeners) fn(current);
}

/** The caller of the open session ({name, operator}) or null. */
export function caller() {
  return current.caller;
}

/** Calls fn({caller, csrf}) whenever the session changes; returns the unsubscribe function. */
export function onSession(fn) {
  listeners.add(fn);
  return () => listeners.delete(fn);
}

/** path + query string; query values that are null, undefined or '' are left out, arrays repeat. */
export function url(path, query) {
  const qs = new URLSearchParams();
  for (const [key, value] of Object.entries(query || {})) {
    const values = Array.isArray(value) ? value : [value];
    for (const v of values) {
      if (v === null || v === undefined || v === '') continue;
      qs.append(key, String(v));
    }
  }
  const s = qs.toString();
  return s ? `${path}${path.includes('?') ? '&' : '?'}${s}` : path;
}

function toLogin() {
  const hash = window.location.hash || '';
  if (hash.startsWith('#/login')) return;
  const back = hash && hash !== '#' ? `?next=${encodeURIComponent(hash.slice(1))}` : '';
  window.location.hash = `#/login${back}`;
}

async function errorFrom(resp) {
  let body = null;
  try {
    body = await resp.json();
  } catch (_) {
    body = null;
  }
  // The API wraps errors as {"error": {...}}; accept the bare form too.
  const err = (body && (body.error || body)) || {};
  const message = typeof err.message === 'string' ? err.message : resp.statusText;
  return new ApiError(resp.status, err.code, message, err.detail);
}

/**
 * Sends one request. opts: {query, body, raw, noRedirect}. raw returns the Response as is (after the
 * status check); otherwise the parsed JSON, the text for non-JSON answers, or null for 204.
 */
export async function request(method, path, opts = {}) {
  const headers = { Accept: 'application/json' };
  const init = { method, headers, credentials: 'same-origin', cache: 'no-store', redirect: 'error' };
  if (opts.body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(opts.body);
  }
  if (!SAFE.has(method) && current.csrf) headers['X-CSRF-Token'] = current.csrf;
  let resp;
  try {
    resp = await fetch(url(path, opts.query), init);
  } catch (e) {
    throw new ApiError(0, 'network', `network error: ${e && e.message ? e.message : e}`);
  }
  if (!resp.ok) {
    const err = await errorFrom(resp);
    if (resp.status === 401 && !opts.noRedirect) {
      setSession(null, null);
      toLogin();
    }
    throw err;
  }
  if (opts.raw) return resp;
  if (resp.status === 204) return null;
  const type = resp.headers.get('Content-Type') || '';
  return type.includes('json') ? resp.json() : resp.text();
}

export const get = (path, query) => request('GET', path, { query });
export const post = (path, body, query) => request('POST', path, { body, query });
export const put = (path, body, query) => request('PUT', path, { body, query });
export const del = (path, query) => request('DELETE', path, { query });

// the caller as the pages see it: who, and whether this is a cluster gateway's console (it has nodes)
const withPlace = (s) => ({ ...s.caller, cluster: Boolean(s.cluster) });

/** The open session ({caller, csrf}) or null when not logged in (no redirect). */
export async function session() {
  try {
    const s = await request('GET', '/ui/session', { noRedirect: true });
    setSession(withPlace(s), s.csrf);
    return s;
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) {
      setSession(null, null);
      return null;
    }
    throw e;
  }
}

/** Opens a session with a token; throws ApiError (401) on a bad token. */
export async function login(token) {
  const s = await request('POST', '/ui/login', { body: { token }, noRedirect: true });
  setSession(withPlace(s), s.csrf);
  return s;
}

export async function logout() {
  try {
    await request('POST', '/ui/logout', { noRedirect: true });
  } finally {
    setSession(null, null);
  }
}

/** An EventSource on a same-origin path (the session cookie goes along). The caller closes it. */
export function eventSource(path, query) {
  return new EventSource(url(path, query));
}
