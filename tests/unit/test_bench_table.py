"""The README's "Measured" table is generated from a bench result, and current.

The generator (benchmarks/table.py) is run on a small report built with the
bench's own row helper, and the README's table must be exactly what it
makes of the committed benchmarks/results/latest.json.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from benchmarks import table
from benchmarks.stats import row
from benchmarks.table import Headline, Target

SAMPLE_HEADLINES = (
    Headline(
        "upload",
        "upload",
        "tierckpt",
        "throughput",
        "boto3",
        "boto3 default",
        target=Target(1.5, at_most=False),
    ),
    Headline(
        "register p99, {catalog}",
        "register_latency",
        "{catalog} register, under load",
        "p99",
        "empty answer",
        "{catalog} floor, under load",
    ),
    Headline(
        "peak RSS",
        "memory",
        "agent, 1 GiB checkpoint",
        "peak RSS",
        target=Target(512, at_most=True, on_ratio=False, unit="MiB"),
    ),
    Headline("never ran", "peers", "restore from a peer agent", "throughput"),
    Headline("broke", "dedup", "90 %-unchanged checkpoint", "bytes sent"),
)


def sample_report(**scenarios: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = {
        "started_at": "2026-12-04T21:00:00+00:00",
        "seconds": 360.0,
        "machine": {
            "nproc": 2,
            "cpu_model": "Test CPU",
            "loadavg_start": "0.50",
            "loadavg_end": "1.00",
            "git": {"commit": "0123456789abcdef", "dirty": False},
        },
        "config": {"quick": True, "reps": 3},
        "scenarios": {
            "upload": {
                "rows": [
                    row("tierckpt", "throughput", "MB/s", [100.0, 110.0, 120.0]),
                    row("boto3 default", "throughput", "MB/s", [50.0, 100.0, 60.0]),
                ]
            },
            "register_latency": {
                "rows": [
                    row("SQLite register, under load", "p99", "ms", [6.0, 8.0]),
                    row("SQLite register, under load", "p50", "ms", [1.0, 1.0]),
                    row("SQLite floor, under load", "p99", "ms", [2.0, 2.0]),
                    row("PostgreSQL register, under load", "p99", "ms", [9.0, 9.0]),
                    row("PostgreSQL floor, under load", "p99", "ms", [3.0, 4.5]),
                ]
            },
            "memory": {"rows": [row("agent, 1 GiB checkpoint", "peak RSS", "MiB", [600.0])]},
            "dedup": {"error": "RuntimeError: boom"},
        },
    }
    report["scenarios"].update(scenarios)
    return report


def test_each_headline_becomes_a_line_with_its_ratio_and_target() -> None:
    lines = table.table_rows(sample_report(), SAMPLE_HEADLINES)
    assert lines == [
        "| figure | tierckpt | contender (same run) | ratio | target |",
        "| --- | --- | --- | --- | --- |",
        # Paired ratios 2.0, 1.1, 2.0: median 2.0, not 110 / 60.
        "| upload | 110 MB/s (100–120) | boto3: 60.0 MB/s (50.0–100) | 2.00× (1.10–2.00) "
        "| ≥ 1.5×: met |",
        "| register p99, SQLite | 7.00 ms (6.00–8.00) | empty answer: 2.00 ms (2.00–2.00) "
        "| 3.50× (3.00–4.00) | — |",
        "| register p99, PostgreSQL | 9.00 ms (9.00–9.00) | empty answer: 3.75 ms (3.00–4.50) "
        "| 2.50× (2.00–3.00) | — |",
        "| peak RSS | 600 MiB | — | — | ≤ 512 MiB: not met |",
        "| `peers` | not run | | | |",
        "| `dedup` | failed: RuntimeError: boom | | | |",
    ]


def test_a_row_the_headline_names_but_the_run_lacks_is_an_error() -> None:
    renamed = sample_report(
        upload={"rows": [row("tierckpt (renamed)", "throughput", "MB/s", [1.0])]}
    )
    with pytest.raises(LookupError, match="upload: no row 'tierckpt'"):
        table.table_rows(renamed, SAMPLE_HEADLINES)
    no_contender = sample_report(upload={"rows": [row("tierckpt", "throughput", "MB/s", [1.0])]})
    with pytest.raises(LookupError, match="no contender row 'boto3 default'"):
        table.table_rows(no_contender, SAMPLE_HEADLINES)


def test_the_heading_names_the_run_and_its_form() -> None:
    heading = table.heading(sample_report())
    assert "the quick form, `make bench QUICK=1`" in heading
    assert "3 repetitions" in heading and "0123456789" in heading and "2 CPUs" in heading


def test_the_block_replaces_what_lies_between_the_markers(tmp_path: Any) -> None:
    report, readme = tmp_path / "latest.json", tmp_path / "README.md"
    nothing_ran = {**sample_report(), "scenarios": {}}  # every headline: "not run"
    report.write_text(json.dumps(nothing_ran))
    readme.write_text(f"# x\n\n{table.START}\nold table\n{table.END}\n\nafter\n")
    args = ["--results", str(report), "--readme", str(readme)]
    assert table.main([*args, "--check"]) == 1
    assert table.main(args) == 0
    text = readme.read_text()
    assert text.startswith(f"# x\n\n{table.START}\nFrom ")
    assert text.endswith(f"{table.END}\n\nafter\n")
    assert "old table" not in text and "| `upload` | not run | | | |" in text
    assert table.main([*args, "--check"]) == 0


def test_the_readme_holds_the_table_of_the_committed_results() -> None:
    report = json.loads(table.RESULTS.read_text())
    block = table.render(report)
    text = table.README.read_text()
    assert table.replace_block(text, block) == text, (
        "README.md's Measured table is not benchmarks/results/latest.json's: "
        "run `python -m benchmarks.table`"
    )
