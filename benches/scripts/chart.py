#!/usr/bin/env python3
"""Draws decisions/s against concurrency, tollgate vs the redis-benchmark ceiling on the same
script and server, from the CSV written by redis-compare.sh (CSV=file). One panel per policy.

Usage: benches/scripts/chart.py results.csv > docs/redis-throughput.svg
"""
import csv
import math
import sys
from collections import defaultdict

rows = list(csv.DictReader(open(sys.argv[1])))
series = defaultdict(list)  # (policy, name) -> [(tasks, value)]
for r in rows:
    t = int(r["tasks"])
    series[(r["policy"], f"tollgate, {r['connection']}")].append((t, float(r["tollgate"])))
    if r["connection"] == "multiplexed":
        series[(r["policy"], "ceiling -P 1 (same script, bare driver)")].append((t, float(r["ceiling_p1"])))
        series[(r["policy"], "ceiling -P 16 (same script, bare driver)")].append((t, float(r["ceiling_p16"])))
policies = sorted({p for p, _ in series})
colours = {"tollgate, multiplexed": "#0550ae", "tollgate, pool16": "#1a7f37",
           "ceiling -P 1 (same script, bare driver)": "#bf8700", "ceiling -P 16 (same script, bare driver)": "#cf222e"}
W, H, PW, PH, L, T = 980, 360, 280, 220, 60, 60
ymax = max(v for pts in series.values() for _, v in pts) * 1.1
tasks = sorted({int(r["tasks"]) for r in rows})
out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       '<rect width="100%" height="100%" fill="#fff"/>',
       f'<text x="{L}" y="24" font-size="15" font-weight="bold">Decisions/s against concurrency: tollgate vs the bare-driver ceiling (redis-benchmark style) on the same script and server</text>']
for i, pol in enumerate(policies):
    x0 = L + i * (PW + 40)
    def X(t):
        return x0 + PW * (math.log(t) / math.log(max(tasks))) if max(tasks) > 1 else x0
    def Y(v):
        return T + PH - PH * v / ymax
    out.append(f'<text x="{x0}" y="{T - 10}" font-weight="bold">{pol}</text>')
    out.append(f'<rect x="{x0}" y="{T}" width="{PW}" height="{PH}" fill="none" stroke="#999"/>')
    for t in tasks:
        out.append(f'<text x="{X(t):.0f}" y="{T + PH + 16}" text-anchor="middle" fill="#444">{t}</text>')
    for k in range(5):
        v = ymax * k / 4
        out.append(f'<text x="{x0 - 4}" y="{Y(v) + 4:.0f}" text-anchor="end" fill="#444" font-size="10">{v / 1000:.0f}k</text>')
    for (p, name), pts in sorted(series.items()):
        if p != pol:
            continue
        pts.sort()
        d = " ".join(f"{X(t):.1f},{Y(v):.1f}" for t, v in pts)
        dash = ' stroke-dasharray="5 3"' if name.startswith("ceiling") else ""
        out.append(f'<polyline points="{d}" fill="none" stroke="{colours[name]}" stroke-width="2"{dash}/>')
out.append(f'<text x="{L}" y="{T + PH + 36}" fill="#444">tasks (concurrent calls), log scale</text>')
for j, (name, c) in enumerate(colours.items()):
    dash = ' stroke-dasharray="5 3"' if name.startswith("ceiling") else ""
    out.append(f'<line x1="{L + j * 220}" y1="{H - 20}" x2="{L + j * 220 + 24}" y2="{H - 20}" stroke="{c}" stroke-width="2"{dash}/>'
               f'<text x="{L + j * 220 + 30}" y="{H - 16}">{name}</text>')
out.append("</svg>")
print("\n".join(out))
