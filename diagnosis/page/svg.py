"""Inline SVG plots for the incident page, drawn from numpy arrays (no plotting library: the
page must be one self-contained file).

`progress_heatmap`: ranks × time, each cell the ops a rank completed in one time bin. Peers are
drawn in blues, culprit ranks in reds on their own rows with a red outline and label, so a rank
that stopped (a hang) or slowed (a straggler) stands out against the band of its peers; a line
marks the onset. Above `MAX_ROWS` ranks, peers are drawn in bands (each band the mean of its
ranks) while every culprit keeps its own row.

`stage_bars`: the culprit's stage shares (its mean time per stage over its mean step) against
the median peer's, as two stacked bars.
"""

from __future__ import annotations

from html import escape

import numpy as np

CULPRIT = "#d62728"
PEER = (31, 78, 156)
CULPRIT_RGB = (214, 39, 40)
MAX_ROWS = 256
STAGE_COLOURS = ("#8c564b", "#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#7f7f7f")


def _shade(v: float, rgb: tuple[int, int, int]) -> str:
    v = min(1.0, max(0.0, v))
    r, g, b = (round(255 - (255 - c) * v) for c in rgb)
    return f"#{r:02x}{g:02x}{b:02x}"


def _rows(progress: np.ndarray, culprits: set[int]) -> list[tuple[str, np.ndarray, bool]]:
    """(label, values per bin, is culprit) per drawn row, in rank order."""
    world = progress.shape[0]
    if world <= MAX_ROWS:
        return [(f"rank {r}", progress[r].astype(float), r in culprits) for r in range(world)]
    band = -(-world // (MAX_ROWS - len(culprits)))
    out: list[tuple[str, np.ndarray, bool]] = []
    for lo in range(0, world, band):
        hi = min(world, lo + band)
        peers = [r for r in range(lo, hi) if r not in culprits]
        if peers:
            out.append((f"ranks {lo}-{hi - 1}", progress[peers].mean(axis=0), False))
        out += [(f"rank {r}", progress[r].astype(float), True) for r in range(lo, hi)
                if r in culprits]
    return out


def progress_heatmap(progress: np.ndarray, culprits: list[int], t0_ns: int, bin_ns: int,
                     onset_ns: int) -> str:
    rows = _rows(progress, set(culprits))
    n_rows, n_bins = len(rows), progress.shape[1]
    cell_w = 12
    cell_h = max(3, min(14, 640 // max(1, n_rows)))
    culprit_h = max(cell_h, 10)  # a culprit's row stays readable among thin peer rows
    heights = [culprit_h if c else cell_h for _l, _v, c in rows]
    ys = np.concatenate([[0], np.cumsum(heights)]).tolist()
    left, top = 96, 24
    bottom = top + ys[-1]
    width, height = left + n_bins * cell_w + 20, bottom + 40
    nz = progress[progress > 0]
    vmax = float(np.percentile(nz, 95)) if nz.size else 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="completed ops per rank '
             'and time" class="heatmap">']
    labels: list[tuple[float, str, bool]] = []
    for i, (label, values, culprit) in enumerate(rows):
        y, h = top + ys[i], heights[i]
        rgb = CULPRIT_RGB if culprit else PEER
        for j in range(n_bins):
            v = float(values[j]) / vmax if vmax else 0.0
            if v <= 0 and not culprit:
                continue
            parts.append(f'<rect x="{left + j * cell_w}" y="{y}" width="{cell_w}" '
                         f'height="{h}" fill="{_shade(max(v, 0.0), rgb)}"/>')
        if culprit:
            parts.append(f'<rect class="culprit-row" x="{left}" y="{y}" '
                         f'width="{n_bins * cell_w}" height="{h}" fill="none" '
                         f'stroke="{CULPRIT}" stroke-width="1.5"><title>{escape(label)} '
                         '(culprit)</title></rect>')
        labels.append((y + h / 2 + 3.5, label, culprit))
    # every culprit is labelled; peers where a label fits (11 px from any other)
    taken = [y for y, _l, c in labels if c]
    for y, label, culprit in labels:
        if not culprit and any(abs(y - t) < 11 for t in taken):
            continue
        if not culprit:
            taken.append(y)
        colour, weight = (CULPRIT, "bold") if culprit else ("#444", "normal")
        parts.append(f'<text x="{left - 6}" y="{y:.1f}" font-size="10" text-anchor="end" '
                     f'fill="{colour}" font-weight="{weight}">{escape(label)}</text>')
    x_on = left + (onset_ns - t0_ns) / bin_ns * cell_w
    parts.append(f'<line x1="{x_on:.1f}" y1="{top - 6}" x2="{x_on:.1f}" y2="{bottom + 4}" '
                 'stroke="#111" stroke-width="1.5" stroke-dasharray="4 3"/>')
    parts.append(f'<text x="{x_on:.1f}" y="{top - 9}" font-size="11" text-anchor="middle">'
                 'onset</text>')
    step_s = max(1, round(n_bins * bin_ns / 1e9 / 6))
    t_first = t0_ns - onset_ns
    for s in range(int(np.ceil(t_first / 1e9 / step_s)) * step_s,
                   int((t_first + n_bins * bin_ns) / 1e9) + 1, step_s):
        x = left + (s * 1e9 - t_first) / bin_ns * cell_w
        parts.append(f'<text x="{x:.1f}" y="{bottom + 16}" font-size="10" '
                     f'text-anchor="middle">{s:+d} s</text>')
    parts.append(f'<text x="{left}" y="{bottom + 32}" font-size="11" fill="#444">time from '
                 'onset · colour: ops completed per bin (blue: peers, red: culprit)</text>')
    parts.append("</svg>")
    return "".join(parts)


def stage_shares(stages: dict[int, np.ndarray], culprits: list[int]
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """(culprit shares, median peer shares), each summing to 1; None without stage records for
    both a culprit and a peer."""
    def shares(x: np.ndarray) -> np.ndarray:
        t = float(x.sum())
        return x / t if t > 0 else np.zeros_like(x)

    cul = [stages[r] for r in culprits if r in stages]
    peers = [v for r, v in stages.items() if r not in culprits]
    if not cul or not peers:
        return None
    return shares(np.mean(cul, axis=0)), shares(np.median(np.stack(peers), axis=0))


def stage_bars(culprit: np.ndarray, peers: np.ndarray, names: tuple[str, ...]) -> str:
    width, bar_w, left = 720, 560, 110
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="120" '
             'viewBox="0 0 720 120" role="img" aria-label="stage shares" class="stages">']
    for row, (label, shares) in enumerate((("culprit", culprit), ("median peer", peers))):
        y = 10 + row * 34
        colour = CULPRIT if row == 0 else "#444"
        parts.append(f'<text x="{left - 8}" y="{y + 17}" font-size="12" text-anchor="end" '
                     f'fill="{colour}">{label}</text>')
        x = float(left)
        for i, s in enumerate(shares):
            w = float(s) * bar_w
            if w <= 0:
                continue
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="24" '
                         f'fill="{STAGE_COLOURS[i % len(STAGE_COLOURS)]}"><title>'
                         f'{escape(names[i])}: {s:.0%}</title></rect>')
            if w > 34:
                parts.append(f'<text x="{x + w / 2:.1f}" y="{y + 16}" font-size="10" '
                             f'fill="#fff" text-anchor="middle">{s:.0%}</text>')
            x += w
    for i, name in enumerate(names):
        x = left + i * 95
        parts.append(f'<rect x="{x}" y="88" width="10" height="10" '
                     f'fill="{STAGE_COLOURS[i % len(STAGE_COLOURS)]}"/><text x="{x + 14}" '
                     f'y="97" font-size="10">{escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)
