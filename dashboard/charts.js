// Step charts on top of uPlot (an npm dependency served by the API at /dashboard/uPlot.esm.js).
// A StepChart owns one card: a title, a uPlot canvas and its legend. It is rebuilt only when
// the set of series changes; new points go through setData so the cursor and zoom survive.

import uPlot from "/dashboard/uPlot.esm.js";

export const PALETTE = [
  "#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed",
  "#0891b2", "#db2777", "#4b5563", "#65a30d", "#9333ea",
];

const HEIGHT = 190;
// Steps are integers: never put a tick at step 2.5.
const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 10000, 20000, 50000, 100000];

/** Short human number: 3 significant digits, exponent for tiny or huge magnitudes. */
export function fmtNum(v) {
  if (v == null || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  if (Number.isInteger(v)) return String(v);
  return Number(v.toPrecision(3)).toString();
}

function withAlpha(hex, alpha) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${(n >> 16) & 255}, ${(n >> 8) & 255}, ${n & 255}, ${alpha})`;
}

export class StepChart {
  /**
   * parent: element the card is appended to.
   * key: stable name, written to data-chart (tests and CSS use it).
   * stacked: draw the series as a stacked area (the legend still shows each raw value).
   */
  constructor(parent, { key, title, stacked = false, yLabel = "", height = HEIGHT }) {
    this.stacked = stacked;
    this.height = height;
    this.yLabel = yLabel;
    this.plot = null;
    this.labels = [];
    this.raw = [];
    this.card = document.createElement("section");
    this.card.className = "card chart";
    this.card.dataset.chart = key;
    this.card.dataset.points = "0";
    const head = document.createElement("h3");
    this.title = document.createElement("span");
    this.title.textContent = title;
    head.append(this.title);
    this.latest = document.createElement("span");
    this.latest.className = "latest";
    head.append(this.latest);
    this.body = document.createElement("div");
    this.body.className = "plot";
    this.empty = document.createElement("p");
    this.empty.className = "muted empty";
    this.empty.textContent = "No data yet.";
    this.body.append(this.empty);
    this.card.append(head, this.body);
    parent.append(this.card);
  }

  /**
   * steps: number[] ascending; series: [{label, values: (number|null)[]}] aligned with steps.
   * emptyText: shown while no series has a value.
   */
  update(steps, series, emptyText = "No data yet.") {
    const present = series.filter((s) => s.values.some((v) => v != null));
    this.card.dataset.points = String(present.length ? steps.length : 0);
    if (!present.length) {
      this.destroyPlot();
      this.empty.hidden = false;
      this.empty.textContent = emptyText;
      this.latest.textContent = "";
      return;
    }
    this.empty.hidden = true;
    const labels = present.map((s) => s.label);
    this.raw = present.map((s) => s.values);
    const columns = this.stacked ? cumulative(this.raw) : this.raw;
    const data = [steps, ...columns];
    if (!this.plot || labels.join("\u0000") !== this.labels.join("\u0000")) {
      this.destroyPlot();
      this.labels = labels;
      this.plot = new uPlot(this.options(labels), data, this.body);
    } else {
      this.plot.setData(data);
    }
    // Away from the cursor the legend shows each series' latest value.
    if (this.plot.cursor.idx == null) this.plot.setLegend({ idx: null });
    const last = steps.length - 1;
    this.latest.textContent = present.length === 1
      ? `${fmtNum(present[0].values[last])} at step ${steps[last]}`
      : `step ${steps[last]}`;
  }

  resize() {
    if (this.plot) this.plot.setSize({ width: this.width(), height: this.height });
  }

  width() {
    return Math.max(240, this.body.clientWidth || this.card.clientWidth - 24);
  }

  destroyPlot() {
    if (this.plot) {
      this.plot.destroy();
      this.plot = null;
      this.labels = [];
    }
  }

  options(labels) {
    const raw = () => this.raw;
    const series = labels.map((label, i) => ({
      label,
      stroke: PALETTE[i % PALETTE.length],
      width: 1.5,
      spanGaps: true,
      fill: this.stacked ? withAlpha(PALETTE[i % PALETTE.length], 0.35) : undefined,
      // The legend shows the series' own value (not the stacked sum that is drawn); with no
      // cursor on the plot, its latest one.
      value: (u, v, si, idx) => fmtNum(idx == null ? lastValue(raw()[si - 1]) : raw()[si - 1][idx]),
    }));
    const lastStep = (u) => u.data[0][u.data[0].length - 1];
    return {
      width: this.width(),
      height: this.height,
      scales: { x: { time: false }, y: { range: yRange } },
      axes: [
        { label: "step", labelSize: 18, size: 34, incrs: STEP_INCRS, grid: { stroke: "#eef0f3" } },
        {
          label: this.yLabel,
          labelSize: this.yLabel ? 18 : 0,
          size: axisSize,
          grid: { stroke: "#eef0f3" },
          values: (u, splits) => splits.map(fmtTick),
        },
      ],
      series: [
        { label: "step", value: (u, v, si, idx) => String(idx == null ? lastStep(u) ?? "–" : v) },
        ...series,
      ],
      bands: this.stacked ? labels.slice(1).map((_, i) => ({ series: [i + 2, i + 1] })) : [],
      cursor: { drag: { x: true, y: false } },
      legend: { live: true },
    };
  }
}

/** Axis ticks: like fmtNum, but a short mantissa so tiny values (KL ~ 1e-6) fit the gutter. */
function fmtTick(v) {
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(1).replace(".0e", "e");
  return fmtNum(v);
}

function axisSize(u, values) {
  const longest = Math.max(3, ...(values || []).map((v) => String(v).length));
  return 18 + 7 * longest;
}

/** A flat series gets a visible band around it instead of uPlot's 0..100 default. */
function yRange(u, min, max) {
  if (min == null || max == null) return [0, 1];
  if (min === max) return min === 0 ? [0, 1] : [min - Math.abs(min) * 0.1, max + Math.abs(max) * 0.1];
  return uPlot.rangeNum(min, max, 0.1, true);
}

function lastValue(values) {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] != null) return values[i];
  return null;
}

function cumulative(columns) {
  const out = [];
  let running = null;
  for (const col of columns) {
    running = col.map((v, i) => (running ? (running[i] ?? 0) : 0) + (v ?? 0));
    out.push(running);
  }
  return out;
}

/** Merge {name: [{step, value}]} into one x axis: the sorted union of steps, nulls for gaps. */
export function alignSeries(seriesByName, names) {
  const steps = new Set();
  for (const name of names) for (const p of seriesByName[name] || []) steps.add(p.step);
  const xs = [...steps].sort((a, b) => a - b);
  const index = new Map(xs.map((s, i) => [s, i]));
  const columns = names.map((name) => {
    const col = new Array(xs.length).fill(null);
    for (const p of seriesByName[name] || []) col[index.get(p.step)] = p.value;
    return col;
  });
  return { steps: xs, columns };
}
