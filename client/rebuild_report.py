"""The people's form of a catalog rebuild's report (`tierckpt rebuild-catalog`
without ``--json``): one row per checkpoint, one column per region, then the
problems and the totals.

The report comes from the service (``tierckpt.service.rebuild``), which runs
in the same process for this command; the service itself renders nothing.
"""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from tierckpt.service.rebuild.report import (
    CORRUPT,
    KEPT,
    MISSING,
    UNREACHABLE,
    UNVERIFIED,
    VERIFIED,
    RebuildReport,
)

_STYLE = {
    VERIFIED: "green",
    CORRUPT: "red",
    MISSING: "yellow",
    UNVERIFIED: "yellow",
    UNREACHABLE: "red",
    KEPT: "dim",
    "durable": "green",
    "replicated": "green",
    "corrupt": "red",
    "uploading": "yellow",
}


def print_report(report: RebuildReport) -> None:
    Console(highlight=False).print(render_report(report))


def render_report(report: RebuildReport) -> RenderableType:
    """The human summary: one row per checkpoint, one column per region."""
    table = Table(title="catalog rebuild", title_justify="left")
    for column in ("run", "step", "state", "action"):
        table.add_column(column, justify="right" if column == "step" else "left")
    for region in report.regions:
        table.add_column(region)
    problems: list[str] = []
    for c in report.checkpoints:
        cells: list[RenderableType] = [
            c.run,
            str(c.step),
            Text(c.state or "-", style=_STYLE.get(c.state or "", "")),
            c.action,
        ]
        for region in report.regions:
            result = c.regions.get(region)
            if result is None:
                cells.append(Text("-", style="dim"))
                continue
            label = result.status
            if result.replica and result.status not in (VERIFIED, CORRUPT):
                label += f" ({result.replica})"
            cells.append(Text(label, style=_STYLE.get(result.status, "")))
            if result.error and result.status != KEPT:
                problems.append(f"{c.run}:{c.step} {region}: {result.error}")
        if c.error:
            problems.append(f"{c.run}:{c.step}: {c.error}")
        table.add_row(*cells)
    parts: list[RenderableType] = [table]
    for line in problems:
        parts.append(Text(line, style="yellow"))
    for entry in report.regions_unreachable:
        parts.append(Text(f"region {entry['region']} unreachable: {entry['error']}", style="red"))
    for entry in report.manifests_invalid:
        parts.append(
            Text(
                f"invalid manifest {entry['uri']} ({entry['region']}): {entry['error']}",
                style="red",
            )
        )
    t = report.totals()
    parts.append(
        Text(
            f"{t['checkpoints']} checkpoint(s): {t['created']} created, {t['updated']} updated, "
            f"{t['unchanged']} unchanged, {t['skipped']} skipped; {t['valid']} valid. "
            f"Replicas: {t['replicas_verified']} verified, {t['replicas_corrupt']} corrupt, "
            f"{t['replicas_missing']} missing, {t['replicas_unverified']} unverified, "
            f"{t['replicas_unreachable']} unreachable, {t['replicas_kept']} kept. "
            f"{t['jobs_enqueued']} replicate job(s) queued."
        )
    )
    return Group(*parts)
