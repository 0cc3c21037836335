// A block of untrusted text (stdout, stderr, arguments) shown as text, folded when long,
// with truncation marked when the server cut it.
import { html } from 'htm/preact';
import { useState } from 'preact/hooks';

/**
 * props: text, title (a label), testid (on the <pre>), truncated (bool: the server cut the text),
 * truncatedTestid (default "truncated"), maxLines (folded height, default 12), className.
 */
export function Collapsible({ text, title, testid, truncated = false, truncatedTestid = 'truncated', maxLines = 12, className = '' }) {
  const [open, setOpen] = useState(false);
  const body = text === null || text === undefined ? '' : String(text);
  const lines = body.split('\n');
  const long = lines.length > maxLines || body.length > maxLines * 160;
  const shown = open || !long ? body : lines.slice(0, maxLines).join('\n').slice(0, maxLines * 160);
  return html`<div class=${`collapsible ${className}`}>
    ${(title || long || truncated) && html`<div class="collapsible-head">
      ${title && html`<span class="collapsible-title">${title}</span>`}
      ${truncated && html`<span class="badge warn" data-testid=${truncatedTestid} title="The server kept only part of this output">truncated</span>`}
      ${long && html`<button type="button" class="link" onClick=${() => setOpen(!open)}>
        ${open ? 'fold' : `show all (${lines.length} lines, ${body.length} chars)`}</button>`}
    </div>`}
    <pre class="text-block" data-testid=${testid}>${shown}${!open && long ? '\n…' : ''}</pre>
  </div>`;
}
