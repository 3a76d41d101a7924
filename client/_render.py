"""Human output of the CLI: compact rich tables and the restore progress bar.

Machine output (``--json``) does not come through here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

from rich.console import Console, Group
from rich.filesize import decimal
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from .models import Checkpoint, Lineage, LineageNode, RunSummary

_STYLE = {
    "staged": "yellow",
    "registered": "yellow",
    "uploading": "yellow",
    "pending": "yellow",
    "durable": "green",
    "replicated": "green",
    "committed": "green",
    "uploaded": "green",
    "failed": "red",
    "corrupt": "red",
    "deleted": "dim",
}


def console() -> Console:
    return Console(highlight=False)


def state(value: str | None) -> Text:
    if value is None:
        return Text("-", style="dim")
    return Text(value, style=_STYLE.get(value, ""))


def when(value: datetime | None) -> str:
    if value is None:
        return "-"
    if value.tzinfo is not None:
        value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%d %H:%M:%SZ")


def size(value: int | None) -> str:
    return "-" if value is None else decimal(value)


def _regions(checkpoints: Iterable[Checkpoint]) -> list[str]:
    seen: dict[str, None] = {}
    for checkpoint in checkpoints:
        for replica in checkpoint.replicas:
            seen.setdefault(replica.region)
    return list(seen)


def checkpoints_table(checkpoints: list[Checkpoint], title: str | None = None) -> Table:
    regions = _regions(checkpoints)
    table = Table(title=title, box=None, pad_edge=False, header_style="bold")
    for column in ("step", "state", "size", "files", "created"):
        table.add_column(column, justify="right" if column in ("step", "size", "files") else "left")
    for region in regions:
        table.add_column(region)
    for checkpoint in checkpoints:
        replicas = {replica.region: replica.state for replica in checkpoint.replicas}
        table.add_row(
            str(checkpoint.step),
            state(checkpoint.state),
            size(checkpoint.total_bytes),
            "-" if checkpoint.file_count is None else str(checkpoint.file_count),
            when(checkpoint.created_at),
            *(state(replicas.get(region)) for region in regions),
        )
    return table


def _bare_table(columns: Iterable[str], rows: Iterable[Iterable[Any]]) -> Table:
    """A borderless table with bold headers, for the parts of a detail view."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table


def checkpoint_detail(checkpoint: Checkpoint) -> Group:
    parts: list[Table | Text] = [
        checkpoints_table([checkpoint], title=f"{checkpoint.run} step {checkpoint.step}")
    ]
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    facts.add_row("durable", when(checkpoint.durable_at))
    if checkpoint.epoch is not None:
        facts.add_row("epoch", str(checkpoint.epoch))
    if checkpoint.parent:
        facts.add_row("parent", str(checkpoint.parent))
    if checkpoint.children:
        facts.add_row("children", ", ".join(str(child) for child in checkpoint.children))
    if checkpoint.metrics:
        metrics = ", ".join(f"{name}={value:g}" for name, value in checkpoint.metrics.items())
        facts.add_row("metrics", metrics)
    if checkpoint.error:
        facts.add_row("error", Text(checkpoint.error, style="red"))
    parts.append(facts)
    if checkpoint.shards:
        shards = [
            (str(shard.rank), shard.node or "-", state(shard.state), shard.path or "-")
            for shard in checkpoint.shards
        ]
        parts.append(_bare_table(("rank", "node", "state", "path"), shards))
    if checkpoint.replicas:
        replicas = [
            (replica.region, state(replica.state), when(replica.verified_at), replica.uri or "-")
            for replica in checkpoint.replicas
        ]
        parts.append(_bare_table(("region", "state", "verified", "uri"), replicas))
    if checkpoint.peers:
        peers = [
            (
                peer.name,
                state(peer.state),
                f"{peer.committed}/{peer.shards}",
                when(peer.verified_at),
            )
            for peer in checkpoint.peers
        ]
        parts.append(_bare_table(("peer", "state", "shards", "verified"), peers))
        facts.add_row("peer-safe", "yes" if checkpoint.peer_safe else "no")
    return Group(*parts)


def latest_table(checkpoint: Checkpoint) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("step", "state", "created", "locations"):
        table.add_column(column, justify="right" if column == "step" else "left")
    locations = [f"{loc.region}: {loc.uri or '-'}" for loc in checkpoint.locations]
    if checkpoint.local is not None:
        locations.insert(0, f"local {checkpoint.local.node}: {checkpoint.local.path}")
    table.add_row(
        str(checkpoint.step),
        state(checkpoint.state),
        when(checkpoint.created_at),
        "\n".join(locations) or "-",
    )
    return table


