"""report.html: the report as one self-contained page (inline CSS and SVG, no script, no network).

A view of the same ledger as report.json: the headline figures (plan against actual among them),
USD wasted by cause (a table and a bar chart), then charts of loss, world size, cumulative USD
against the on-demand equivalent, each VM's price over its life, a timeline of launches, joins,
notices and preemptions, and USD by cloud and region (billed against on demand) above the
breakdown tables. Charts span the page's width. Deterministic: the same ledger gives
the same bytes. Every dollar drawn is `elastic.record.billing`'s; `write_report` writes report.json and
report.html together.
"""

from __future__ import annotations

import json
import math
import os
from html import escape
from pathlib import Path

from elastic.record import billing
from elastic.record.events import (
    CapacityWaitEnded, Event, NodeLaunched, NodeNotice, NodePreempted, NodeReleased, OuterStep, ReplicaDrained,
    ReplicaJoined, ReplicaLost, RunEnded, RunStarted, Validation, read)
from elastic.record.ledger import LedgerError, read_events, SHAPE_ERRORS
from elastic.views.report import build_report, headline_rows

W, H = 1200, 300                     # chart size in SVG units; drawn at the page's full width
ML, MR, MT, MB = 72, 16, 14, 40      # margins: left (y labels), right, top, bottom (x labels)
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf"]
WASTE_COLORS = {"preemption": "#d62728", "capacity_wait": "#ff7f0e", "checkpoint_stalls": "#8c564b",
                "never_joined": "#7f7f7f", "setup_failed": "#9467bd"}
