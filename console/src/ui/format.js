// Formatters for numbers the API gives raw: bytes, seconds, unix times, ISO stamps, cores.

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

export function fmtBytes(n) {
  if (n === null || n === undefined || Number.isNaN(Number(n))) return '–';
  let v = Number(n);
  const sign = v < 0 ? '-' : '';
  v = Math.abs(v);
  let i = 0;
  while (v >= 1024 && i < UNITS.length - 1) {
    v /= 1024;
    i += 1;
  }
  const digits = i === 0 || v >= 100 ? 0 : v >= 10 ? 1 : 2;
  return `${sign}${v.toFixed(digits)} ${UNITS[i]}`;
}

/** Seconds as "850 ms", "12.3 s", "4m 05s", "2h 03m", "3d 04h". */
export function fmtDuration(s) {
  if (s === null || s === undefined || Number.isNaN(Number(s))) return '–';
  const v = Number(s);
  if (v < 0) return `-${fmtDuration(-v)}`;
  if (v < 1) return `${Math.round(v * 1000)} ms`;
  if (v < 60) return `${v.toFixed(v < 10 ? 2 : 1)} s`;
  const pad = (x) => String(Math.floor(x)).padStart(2, '0');
  if (v < 3600) return `${Math.floor(v / 60)}m ${pad(v % 60)}s`;
  if (v < 86400) return `${Math.floor(v / 3600)}h ${pad((v % 3600) / 60)}m`;
  return `${Math.floor(v / 86400)}d ${pad((v % 86400) / 3600)}h`;
}

function toDate(t) {
  if (t === null || t === undefined || t === '') return null;
  const d = typeof t === 'number' ? new Date(t * 1000) : new Date(t);
  return Number.isNaN(d.getTime()) ? null : d;
}

/** A unix time (seconds) or an ISO string as local "YYYY-MM-DD HH:MM:SS". */
export function fmtTime(t) {
  const d = toDate(t);
  if (!d) return '–';
  const p = (x) => String(x).padStart(2, '0');
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

/** "12 s ago" / "in 3m 10s" relative to now. */
export function fmtAgo(t) {
  const d = toDate(t);
  if (!d) return '–';
  const s = Math.round((Date.now() - d.getTime()) / 1000);
  const span = (x) => (x < 60 ? `${x} s` : fmtDuration(x));
  return s >= 0 ? `${span(s)} ago` : `in ${span(-s)}`;
}

export function fmtCores(c) {
  if (c === null || c === undefined || Number.isNaN(Number(c))) return '–';
  const v = Number(c);
  return `${v >= 10 ? v.toFixed(1) : v.toFixed(2)} cpu`;
}

export function fmtPercent(x) {
  if (x === null || x === undefined || Number.isNaN(Number(x))) return '–';
  return `${(Number(x) * 100).toFixed(Number(x) < 0.1 ? 1 : 0)}%`;
}