def age(value: datetime | None, now: datetime | None = None) -> str:
    """``3m 12s`` since ``value``."""
    if value is None:
        return "-"
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    seconds = max(0, int(((now or datetime.now(UTC)) - value).total_seconds()))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d {seconds % 86400 // 3600:02d}h"


def runs_table(runs: list[RunSummary], now: datetime | None = None) -> Table:
    """One row per run; per region, the step a restart there would get and how
    old it is (the recovery point in that region)."""
    regions: dict[str, None] = {}
    for run in runs:
        for point in run.regions:
            regions.setdefault(point.region)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("run", "checkpoints", "latest", "valid", "recovery point"):
        numeric = column in ("checkpoints", "latest", "valid")
        table.add_column(column, justify="right" if numeric else "left")
    for region in regions:
        table.add_column(region)
    table.add_column("created")
    for run in runs:
        latest = "-" if run.latest_step is None else str(run.latest_step)
        points = {point.region: point for point in run.regions}
        best = max(run.regions, key=lambda p: p.step, default=None)
        cells = []
        for region in regions:
            found = points.get(region)
            cells.append(
                Text("none", style="red")
                if found is None
                else Text(f"{found.step} ({age(found.created_at, now)})", style="green")
            )
        table.add_row(
            run.run,
            str(run.checkpoints),
            latest,
            "-" if best is None else str(best.step),
            Text("no valid checkpoint", style="red")
            if best is None
            else Text(age(best.created_at, now)),
            *cells,
            when(run.created_at),
        )
    return table


def progress_line(checkpoint: Checkpoint) -> Text:
    """``llama:1200 uploading · us-east pending · us-west pending``."""
    text = Text(f"{checkpoint.run}:{checkpoint.step} ")
    text.append_text(state(checkpoint.state))
    for replica in checkpoint.replicas:
        text.append(f" · {replica.region} ")
        text.append_text(state(replica.state))
    return text


class WaitProgress:
    """Progress of ``register --wait``: a spinner with the current state and
    every region's copy, and one printed line per state transition."""

    def __init__(self, status: Any | None, out: Console) -> None:
        self._status = status
        self._console = out
        self._last: str | None = None
        self._started = time.monotonic()

    def __call__(self, checkpoint: Checkpoint) -> None:
        if self._status is None:
            return
        elapsed = time.monotonic() - self._started
        if checkpoint.state != self._last:
            self._last = checkpoint.state
            line = Text(f"  {elapsed:6.1f}s  ")
            line.append_text(state(checkpoint.state))
            self._console.print(line)
        waiting = progress_line(checkpoint)
        waiting.append(f"  ({elapsed:.0f}s)", style="dim")
        self._status.update(waiting)


@contextlib.contextmanager
def wait_progress(label: str, show: bool) -> Iterator[WaitProgress]:
    if not show:
        yield WaitProgress(None, console())
        return
    out = console()
    with out.status(f"{label} waiting until durable", spinner="dots") as status:
        yield WaitProgress(status, out)


class TransferMeter:
    """Progress callback for restore: remembers the byte total and, on a
    terminal, drives a progress bar."""

    def __init__(self, progress: Progress | None, label: str):
        self.total = 0
        self._progress = progress
        self._task = progress.add_task(label, total=None) if progress is not None else None

    def __call__(self, done: int, total: int) -> None:
        self.total = total
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=done, total=total)


@contextlib.contextmanager
def transfer_meter(label: str, show: bool) -> Iterator[TransferMeter]:
    if not show:
        yield TransferMeter(None, label)
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console()) as progress:
        yield TransferMeter(progress, label)


def verify_table(checkpoint: Checkpoint) -> Table:
    """One row per region: what the last re-read of its copy found."""
    table = Table(title=f"{checkpoint.run}:{checkpoint.step} — {checkpoint.state}")
    table.add_column("region")
    table.add_column("state")
    table.add_column("verified")
    table.add_column("finding", overflow="fold")
    for replica in checkpoint.replicas:
        table.add_row(
            replica.region,
            state(replica.state),
            when(replica.verified_at),
            replica.error or ("intact" if replica.state == "committed" else "-"),
        )
    return table


def lineage_tree(lineage: Lineage) -> Tree:
    """Oldest ancestor at the root, down to the checkpoint, then its children."""

    def label(node: LineageNode, *, me: bool = False) -> Text:
        text = Text(f"{node.run}:{node.step} ", style="bold" if me else "")
        text.append_text(
            state(node.state) if node.state else Text("(not in this catalog)", style="dim")
        )
        return text

    chain = list(reversed(lineage.ancestors))
    root = Tree(label(chain[0]) if chain else label(lineage.checkpoint, me=True))
    branch = root
    for node in chain[1:]:
        branch = branch.add(label(node))
    if chain:
        branch = branch.add(label(lineage.checkpoint, me=True))
    for child in lineage.children:
        branch.add(label(child))
    return root
