"""Inline SVG for the dashboard: the checkpoint timeline and the lineage graph.

Plain strings, every text escaped; a ``<title>`` on each mark is its tooltip.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from html import escape

from markupsafe import Markup

from .views import CheckpointView, LineageNode

CHECKPOINT_COLOURS = {
    "registered": "#c9a227",
    "uploading": "#e0a800",
    "durable": "#2e7d32",
    "replicated": "#1b5e20",
    "failed": "#c62828",
    "corrupt": "#ad1457",
    "deleted": "#9e9e9e",
}
REPLICA_COLOURS = {
    "committed": "#2e7d32",
    "pending": "#f0a500",
    "corrupt": "#c62828",
    "deleted": "#bdbdbd",
}
MISSING = "#e0e0e0"
WIDTH = 960
LEFT = 110
RIGHT = 20


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def size(value: int) -> str:
    """Bytes with SI prefixes and one decimal, as the CLI writes them."""
    if value == 1:
        return "1 byte"
    if value < 1000:
        return f"{value:,} bytes"
    suffixes = ("kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    exponent = 2  # of the first unit the value is below
    while exponent <= len(suffixes) and value >= 1000**exponent:
        exponent += 1
    return f"{1000 * value / 1000**exponent:,.1f} {suffixes[exponent - 2]}"


class _Scale:
    """Time → x, spreading marks evenly when they all share one instant."""

    def __init__(self, times: Sequence[datetime], left: float, right: float) -> None:
        self.left, self.right = left, right
        self.start = min(times) if times else datetime(1970, 1, 1)
        self.end = max(times) if times else self.start
        self.span = (self.end - self.start).total_seconds()

    def x(self, when: datetime) -> float:
        if self.span <= 0:
            return (self.left + self.right) / 2
        fraction = (when - self.start).total_seconds() / self.span
        return self.left + fraction * (self.right - self.left)

    def ticks(self, count: int = 5) -> list[tuple[float, str]]:
        if self.span <= 0:
            return [(self.x(self.start), self.start.strftime("%H:%M:%S"))]
        fmt = "%H:%M:%S" if self.span < 86400 else "%m-%d %H:%M"
        out: list[tuple[float, str]] = []
        for i in range(count):
            when = self.start + timedelta(seconds=self.span * i / (count - 1))
            label = when.strftime(fmt)
            if not out or out[-1][1] != label:  # a short span repeats labels
                out.append((self.x(when), label))
        return out


def timeline(checkpoints: Sequence[CheckpointView], regions: Sequence[str]) -> Markup:
    """Step over time (top) and one lane per region below it, each checkpoint
    a mark coloured by the state of its copy in that region."""
    shown = sorted(checkpoints, key=lambda c: (c.created_at, c.step))
    chart_top, chart_height = 24, 150
    lane_top = chart_top + chart_height + 26
    lane_height = 30
    height = lane_top + lane_height * len(regions) + 58
    right = WIDTH - RIGHT
    scale = _Scale([c.created_at for c in shown], LEFT + 10, right - 10)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" role="img" '
        f'viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
        f'aria-label="checkpoint timeline">',
        f'<text x="{LEFT}" y="14" class="axis-title">step over time '
        f"(UTC, registration time)</text>",
        f'<rect x="{LEFT}" y="{chart_top}" width="{right - LEFT}" height="{chart_height}" '
        'class="plot"/>',
    ]
    if not shown:
        parts.append(
            f'<text x="{(LEFT + right) / 2}" y="{chart_top + chart_height / 2}" '
            'text-anchor="middle" class="muted">no checkpoints yet</text></svg>'
        )
        return Markup("".join(parts))

    low = min(c.step for c in shown)
    high = max(c.step for c in shown)

    def y(step: int) -> float:
        if high == low:
            return chart_top + chart_height / 2
        return chart_top + chart_height - 10 - (step - low) / (high - low) * (chart_height - 20)

    # Grid first, so the marks are drawn over it.
    axis_y = lane_top + lane_height * len(regions) + 4
    for x, text in scale.ticks():
        parts.append(
            f'<line x1="{x:.1f}" y1="{chart_top}" x2="{x:.1f}" y2="{axis_y}" class="grid"/>'
            f'<text x="{x:.1f}" y="{axis_y + 14}" text-anchor="middle" class="tick">'
            f"{_e(text)}</text>"
        )
    for step in sorted({low, high, (low + high) // 2}):
        parts.append(
            f'<text x="{LEFT - 6}" y="{y(step) + 4:.1f}" text-anchor="end" class="tick">'
            f"{step}</text>"
        )
    by_step = sorted(shown, key=lambda c: c.step)
    points = " ".join(f"{scale.x(c.created_at):.1f},{y(c.step):.1f}" for c in by_step)
    parts.append(f'<polyline points="{points}" class="trend"/>')
    for c in shown:
        colour = CHECKPOINT_COLOURS.get(c.state, "#607d8b")
        parts.append(
            f'<circle cx="{scale.x(c.created_at):.1f}" cy="{y(c.step):.1f}" r="5" '
            f'fill="{colour}" class="ckpt" data-step="{c.step}" data-state="{_e(c.state)}">'
            f"<title>step {c.step}: {_e(c.state)} · {c.created_at:%Y-%m-%d %H:%M:%S}Z</title>"
            "</circle>"
        )

    mark_width = max(3.0, min(14.0, (right - LEFT - 20) / max(len(shown), 1) * 0.7))
    for row, region in enumerate(regions):
        top = lane_top + row * lane_height
        label = f"{region} (primary)" if row == 0 else region
        parts.append(
            f'<rect x="{LEFT}" y="{top}" width="{right - LEFT}" height="{lane_height - 6}" '
            f'class="lane"/><text x="{LEFT - 6}" y="{top + 16}" text-anchor="end" '
            f'class="lane-label">{_e(label)}</text>'
        )
        for c in shown:
            replica = c.replicas.get(region)
            state = replica.state if replica is not None else "none"
            colour = REPLICA_COLOURS.get(state, MISSING)
            detail = f"step {c.step} in {region}: {state}"
            extra = ""
            if replica is not None and replica.lag is not None:
                waited = "waiting" if state == "pending" else "lag"
                detail += f" · {waited} {duration(replica.lag)}"
            if replica is not None and replica.retrying:
                detail += f" · retrying (attempt {replica.attempts}): {replica.retrying[:200]}"
                extra = ' stroke="#c62828" stroke-width="2" stroke-dasharray="3 2"'
            elif replica is not None and replica.error:
                detail += f" · {replica.error[:200]}"
            parts.append(
                f'<rect x="{scale.x(c.created_at) - mark_width / 2:.1f}" y="{top + 3}" '
                f'width="{mark_width:.1f}" height="{lane_height - 12}" rx="2" fill="{colour}"'
                f'{extra} class="replica" data-region="{_e(region)}" data-step="{c.step}" '
                f'data-state="{_e(state)}"><title>{_e(detail)}</title></rect>'
            )

    legend_y = axis_y + 40
    x = LEFT
    for name, colour in (*REPLICA_COLOURS.items(), ("not in region", MISSING)):
        parts.append(
            f'<rect x="{x}" y="{legend_y - 10}" width="12" height="12" fill="{colour}"/>'
            f'<text x="{x + 16}" y="{legend_y}" class="tick">{_e(name)}</text>'
        )
        x += 24 + 7 * len(name)
    pending = REPLICA_COLOURS["pending"]
    parts.append(
        f'<rect x="{x}" y="{legend_y - 10}" width="12" height="12" fill="{pending}" '
        'stroke="#c62828" stroke-width="2" stroke-dasharray="3 2"/>'
        f'<text x="{x + 16}" y="{legend_y}" class="tick">pending, retrying after errors</text>'
    )
    parts.append("</svg>")
    return Markup("".join(parts))


def lineage(
    nodes: Sequence[LineageNode],
    edges: Sequence[tuple[tuple[str, int], tuple[str, int]]],
    run: str,
) -> Markup:
    """One row per run (this run first), nodes in time order, parent → child."""
    if not nodes:
        return Markup('<p class="muted">no checkpoints</p>')
    rows = [run, *sorted({n.run for n in nodes} - {run})]
    row_height = 56
    height = 30 + row_height * len(rows)
    # Parents outside this catalog have no time: just before their first child.
    children: dict[tuple[str, int], list[datetime]] = {}
    known = {(n.run, n.step): n for n in nodes}
    for parent, child in edges:
        child_node = known.get(child)
        if child_node is not None and child_node.created_at is not None:
            children.setdefault(parent, []).append(child_node.created_at)

    def when(node: LineageNode) -> datetime:
        if node.created_at is not None:
            return node.created_at
        later = children.get((node.run, node.step))
        return min(later) - timedelta(microseconds=1) if later else datetime(1970, 1, 1)

    ordered = sorted(nodes, key=lambda n: (when(n), n.run, n.step))
    right = WIDTH - RIGHT
    step_x = (right - LEFT - 30) / max(len(ordered) - 1, 1)
    position = {
        (n.run, n.step): (
            LEFT + 15 + i * step_x if len(ordered) > 1 else (LEFT + right) / 2,
            30 + rows.index(n.run) * row_height + row_height / 2 - 8,
        )
        for i, n in enumerate(ordered)
    }
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="lineage" role="img" '
        f'viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
        'aria-label="lineage graph"><defs><marker id="arrow" viewBox="0 0 10 10" refX="10" '
        'refY="5" markerWidth="6" markerHeight="6" orient="auto-start-reverse">'
        '<path d="M 0 0 L 10 5 L 0 10 z" fill="#78909c"/></marker></defs>',
    ]
    for i, name in enumerate(rows):
        top = 30 + i * row_height
        parts.append(
            f'<rect x="{LEFT}" y="{top}" width="{right - LEFT}" height="{row_height - 8}" '
            f'class="lane"/><text x="{LEFT - 6}" y="{top + row_height / 2 - 4}" '
            f'text-anchor="end" class="lane-label">{_e(name)}</text>'
        )
    for parent, child in edges:
        if parent not in position or child not in position:
            continue
        (x1, y1), (x2, y2) = position[parent], position[child]
        if y1 == y2:
            path = f"M {x1 + 7:.1f} {y1:.1f} L {x2 - 7:.1f} {y2:.1f}"
        else:
            middle = (x1 + x2) / 2
            path = (
                f"M {x1:.1f} {y1 + (7 if y2 > y1 else -7):.1f} C {middle:.1f} {y1:.1f}, "
                f"{middle:.1f} {y2:.1f}, {x2 - 7:.1f} {y2:.1f}"
            )
        parts.append(f'<path d="{path}" class="edge" marker-end="url(#arrow)"/>')
    for node in ordered:
        x, y = position[(node.run, node.step)]
        colour = CHECKPOINT_COLOURS.get(node.state or "", "#ffffff")
        state = node.state or "not in this catalog"
        link_open = link_close = ""
        if node.state is not None:
            link_open = f'<a href="/ui/runs/{_e(node.run)}#step-{node.step}">'
            link_close = "</a>"
        parts.append(
            f'{link_open}<circle cx="{x:.1f}" cy="{y:.1f}" r="7" fill="{colour}" class="node" '
            f'data-run="{_e(node.run)}" data-step="{node.step}"><title>{_e(node.run)}:'
            f"{node.step} — {_e(state)}</title></circle>{link_close}"
            f'<text x="{x:.1f}" y="{y + 20:.1f}" text-anchor="middle" class="tick">'
            f"{node.step}</text>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))
