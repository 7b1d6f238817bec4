// The console's charts and confirmations. Chart data comes from <script type="application/json">
// blocks the server renders (never executed: the Content-Security-Policy allows scripts from
// /console/static only); each <canvas data-chart=KIND data-source=ID> draws the block ID.
"use strict";

function chartOptions(kind, format, max) {
  const stacked = kind === "bar-stacked";
  const ticks = format === "usd" ? { callback: (value) => "$" + Number(value).toPrecision(3) } : {};
  return {
    responsive: true,
    maintainAspectRatio: true,
    animation: false,
    interaction: { mode: "index", intersect: false },
    plugins: { legend: { position: "bottom" } },
    scales: { x: { stacked: stacked }, y: { stacked: stacked, beginAtZero: true, ticks: ticks, suggestedMax: max } },
  };
}

function drawCharts() {
  if (typeof Chart === "undefined") {
    return;
  }
  for (const canvas of document.querySelectorAll("canvas[data-chart]")) {
    const source = document.getElementById(canvas.dataset.source);
    if (!source) {
      continue;
    }
    const data = JSON.parse(source.textContent);
    const kind = canvas.dataset.chart;
    for (const dataset of data.datasets) {
      if (dataset.budget) {  // a budget line: dashed, no points
        dataset.borderDash = [6, 4];
        dataset.pointRadius = 0;
        dataset.borderWidth = 1;
      }
      if (kind === "line-steps") {
        dataset.stepped = true;
      }
      if (kind.startsWith("line")) {
        dataset.spanGaps = true;
        dataset.pointRadius = dataset.pointRadius ?? 2;
      }
    }
    const type = kind.startsWith("line") ? "line" : "bar";
    const chart = new Chart(canvas, { type: type, data: data, options: chartOptions(kind, canvas.dataset.format, canvas.dataset.max ? Number(canvas.dataset.max) : undefined) });
    canvas.dataset.drawn = String(chart.data.datasets.length);
  }
}

function confirmForms() {
  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) {
        event.preventDefault();
      }
    });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  confirmForms();
  drawCharts();
});
