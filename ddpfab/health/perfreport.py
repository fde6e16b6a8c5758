"""The ``check --perf`` report as pictures: a per-node bar chart and a node x node bandwidth heat
map, as standalone SVG files and one HTML page that holds both, the table and the verdict.

Standard library only (no matplotlib on the controller): SVG is text. Input is the
:meth:`ddpfab.health.perf.PerfResult.to_dict` of a check, so a stored ``perf.json`` renders again later.
"""

from __future__ import annotations

import html
import itertools
import math
import time
from pathlib import Path

#: bar colours per metric, and the threshold line's
COLORS = {"compute": "#4e79a7", "memory": "#59a14f", "link": "#f28e2b"}
SLOW = "#e15759"


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def bars_svg(result: dict) -> str:
    """Per node, its compute, memory and link figures as a fraction of the cluster's median (1.0 =
    the median), with the thresholds drawn; bars under their threshold are red."""
    nodes = result["nodes"]
    figs = result["node_figures"]
    th = result.get("thresholds", {})
    metrics = [("compute", "compute_ratio", th.get("compute_min", 0.4)),
               ("memory", "memory_ratio", th.get("memory_min", 0.5)),
               ("link", "link_ratio", th.get("link_min", 0.2))]
    top = max([1.5] + [min(figs[n][k] or 0, 3.0) for n in nodes for _, k, _ in metrics])
    group_w, bar_w, left, plot_h, top_pad = 3 * 18 + 16, 18, 60, 220, 40
    width = max(560, left + max(1, len(nodes)) * group_w + 20)
    height = top_pad + plot_h + 70

    def y(v: float) -> float:
        return top_pad + plot_h - min(v, top) / top * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="16" font-size="13" font-weight="bold">Per node, x the cluster median '
           f'(red: under its threshold)</text>']
    for tick in (0, 0.5, 1.0, 1.5, 2.0, 3.0):
        if tick <= top:
            out.append(f'<line x1="{left}" x2="{width - 10}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#ddd"/>'
                       f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}x</text>')
    for gi, n in enumerate(nodes):
        x0 = left + gi * group_w + 8
        for mi, (label, key, limit) in enumerate(metrics):
            v = figs[n].get(key)
            x = x0 + mi * bar_w
            if v is None:
                continue
            color = SLOW if v < limit else COLORS[label]
            out.append(f'<rect x="{x}" y="{y(v):.1f}" width="{bar_w - 3}" height="{y(0) - y(v):.1f}" '
                       f'fill="{color}"><title>{_esc(n)} {label}: {v:.3g}x of median</title></rect>')
            out.append(f'<line x1="{x - 1}" x2="{x + bar_w - 2}" y1="{y(limit):.1f}" y2="{y(limit):.1f}" '
                       f'stroke="#333" stroke-dasharray="2,2"/>')
            if v < limit:  # a slow bar may be too short to see: say its value
                out.append(f'<text x="{x + bar_w / 2 - 1:.1f}" y="{y(v) - 3:.1f}" text-anchor="middle" font-size="9" '
                           f'fill="{SLOW}">{f"{v:.2f}x" if v >= 0.01 else "&lt;0.01x"}</text>')
        weight = "bold" if n in result.get("stragglers", []) else "normal"
        fill = SLOW if n in result.get("stragglers", []) else "#000"
        out.append(f'<text x="{x0 + 1.5 * bar_w:.1f}" y="{y(0) + 14:.1f}" text-anchor="middle" '
                   f'font-weight="{weight}" fill="{fill}">{_esc(n)}</text>')
    lx = left
    for label, _, _ in metrics:
        out.append(f'<rect x="{lx}" y="{height - 22}" width="10" height="10" fill="{COLORS[label]}"/>'
                   f'<text x="{lx + 14}" y="{height - 13}">{label}</text>')
        lx += 80
    out.append(f'<line x1="{lx}" x2="{lx + 18}" y1="{height - 17}" y2="{height - 17}" stroke="#333" '
               f'stroke-dasharray="2,2"/><text x="{lx + 22}" y="{height - 13}">threshold</text>')
    out.append("</svg>")
    return "\n".join(out)


def _heat(frac: float) -> str:
    """0 (slowest) red .. 1 (fastest) blue-green, through yellow."""
    frac = max(0.0, min(1.0, frac))
    stops = [(0.0, (215, 48, 39)), (0.5, (254, 224, 144)), (1.0, (69, 117, 180))]
    for (f0, c0), (f1, c1) in itertools.pairwise(stops):
        if frac <= f1:
            t = (frac - f0) / (f1 - f0)
            return "#" + "".join(f"{round(a + (b - a) * t):02x}" for a, b in zip(c0, c1, strict=True))
    return "#4575b4"


