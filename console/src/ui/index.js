// Everything the pages share, in one import: import { html, Table, usePoll, ... } from '../ui/index.js'.
export { html } from 'htm/preact';
export { ChartView, PALETTE } from './chart.js';
export { Collapsible } from './collapsible.js';
export { Confirm, ConfirmButton } from './confirm.js';
export { ErrorBanner } from './error.js';
export { fmtAgo, fmtBytes, fmtCores, fmtDuration, fmtPercent, fmtTime } from './format.js';
export { useFetch, usePoll } from './hooks.js';
export { Layout, PageHeader, Section } from './layout.js';
export { KV, Labels, Pager, StateBadge, Table } from './table.js';
