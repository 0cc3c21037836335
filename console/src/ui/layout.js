// The page frame: navigation, who is logged in, logout.
import { html } from 'htm/preact';
import { logout } from '../api.js';
import { navigate } from '../router.js';

const NAV = [
  ['fleet', 'Fleet', '#/fleet', ['fleet']],
  ['sandboxes', 'Sandboxes', '#/sandboxes', ['sandboxes', 'sandbox']],
  ['trajectories', 'Trajectories', '#/trajectories', ['trajectories', 'trajectory', 'compare']],
  ['images', 'Images', '#/images', ['images']],
  ['audit', 'Audit', '#/audit', ['audit']],
];

/** props: caller ({name, operator} or null), route (from useRoute), children. */
export function Layout({ caller, route, children }) {
  const doLogout = async () => {
    try {
      await logout();
    } finally {
      navigate('#/login');
    }
  };
  return html`<div class="shell">
    <header class="topbar">
      <a class="brand" href="#/fleet">dsec</a>
      <nav class="nav">
        ${NAV.map(([key, label, href, names]) => html`<a key=${key} href=${href} data-testid=${`nav-${key}`}
          class=${names.includes(route && route.name) ? 'active' : ''}>${label}</a>`)}
      </nav>
      <span class="spacer"></span>
      ${caller && html`<span class="whoami" data-testid="whoami" title=${caller.operator ? 'operator' : 'tenant'}>
        ${caller.name}${caller.operator ? html` <span class="badge info">operator</span>` : html` <span class="badge muted">tenant</span>`}
      </span>
      <button type="button" class="link" data-testid="logout" onClick=${doLogout}>Log out</button>`}
    </header>
    <main class="content">${children}</main>
  </div>`;
}

/** A page heading with optional actions on the right. */
export function PageHeader({ title, children }) {
  return html`<div class="page-header"><h1>${title}</h1><div class="page-actions">${children}</div></div>`;
}

/** A titled box of content. */
export function Section({ title, testid, children, actions }) {
  return html`<section class="section" data-testid=${testid}>
    ${title && html`<div class="section-head"><h2>${title}</h2>${actions && html`<div>${actions}</div>`}</div>`}
    ${children}
  </section>`;
}