def heatmap_svg(result: dict) -> str:
    """Node x node link bandwidth (GB/s, colour on a log scale between the slowest and fastest
    link); grey: not measured (sampled schedule above the all-pairs size)."""
    nodes = result["nodes"]
    links = result["links"]
    vals = [v["gbs"] for v in links.values() if v["gbs"] > 0]
    lo, hi = (min(vals), max(vals)) if vals else (1.0, 1.0)
    span = math.log10(hi) - math.log10(lo) if hi > lo else 1.0
    cell = max(14, min(48, 640 // max(1, len(nodes))))
    left = top = 20 + 7 * max([4] + [len(n) for n in nodes])
    width, height = left + cell * len(nodes) + 150, top + cell * len(nodes) + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           '<text x="4" y="14" font-size="13" font-weight="bold">Link bandwidth, GB/s (node x node)</text>']
    show_values = cell >= 36
    for i, a in enumerate(nodes):
        out.append(f'<text x="{left - 4}" y="{top + i * cell + cell / 2 + 4:.1f}" text-anchor="end">{_esc(a)}</text>')
        out.append(f'<text transform="translate({left + i * cell + cell / 2 + 4:.1f},{top - 4}) rotate(-60)">'
                   f'{_esc(a)}</text>')
        for j, b in enumerate(nodes):
            x, yy = left + j * cell, top + i * cell
            v = links.get(f"{a}--{b}") or links.get(f"{b}--{a}")
            if i == j:
                out.append(f'<rect x="{x}" y="{yy}" width="{cell}" height="{cell}" fill="#fff" stroke="#eee"/>')
                continue
            if v is None:
                out.append(f'<rect x="{x}" y="{yy}" width="{cell}" height="{cell}" fill="#ccc" stroke="#fff">'
                           f'<title>{_esc(a)}--{_esc(b)}: not measured</title></rect>')
                continue
            frac = (math.log10(max(v["gbs"], lo)) - math.log10(lo)) / span if hi > lo else 1.0
            out.append(f'<rect x="{x}" y="{yy}" width="{cell}" height="{cell}" fill="{_heat(frac)}" stroke="#fff">'
                       f'<title>{_esc(a)}--{_esc(b)}: {v["gbs"]:.4g} GB/s ({v.get("ratio", 1):.3g}x of median), '
                       f'{v["lat_us"]:.4g} us</title></rect>')
            if show_values:
                out.append(f'<text x="{x + cell / 2:.1f}" y="{yy + cell / 2 + 4:.1f}" text-anchor="middle" '
                           f'font-size="9">{v["gbs"]:.2g}</text>')
    lx = left + cell * len(nodes) + 16
    for k in range(11):
        frac = 1 - k / 10
        value = 10 ** (math.log10(lo) + frac * span) if hi > lo else hi
        out.append(f'<rect x="{lx}" y="{top + k * 14}" width="14" height="14" fill="{_heat(frac)}"/>')
        if k % 5 == 0:
            out.append(f'<text x="{lx + 18}" y="{top + k * 14 + 11}">{value:.3g}</text>')
    out.append("</svg>")
    return "\n".join(out)


def page(record: dict, table: str) -> str:
    """One self-contained HTML page: verdict, both figures, the terminal table, the raw figures."""
    result = record["result"]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["time"]))
    verdict = ("".join(f"<li>{_esc(f['text'])}</li>" for f in result["findings"])
               or "<li>no straggler</li>")
    status = "stragglers found" if result["findings"] else "healthy"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>ddpfab perf check {_esc(record['run_id'])}: {status}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} pre{{background:#f6f6f6;padding:1em;overflow:auto}}
li{{margin:.3em 0}}</style></head><body>
<h1>ddpfab perf check: {status}</h1>
<p>run {_esc(record['run_id'])}, {_esc(when)}, {len(result['nodes'])} nodes, inventory {_esc(record.get('inventory', ''))}</p>
<h2>Verdict</h2><ul>{verdict}</ul>
<h2>Per node</h2>
{bars_svg(result)}
<h2>Links</h2>
{heatmap_svg(result)}
<h2>Table</h2><pre>{_esc(table)}</pre>
</body></html>
"""


def write(run_dir: Path, record: dict, table: str) -> dict[str, Path]:
    """Write ``report.html``, ``nodes.svg`` and ``links.svg`` into *run_dir*; return their paths."""
    paths = {"html": run_dir / "report.html", "nodes_svg": run_dir / "nodes.svg", "links_svg": run_dir / "links.svg"}
    paths["html"].write_text(page(record, table), encoding="utf-8")
    paths["nodes_svg"].write_text(bars_svg(record["result"]), encoding="utf-8")
    paths["links_svg"].write_text(heatmap_svg(record["result"]), encoding="utf-8")
    return paths
