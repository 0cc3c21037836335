// A modal confirmation (confirm-yes / confirm-no) and a button that asks before it acts.
import { html } from 'htm/preact';
import { useEffect, useRef, useState } from 'preact/hooks';

/** A modal question; children go between the message and the buttons (e.g. an input). */
export function Confirm({ title, message, confirmLabel = 'Confirm', danger = false, busy = false, onYes, onNo, children }) {
  const noRef = useRef(null);
  useEffect(() => {
    if (noRef.current) noRef.current.focus();
    const onKey = (e) => {
      if (e.key === 'Escape') onNo();
    };
    document.addEventListener('keydown', onKey);
    return () => document.removeEventListener('keydown', onKey);
  }, []);
  return html`<div class="modal-backdrop" onClick=${(e) => e.target === e.currentTarget && onNo()}>
    <div class="modal" role="dialog" aria-modal="true" aria-label=${title}>
      <h3>${title}</h3>
      ${message && html`<p>${message}</p>`}
      ${children}
      <div class="modal-actions">
        <button type="button" ref=${noRef} data-testid="confirm-no" onClick=${onNo} disabled=${busy}>Cancel</button>
        <button type="button" class=${danger ? 'danger' : 'primary'} data-testid="confirm-yes" onClick=${onYes} disabled=${busy}>
          ${busy ? 'Working…' : confirmLabel}
        </button>
      </div>
    </div>
  </div>`;
}

/**
 * A button that opens a Confirm and, on yes, awaits onConfirm(); errors go to onError.
 * renderExtra(state, setState) may add inputs to the dialog (their values come back in onConfirm(state)).
 */
export function ConfirmButton({ label, testid, title, message, confirmLabel, danger, disabled, onConfirm, onError, renderExtra, initial = {} }) {
  const [open, setOpen] = useState(false);
  const [busy, setBusy] = useState(false);
  const [extra, setExtra] = useState(initial);
  const yes = async () => {
    setBusy(true);
    try {
      await onConfirm(extra);
      setOpen(false);
    } catch (e) {
      setOpen(false);
      if (onError) onError(e);
    } finally {
      setBusy(false);
    }
  };
  return html`<span>
    <button type="button" class=${danger ? 'danger' : ''} data-testid=${testid} disabled=${disabled}
      onClick=${() => { setExtra(initial); setOpen(true); }}>${label}</button>
    ${open && html`<${Confirm} title=${title || label} message=${message} confirmLabel=${confirmLabel || label}
      danger=${danger} busy=${busy} onYes=${yes} onNo=${() => setOpen(false)}>
      ${renderExtra && renderExtra(extra, setExtra)}
    <//>`}
  </span>`;
}
