// Line charts with uPlot: smoothing, hover values, a ±std band and stacked areas.
const Charts = (() => {
  const palette = ["#2f6fed", "#f79009", "#12b76a", "#d92d20", "#7a5af8", "#0ba5ec", "#ee46bc", "#667085"];

  function ema(values, alpha) {
    if (!alpha) return values;
    let s = null;
    return values.map((v) => (v === null || v === undefined) ? null : (s = s === null ? v : alpha * s + (1 - alpha) * v));
  }

  // A value axis's tick labels: as many decimals as the step between ticks needs (uPlot's default keeps 3,
  // which printed a learning rate of 5e-6 or losses near 1e-3 as "0" on every tick), exponent notation for
  // magnitudes below 1e-3 or from 1e6. Ticks are multiples of the step, so the labels differ.
  function tickLabels(self, splits, axisIdx, space, incr) {
    const finite = splits.filter((v) => v !== null && v !== undefined && Number.isFinite(v));
    const top = Math.max(0, ...finite.map(Math.abs));
    const step = Math.abs(incr) || top || 1;
    const expo = top > 0 && (top < 1e-3 || top >= 1e6);
    const labels = splits.map((v) => {
      if (v === null || v === undefined || !Number.isFinite(v)) return "";
      if (Math.abs(v) < step / 2) return "0";  // a tick at zero, whatever rounding put there
      if (!expo) return v.toFixed(Math.min(20, Math.max(0, -Math.floor(Math.log10(step) + 1e-9))));
      const digits = Math.floor(Math.log10(Math.abs(v)) + 1e-9) - Math.floor(Math.log10(step) + 1e-9);
      return v.toExponential(Math.min(20, Math.max(0, digits))).replace("e+", "e");
    });
    self.root.dataset["ticks" + axisIdx] = labels.join("|");  // what the browser tests read
    return labels;
  }

  // A hovered value in the legend: 4 significant digits, exponent notation where fixed would show "0".
  function valueLabel(self, v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "–";
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e6) ? v.toExponential(3).replace("e+", "e") : String(+v.toPrecision(4));
  }

  // The value axis as wide as its longest label (at 12 px sans-serif, about 7 px a character).
  function axisSize(self, values) {
    return 18 + 7 * Math.max(4, ...(values || []).map((s) => s.length));
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
        uSeries.push({ label: s.label + " −std", stroke: color + "55", width: 1, points: { show: false }, value: valueLabel });
        uSeries.push({ label: s.label + " +std", stroke: color + "55", width: 1, points: { show: false }, value: valueLabel });
      }
      data.push(ema(s.values, smooth));
      uSeries.push({ label: s.label, stroke: color, width: 2, fill: s.fill ? color + "33" : undefined, points: { show: steps.length < 40 }, value: valueLabel });
    });
    const bands = [];
    let col = 1;
    series.forEach((s) => { if (s.band) { bands.push({ series: [col + 1, col], fill: (s.color || palette[0]) + "22" }); col += 3; } else col += 1; });
    const width = Math.max(320, el.clientWidth - 14);
    const plot = new uPlot({ width, height: 190, series: uSeries, bands, axes: [{ label: "step" }, { values: tickLabels, size: axisSize }],
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
  return { draw, stacked, palette, tickLabels, valueLabel };
})();
