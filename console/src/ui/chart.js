// A Chart.js chart on a canvas, registered with only the parts the console uses.
import { html } from 'htm/preact';
import { useEffect, useRef } from 'preact/hooks';
import {
  BarController, BarElement, CategoryScale, Chart, Filler, Legend, LinearScale, LineController,
  LineElement, PointElement, Tooltip,
} from 'chart.js';

Chart.register(BarController, BarElement, CategoryScale, Filler, Legend, LinearScale, LineController, LineElement, PointElement, Tooltip);
Chart.defaults.font.family = 'system-ui, -apple-system, "Segoe UI", Roboto, sans-serif';
Chart.defaults.font.size = 11;
Chart.defaults.animation = false;

export const PALETTE = ['#2563eb', '#dc2626', '#16a34a', '#d97706', '#7c3aed', '#0891b2', '#db2777', '#4b5563'];

/** props: type ('line' | 'bar'), data (Chart.js data), options, testid, height (px). */
export function ChartView({ type, data, options, testid, height = 180 }) {
  const canvas = useRef(null);
  const chart = useRef(null);
  useEffect(() => {
    chart.current = new Chart(canvas.current, {
      type,
      data,
      options: { responsive: true, maintainAspectRatio: false, ...options },
    });
    return () => chart.current && chart.current.destroy();
  }, [type]);
  useEffect(() => {
    if (!chart.current) return;
    chart.current.data = data;
    if (options) chart.current.options = { responsive: true, maintainAspectRatio: false, ...options };
    chart.current.update('none');
  }, [data, options]);
  return html`<div class="chart" data-testid=${testid} style=${{ height: `${height}px` }}><canvas ref=${canvas}></canvas></div>`;
}
