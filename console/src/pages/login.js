// The login form: a token (operator or tenant) opens an HttpOnly session.
import { html } from 'htm/preact';
import { useState } from 'preact/hooks';
import { ApiError, login } from '../api.js';
import { navigate } from '../router.js';

function nextHash(params) {
  const next = params && params.next;
  // Only a route inside the console, never a URL elsewhere.
  return next && next.startsWith('/') && !next.startsWith('//') && !next.startsWith('/login') ? `#${next}` : '#/fleet';
}

export default function Login({ params }) {
  const [token, setToken] = useState('');
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      await login(token.trim());
      setToken('');
      navigate(nextHash(params));
    } catch (err) {
      setError(err instanceof ApiError && err.status === 401 ? 'That token is not valid.' : `Login failed: ${err.message}`);
    } finally {
      setBusy(false);
    }
  };
  return html`<div class="login-wrap">
    <form class="login" onSubmit=${submit} autocomplete="off">
      <h1>dsec console</h1>
      <p class="muted">Log in with an operator or tenant token.</p>
      <label for="login-token">Token</label>
      <input id="login-token" type="password" data-testid="login-token" value=${token}
        onInput=${(e) => setToken(e.currentTarget.value)} autofocus required spellcheck="false" />
      ${error && html`<div class="error-banner" role="alert" data-testid="login-error">${error}</div>`}
      <button type="submit" class="primary" data-testid="login-submit" disabled=${busy || !token.trim()}>
        ${busy ? 'Logging in…' : 'Log in'}</button>
    </form>
  </div>`;
}
