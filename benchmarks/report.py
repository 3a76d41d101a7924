"""Render scenario results as rich tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _num(value: float) -> str:
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def _spread(summary: dict[str, Any], fmt: Any = _num) -> str:
    if summary["n"] < 2:
        return "n=1"
    return f"{fmt(summary['min'])}–{fmt(summary['max'])} (±{summary['spread_pct'] / 2:.0f}%)"


def _ratio(value: float) -> str:
    return f"{value:.2f}"


def scenario_table(title: str, result: dict[str, Any]) -> Table:
    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("variant")
    table.add_column("metric")
    table.add_column("median", justify="right")
    table.add_column("min–max", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("ratio min–max", justify="right")
    table.add_column("note", overflow="fold")
    for line in result["rows"]:
        summary = line["summary"]
        ratio = line.get("ratio")
        table.add_row(
            line["variant"],
            f"{line['metric']} ({line['unit']})",
            _num(summary["median"]),
            _spread(summary),
            f"{_ratio(ratio['summary']['median'])}× {ratio['label']}" if ratio else "",
            _spread(ratio["summary"], _ratio) if ratio else "",
            line.get("note", ""),
        )
    return table


def render(console: Console, report: dict[str, Any]) -> None:
    machine = report["machine"]
    console.print(
        f"[bold]tierckpt benchmark[/bold] ({'quick' if report['config']['quick'] else 'full'}, "
        f"{report['config']['reps']} reps) on {machine['nproc']} cores, "
        f"load {machine['loadavg_start']} → {machine['loadavg_end']}; "
        "every figure: median of the repetitions, min–max (± half the range, in % of the "
        "median); ratios are taken within each repetition, then summarised the same way."
    )
    for name, result in report["scenarios"].items():
        if "error" in result:
            console.print(f"[red]{name}: FAILED: {result['error']}[/red]")
            continue
        console.print(scenario_table(result["title"], result))
        for note in result.get("notes", []):
            console.print(f"  • {note}")
        console.print()
