// Line charts with uPlot: smoothing, hover values, a ±std band and stacked areas.
const Charts = (() => {
  const palette = ["#2f6fed", "#f79009", "#12b76a", "#d92d20", "#7a5af8", "#0ba5ec", "#ee46bc", "#667085"];

  function ema(values, alpha) {
    if (!alpha) return values;
    let s = null;
    return values.map((v) => (v === null || v === undefined) ? null : (s = s === null ? v : alpha * s + (1 - alpha) * v));
  }

  // series: [{label, values, band?: [lo, hi] arrays, stacked?}]
  function draw(el, title, steps, series, opts = {}) {
    el.innerHTML = `<h3>${title}</h3>`;
    const smooth = opts.smooth || 0;
    let data = [steps];
    const uSeries = [{ label: "step" }];
    series.forEach((s, i) => {
      const color = s.color || palette[i % palette.length];
      if (s.band) {
        data.push(ema(s.band[0], smooth), ema(s.band[1], smooth));
        uSeries.push({ label: s.label + " −std", stroke: color + "55", width: 1, points: { show: false } });
        uSeries.push({ label: s.label + " +std", stroke: color + "55", width: 1, points: { show: false } });
      }
      data.push(ema(s.values, smooth));
      uSeries.push({ label: s.label, stroke: color, width: 2, fill: s.fill ? color + "33" : undefined, points: { show: steps.length < 40 } });
    });
    const bands = [];
    let col = 1;
    series.forEach((s) => { if (s.band) { bands.push({ series: [col + 1, col], fill: (s.color || palette[0]) + "22" }); col += 3; } else col += 1; });
    const width = Math.max(320, el.clientWidth - 14);
    const plot = new uPlot({ width, height: 190, series: uSeries, bands, axes: [{ label: "step" }, {}],
      scales: { x: { time: false } }, legend: { live: true } }, data, el);
    el.dataset.points = String(steps.length);
    return plot;
  }

  function stacked(parts) {
    // cumulative sums so the areas stack: parts = [{label, values}]
    const out = []; let acc = null;
    // a step none of the parts reports stays empty (null), not 0
    const any = parts.length ? parts[0].values.map((_, i) => parts.some((p) => p.values[i] !== null && p.values[i] !== undefined)) : [];
    parts.forEach((p) => { acc = acc ? acc.map((a, i) => a + (p.values[i] || 0)) : p.values.map((v) => v || 0); out.push({ label: p.label, values: acc.map((a, i) => any[i] ? a : null), fill: true }); });
    return out.reverse();
  }
  return { draw, stacked, palette };
})();
