// The error banner: every failed request a page shows goes through it (data-testid="error").
import { html } from 'htm/preact';

function describe(error) {
  if (!error) return '';
  if (typeof error === 'string') return error;
  const status = error.status ? `${error.status} ` : '';
  const code = error.code && error.code !== 'error' ? `${error.code}: ` : '';
  return `${status}${code}${error.message || String(error)}`;
}

export function ErrorBanner({ error, onDismiss }) {
  if (!error) return null;
  return html`<div class="error-banner" role="alert" data-testid="error">
    <span class="error-text">${describe(error)}</span>
    ${onDismiss && html`<button class="link" type="button" onClick=${onDismiss}>dismiss</button>`}
  </div>`;
}
