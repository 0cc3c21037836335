// Mounts the console: checks the session, then renders the page the hash names inside the layout.
import { html } from 'htm/preact';
import { render } from 'preact';
import { useEffect, useState } from 'preact/hooks';
import { onSession, session } from './api.js';
import { navigate, useRoute } from './router.js';
import { ErrorBanner } from './ui/error.js';
import { Layout } from './ui/layout.js';
import Audit from './pages/audit.js';
import Compare from './pages/compare.js';
import Fleet from './pages/fleet.js';
import Images from './pages/images.js';
import Login from './pages/login.js';
import Sandbox from './pages/sandbox.js';
import Sandboxes from './pages/sandboxes.js';
import Trajectories from './pages/trajectories.js';
import Trajectory from './pages/trajectory.js';

const PAGES = {
  audit: Audit,
  compare: Compare,
  fleet: Fleet,
  images: Images,
  login: Login,
  sandbox: Sandbox,
  sandboxes: Sandboxes,
  trajectories: Trajectories,
  trajectory: Trajectory,
};

function NotFound({ path }) {
  return html`<div class="section"><h1>Not found</h1><p>No page at <code>${path}</code>. <a href="#/fleet">Go to the fleet</a>.</p></div>`;
}

function App() {
  const route = useRoute();
  // undefined: not known yet; null: not logged in.
  const [caller, setCaller] = useState(undefined);
  const [error, setError] = useState(null);

  useEffect(() => onSession((s) => setCaller(s.caller)), []);
  useEffect(() => {
    session()
      .then((s) => {
        setCaller(s ? { ...s.caller, cluster: Boolean(s.cluster) } : null);
        if (!s) navigate('#/login');
      })
      .catch((e) => {
        setCaller(null);
        setError(e);
      });
  }, []);
  useEffect(() => {
    if (caller === null && route.name !== 'login') navigate('#/login');
  }, [caller, route.name]);

  if (caller === undefined) return html`<div class="boot">Loading…</div>`;
  if (route.name === 'login' || caller === null) {
    return html`<div><${ErrorBanner} error=${error} /><${Login} params=${route.params} /></div>`;
  }
  const Page = PAGES[route.name];
  const key = `${route.name}:${route.params.id || ''}`;
  return html`<${Layout} caller=${caller} route=${route}>
    ${Page ? html`<${Page} key=${key} params=${route.params} query=${route.query} caller=${caller} />` : html`<${NotFound} path=${route.path} />`}
  <//>`;
}

render(html`<${App} />`, document.getElementById('app'));