MAX_POINTS = 600                     # samples per line, so a long run's page stays small
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px 32px;color:#222}
.cols{display:flex;flex-wrap:wrap;gap:8px 48px}.cols>div{flex:1 1 480px;min-width:0}
h1{font-size:22px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 6px}
.sub{color:#666;margin:0 0 16px}table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:right}td:first-child,th:first-child{text-align:left}
.figs td:first-child{font-weight:600}.est{color:#666;font-style:italic}
svg{display:block;width:100%;height:auto;background:#fafafa;border:1px solid #ddd}svg text{font-size:13px;fill:#444}
.legend span{display:inline-block;margin-right:14px;font-size:12px}.legend i{display:inline-block;width:12px;
height:3px;vertical-align:middle;margin-right:4px}.empty{color:#888;font-style:italic}
"""


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), raw)
    start = (lo // step) * step
    out, v = [], start
    while v <= hi + step * 1e-9:
        if v >= lo - step * 1e-9:
            out.append(round(v, 10))
        v += step
    return out


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}".rstrip("0").rstrip(".")
    return f"{v:.4g}"


def color(n: int) -> str:
    """The n-th series colour: the ten of COLORS, then hues a golden angle apart (never a repeat)."""
    if n < len(COLORS):
        return COLORS[n]
    return f"hsl({(n - len(COLORS)) * 137.508 % 360:.0f},70%,{38 + 12 * (n % 3)}%)"


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    every = len(points) / MAX_POINTS
    return [points[int(i * every)] for i in range(MAX_POINTS)] + [points[-1]]


def _chart(lines: list[tuple], x_max: float, y_label: str, step: bool = False, y_zero: bool = True) -> str:
    """An SVG line chart: `lines` as (label, color, [(x seconds, y)]) or (label, color, points,
    width px, dash) (a wide dashed series drawn first stays visible under one with equal values);
    step lines hold each value until the next point. The y axis spans whole ticks around the data,
    so no point sits on the frame."""
    pts = [p for line in lines for p in line[2]]
    if not pts:
        return '<p class="empty">nothing recorded yet</p>'
    ys = [y for _, y in pts]
    y_lo, y_hi = (0.0 if y_zero else min(ys)), max(ys)
    if y_hi <= y_lo:
        y_hi = y_lo + (abs(y_lo) or 1.0)
    ticks = _nice_ticks(y_lo, y_hi)
    tick = ticks[1] - ticks[0] if len(ticks) > 1 else (y_hi - y_lo)
    y_hi = (math.floor(y_hi / tick + 1e-9) + 1) * tick       # one tick of headroom above the highest point
    if not y_zero:
        y_lo = (math.ceil(y_lo / tick - 1e-9) - 1) * tick    # and below the lowest
    x_max = x_max or 1.0
    pw, ph = W - ML - MR, H - MT - MB

    def sx(x):
        return ML + pw * min(max(x, 0.0), x_max) / x_max

    def sy(y):
        return MT + ph * (1 - (y - y_lo) / (y_hi - y_lo))

    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'viewBox="0 0 {W} {H}" role="img" aria-label="{escape(y_label)}">']
    for t in _nice_ticks(y_lo, y_hi):
        parts.append(f'<line x1="{ML}" x2="{W - MR}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#e4e4e4"/>'
                     f'<text x="{ML - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for t in _nice_ticks(0.0, x_max):
        parts.append(f'<text x="{sx(t):.1f}" y="{H - MB + 16}" text-anchor="middle">{_fmt(t)}</text>')
    parts.append(f'<text x="{ML + pw / 2:.0f}" y="{H - 4}" text-anchor="middle">seconds since run start</text>'
                 f'<text x="12" y="{MT + ph / 2:.0f}" transform="rotate(-90 12 {MT + ph / 2:.0f})" '
                 f'text-anchor="middle">{escape(y_label)}</text>'
                 f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>')
    for label, color_, ps, *style in lines:
        width, dash = (style + [2, ""])[:2] if style else (2, "")
        ps = _thin(ps)
        if step:
            ps = [q for a, b in zip(ps, ps[1:] + [None]) for q in ([a, (b[0], a[1])] if b else [a])]
        d = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(ps))
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(f'<path d="{d}" fill="none" stroke="{color_}" stroke-width="{width}"{dash_attr}>'
                     f'<title>{escape(label)}</title></path>')
        if len(ps) == 1:
            parts.append(f'<circle cx="{sx(ps[0][0]):.1f}" cy="{sy(ps[0][1]):.1f}" r="3" fill="{color_}"/>')
    parts.append("</svg>")
    legend = "".join(f'<span><i style="background:{line[1]}"></i>{escape(line[0])}</span>' for line in lines[:12])
    more = f"<span>… and {len(lines) - 12} more</span>" if len(lines) > 12 else ""
    return "".join(parts) + f'<div class="legend">{legend}{more}</div>'


def _bars(groups: list[tuple[str, list[tuple[str, str, float]]]], unit: str = "USD", width: int = W) -> str:
    """A horizontal bar chart `width` SVG units wide: `groups` as (label, [(series label, color,
    value)]), one bar per series in each group, its value written beside it (a legend when groups
    hold several series). Nothing to draw: an `empty` note."""
    values = [v for _, bars in groups for _, _, v in bars]
    if not values or max(values) <= 0:
        return '<p class="empty">nothing to chart: every figure is 0</p>'
    if unit == "USD" and max(values) < 0.00005:   # one bar would fill the width for what reads $0.0000
        return '<p class="empty">nothing to chart: every figure is under $0.0001</p>'
    bar_h, gap = 16, 10
    lw = 190                                   # label column, SVG units
    h = MT + MB // 2 + sum(len(bars) * bar_h + gap for _, bars in groups)
    pw = width - lw - 90
    top = max(values)
    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
             f'viewBox="0 0 {width} {h}" role="img" aria-label="{escape(unit)}">']
    y = MT
    for label, bars in groups:
        parts.append(f'<text x="{lw - 8}" y="{y + len(bars) * bar_h / 2 + 5:.1f}" text-anchor="end">'
                     f'{escape(label)}</text>')
        for name, color_, v in bars:
            w = pw * v / top
            parts.append(f'<rect x="{lw}" y="{y + 1}" width="{max(w, 1.5 if v > 0 else 0):.1f}" height="{bar_h - 2}" '
                         f'fill="{color_}"><title>{escape(name)}: {v:.6f} {escape(unit)}</title></rect>'
                         f'<text x="{lw + w + 6:.1f}" y="{y + bar_h - 4}">{"$" if unit == "USD" else ""}'
                         f'{v:.4f}</text>')
            y += bar_h
        y += gap
    parts.append("</svg>")
    names = {(name, c) for _, bars in groups for name, c, _ in bars}
    several = any(len(bars) > 1 for _, bars in groups)
    legend = "".join(f'<span><i style="background:{c}"></i>{escape(n)}</span>' for n, c in sorted(names)
                     if several)
    return "".join(parts) + (f'<div class="legend">{legend}</div>' if legend else "")


def _timeline(events: list[Event], vms: dict[str, billing.Hold], t0: float, x_max: float) -> str:
    """One row per VM: a bar from launch to release (colour by how it ended), with its replica's
    joins (green dots), notices (orange ticks), preemptions (red crosses); capacity waits shaded."""
    if not vms:
        return '<p class="empty">no VM rented</p>'
    row_h = 18
    h = MT + MB + row_h * len(vms)
    pw = W - ML - MR
    x_max = x_max or 1.0

    def sx(t):
        return ML + pw * min(max(t - t0, 0.0), x_max) / x_max

    rows = {iid: n for n, iid in enumerate(vms)}
    fill = {"preempted": "#d62728", "released": "#1f77b4", "held": "#7f7f7f"}
    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" '
             f'viewBox="0 0 {W} {h}" role="img" aria-label="timeline">']
    for e in events:
        if isinstance(e, CapacityWaitEnded) and e.waited_s:
            a, b = sx(e.t - e.waited_s), sx(e.t)
            parts.append(f'<rect x="{a:.1f}" y="{MT}" width="{max(b - a, 1):.1f}" height="{h - MT - MB}" '
                         f'fill="#fdecc8"><title>waiting for capacity {e.waited_s:.1f} s</title></rect>')
    for t in _nice_ticks(0.0, x_max):
        parts.append(f'<text x="{sx(t0 + t):.1f}" y="{h - MB + 16}" text-anchor="middle">{_fmt(t)}</text>')
    parts.append(f'<text x="{ML + pw / 2:.0f}" y="{h - 4}" text-anchor="middle">seconds since run start</text>')
    for iid, h in vms.items():
        y = MT + rows[iid] * row_h
        color = fill[h.ended] if h.joined else "#bbbbbb"
        a, b = sx(h.start_s), sx(h.stop_s)
        state = h.ended + ("" if h.joined else ", never joined")
        parts.append(f'<text x="{ML - 6}" y="{y + 13}" text-anchor="end">{escape(iid[-12:])}</text>'
                     f'<rect x="{a:.1f}" y="{y + 3}" width="{max(b - a, 1.5):.1f}" height="{row_h - 6}" '
                     f'fill="{color}" opacity="0.55"><title>{escape(iid)}: {escape(h.vm.instance_type)} in '
                     f'{escape(h.vm.zone)}, {state}, {h.stop_s - h.start_s:.1f} s</title></rect>')
    for e in events:
        if not isinstance(e, (ReplicaJoined, NodeNotice, NodePreempted)) or e.instance_id not in rows:
            continue
        x, y = sx(e.t), MT + rows[e.instance_id] * row_h + row_h / 2
        if isinstance(e, ReplicaJoined):
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="#2ca02c"><title>replica {e.replica} '
                         f'joined at outer step {e.outer_step or 0}</title></circle>')
        elif isinstance(e, NodeNotice):
            parts.append(f'<path d="M{x:.1f},{y - 7:.1f}L{x:.1f},{y + 7:.1f}" stroke="#ff7f0e" stroke-width="3">'
                         f'<title>preemption notice</title></path>')
        else:
            parts.append(f'<path d="M{x - 5:.1f},{y - 5:.1f}L{x + 5:.1f},{y + 5:.1f}M{x - 5:.1f},{y + 5:.1f}'
                         f'L{x + 5:.1f},{y - 5:.1f}" stroke="#d62728" stroke-width="2.5"><title>preempted</title></path>')
    parts.append("</svg>")
    legend = ('<div class="legend"><span><i style="background:#1f77b4"></i>released</span>'
              '<span><i style="background:#d62728"></i>preempted</span><span><i style="background:#7f7f7f"></i>'
              'held</span><span><i style="background:#bbbbbb"></i>never joined</span><span>'
              '<i style="background:#2ca02c"></i>replica joined</span><span><i style="background:#ff7f0e"></i>'
              'notice</span><span><i style="background:#fdecc8"></i>waiting for capacity</span></div>')
    return "".join(parts) + legend


def _series(events: list[Event], vms: dict[str, billing.Hold], t0: float, end: float):
    loss, world, held = [], [], []
    replicas = nodes = 0
    for e in events:
        x = e.t - t0
        if isinstance(e, OuterStep) and e.losses:
            loss.append((x, sum(e.losses) / len(e.losses)))
        if isinstance(e, ReplicaJoined):
            replicas += 1
        elif isinstance(e, ReplicaDrained) or (isinstance(e, ReplicaLost) and e.phase != "setup"):
            replicas = max(0, replicas - 1)
        elif isinstance(e, NodeLaunched):
            nodes += 1
        elif isinstance(e, (NodeReleased, NodePreempted)):
            nodes = max(0, nodes - 1)
        else:
            continue
        world.append((x, replicas))
        held.append((x, nodes))
    usd, od = billing.cumulative(vms, t0, end)
    if world:
        world.append((end - t0, world[-1][1]))
        held.append((end - t0, held[-1][1]))
    return loss, world, held, usd, od


def _table(rows: list[tuple[str, str]], cls: str = "figs") -> str:
    return f'<table class="{cls}">' + "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>"
                                              for k, v in rows) + "</table>"


def _breakdown_table(name: str, rows: dict) -> str:
    head = (f"<tr><th>{escape(name)}</th><th>VMs</th><th>VM-hours</th><th>GPU-hours</th><th>USD</th>"
            "<th>on-demand USD</th></tr>")
    body = "".join(f"<tr><td>{escape(k)}</td><td>{r['instances']}</td><td>{r['seconds'] / 3600:.3f}</td>"
                   f"<td>{r['gpu_hours']:.3f}</td><td>${r['cost_usd']:.4f}</td>"
                   f"<td>${r['on_demand_equivalent_usd']:.4f}</td></tr>" for k, r in rows.items())
    return f"<table>{head}{body}</table>"


def render_html(records: list[dict], report: dict) -> str:
    """The whole page for a run's ledger records (`read_events`) and its report (from
    `build_report(records)`)."""
    events = read(records)
    start = next((e for e in events if isinstance(e, RunStarted)), None)
    end_ev = next((e for e in reversed(events) if isinstance(e, RunEnded)), None)
    t0 = start.t if start else (events[0].t if events else 0.0)
    end = end_ev.t if end_ev else (events[-1].t if events else t0)
    vms = billing.holds(events, end)
    x_max = max([end - t0] + [h.stop_s - t0 for h in vms.values()])
    loss, world, held, usd, od = _series(events, vms, t0, end)
    val = [(e.t - t0, e.loss) for e in events if isinstance(e, Validation)]
    prices = [(f"{iid} ({h.vm.instance_type}, {h.vm.zone})", color(n),
               [(t - t0, p) for t, p in h.segments] + [(h.stop_s - t0, h.segments[-1][1])])
              for n, (iid, h) in enumerate(vms.items())]
    waste = report["wasted_usd"]
    est = report["estimates"]
    title = f"elastic run {report['run'] or '(unnamed)'}"
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="sub">status <b>{escape(report["status"])}</b> · recipe digest '
        f'{escape(str(report["recipe_digest"]))} · built from events.jsonl</p>',
        _table(headline_rows(report)),
        "<h2>USD wasted, by cause</h2>",
        '<div class="cols"><div>',
        _table([(k.replace("_", " "), f"${waste[k]:.4f}") for k in waste]),
        "</div><div>",
        _bars([(k.replace("_", " "), [(k.replace("_", " "), WASTE_COLORS[k], waste[k])]) for k in WASTE_COLORS],
              width=640),
        "</div></div>",
        "<h2>Estimates (not billed by the VM figures above)</h2>",
        _table([("checkpoint bytes written", f"{est['checkpoint_bytes_written']:,}"),
                ("checkpoint storage", f"${est['checkpoint_storage_usd']:.6f}"),
                ("cross-region sync bytes", f"{est['cross_region_sync_bytes']:,}"),
                ("egress", f"${est['egress_usd']:.6f}")], cls="figs est"),
        "<h2>Loss over time</h2>",
        _chart([("mean loss of the outer step's inner steps", COLORS[0], loss)]
               + [("validation loss (θ_outer)", COLORS[1], val)] * bool(val), x_max, "loss (nats/token)",
               y_zero=False),
        "<h2>World size over time</h2>",
        _chart([("VMs held", COLORS[4], held, 6, "10 5"), ("replicas in the world", COLORS[2], world, 2, "")],
               x_max, "count", step=True),
        "<h2>Cumulative USD against the on-demand equivalent</h2>",
        _chart([("billed", COLORS[0], usd), ("same VM-seconds on demand", COLORS[3], od)], x_max, "USD"),
        "<h2>Each VM's price over its life</h2>",
        _chart(prices, x_max, "USD per hour", step=True, y_zero=False),
        "<h2>Timeline: VMs, joins, notices and preemptions</h2>",
        _timeline(events, vms, t0, x_max),
        "<h2>USD by cloud and region, billed against on demand</h2>",
        _bars([(f"{kind} {k}", [("billed", COLORS[0], r["cost_usd"]),
                                ("same VM-seconds on demand", COLORS[3], r["on_demand_equivalent_usd"])])
               for kind, rows in (("cloud", report["by_cloud"]), ("region", report["by_region"]))
               for k, r in rows.items()]),
        "<h2>By cloud</h2>", _breakdown_table("cloud", report["by_cloud"]),
        "<h2>By region</h2>", _breakdown_table("region", report["by_region"]),
        "<h2>By instance type</h2>", _breakdown_table("instance type", report["by_instance_type"]),
    ]
    if report["errors"]:
        body.append("<h2>Errors</h2><ul>" + "".join(f"<li>{escape(m)}</li>" for m in report["errors"]) + "</ul>")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(run_dir: str | Path) -> dict:
    """Rebuild `report.json` and `report.html` in `run_dir` from its ledger (each an atomic replace)."""
    run_dir = Path(run_dir)
    return write_report_of(read_events(run_dir / "events.jsonl"), run_dir, str(run_dir / "events.jsonl"))


def write_report_of(events: list[dict], out_dir: Path, source: str) -> dict:
    """Write `report.json` and `report.html` of a ledger's records into `out_dir` (each an atomic
    replace); `source` names the ledger in errors."""
    try:
        report = build_report(events)
    except SHAPE_ERRORS as exc:
        raise LedgerError(f"{source}: an event is not of the shape elastic writes "
                          f"({type(exc).__name__}: {str(exc)[:80]})") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("report.json", json.dumps(report, indent=2) + "\n"),
                       ("report.html", render_html(events, report))):
        tmp = out_dir / f"{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out_dir / name)
    return report
