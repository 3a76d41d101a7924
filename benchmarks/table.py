"""The README's "Measured" table, generated from one `make bench` result.

    python -m benchmarks.table            # rewrite the table in README.md from latest.json
    python -m benchmarks.table --check    # exit 1 when README.md's table is not that
    python -m benchmarks.table --print    # the table alone, on stdout

One line per headline figure (``HEADLINES``): what is measured, tierckpt's
figure, the contender measured beside it in the same run, their ratio, and
the target where there is one, met or not. Figures are the median of the
repetitions with their min–max; a ratio is tierckpt's figure over the
contender's, taken repetition by repetition (the same moment of the same
machine) and then summarised the same way. Everything comes from the
results file; nothing is typed in by hand.

A headline names rows of a scenario by their variant and metric, as the
scenario wrote them (``benchmarks.stats.row``). ``{name}`` in a variant
matches a part of the label and names it (``{name*}``: any text); the
contender's variant and the figure's label may use it (one line per match:
each catalog, each state size). A
scenario that ran but has no row a headline names is an error, so a renamed
row cannot silently leave the table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .report import _num
from .scenarios import catalog_latest, memory, register_latency

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "latest.json"
README = REPO / "README.md"
START = "<!-- bench-table:start (python -m benchmarks.table writes this part) -->"
END = "<!-- bench-table:end -->"


@dataclass(frozen=True)
class Target:
    """``≤ bound`` (``at_most``) or ``≥ bound``, on the ratio or on the figure itself."""

    bound: float
    at_most: bool
    on_ratio: bool = True
    unit: str = "×"

    def text(self) -> str:
        unit = self.unit if self.unit in ("×", "%") else f" {self.unit}"
        return f"{'≤' if self.at_most else '≥'} {self.bound:g}{unit}"

    def met(self, value: float) -> bool:
        return value <= self.bound if self.at_most else value >= self.bound


@dataclass(frozen=True)
class Headline:
    figure: str  # the line's label; may use the variant's {names}
    scenario: str
    variant: str
    metric: str
    contender: str = ""  # in words, for the reader
    against: str | None = None  # the contender's variant (same metric unless against_metric)
    against_metric: str | None = None
    target: Target | None = None


FLOOR = f"machine floor: {register_latency.FLOOR_CALL}, after each register + latest"
LOADED = "under upload load (worker on, own process)"
EMPTY_ANSWER = "an empty HTTP answer, same client and server stacks, same moment"

HEADLINES: tuple[Headline, ...] = (
    Headline(
        "upload: register → durable",
        "upload",
        "tierckpt",
        "throughput",
        "boto3 `upload_file`, default TransferConfig",
        "boto3 default",
    ),
    Headline(
        "agent CPU per GB uploaded (its worker process and SHA-256 included)",
        "cpu",
        "tierckpt agent",
        "CPU",
        "boto3 `upload_file` (its process)",
        "boto3 default",
    ),
    Headline(
        "agent peak RSS uploading one {size} checkpoint (its worker process included)",
        "memory",
        "agent, {size} checkpoint",
        "peak RSS (VmHWM)",
        target=Target(memory.TARGET_MB, at_most=True, on_ratio=False, unit="MiB"),
    ),
    Headline(
        "restore, SHA-256 verified and fsynced",
        "restore",
        "tierckpt",
        "throughput",
        "boto3 `download_file` (no hash, no fsync)",
        "boto3 default",
        target=Target(1.2, at_most=False),
    ),
    Headline(
        "restore, same guarantees on both sides",
        "restore",
        "tierckpt",
        "throughput",
        "boto3 `download_file` + SHA-256 + fsync",
        "boto3 + sha256 + fsync",
    ),
    Headline(
        "large files: register → durable, as the client sees it",
        "large_files",
        "tierckpt (client-seen)",
        "upload throughput",
        "boto3 `upload_file`",
        "boto3 upload_file",
        target=Target(1.1, at_most=False),
    ),
    Headline(
        "large files: register → durable, as the client sees it",
        "large_files",
        "tierckpt (client-seen)",
        "upload throughput",
        "one plain PUT per file (`curl -T`), the ceiling",
        "plain PUT (curl -T)",
        target=Target(0.9, at_most=False),
    ),
    Headline(
        "large files: verified restore",
        "large_files",
        "tierckpt restore",
        "restore throughput",
        "boto3 `download_file`",
        "boto3 download_file",
        target=Target(1.2, at_most=False),
    ),
    Headline(
        "register p99 while other checkpoints upload, {catalog}",
        "register_latency",
        f"{{catalog}} register, {LOADED}",
        "p99",
        EMPTY_ANSWER,
        f"{{catalog}} {FLOOR}, {LOADED}",
    ),
    Headline(
        "`latest` p99 right after it, {catalog}",
        "register_latency",
        f"{{catalog}} latest, {LOADED}",
        "p99",
        EMPTY_ANSWER,
        f"{{catalog}} {FLOOR}, {LOADED}",
    ),
    Headline(
        "memory-segment register p99 (the trainer's default save), {catalog}",
        "register_latency",
        f'{{catalog}} register of a memory segment (staging="memory", the default), {LOADED}',
        "p99",
        EMPTY_ANSWER,
        f"{{catalog}} {FLOOR}, {LOADED}",
    ),
    Headline(
        "register p99 of a 10 GiB checkpoint, idle agent",
        "register_latency",
        "idle (worker off): 10 GiB checkpoint (sparse)",
        "p99",
        "a 1 MiB checkpoint",
        "idle (worker off): 1 MiB checkpoint",
    ),
    Headline(
        "registrations/s, 64 concurrent clients: {setup}",
        "registration_rate",
        "{setup*}",
        "rate",
        target=Target(500, at_most=False, on_ratio=False, unit="reg/s"),
    ),
    Headline(
        "`latest` p99 with 100,000 checkpoints, {catalog}",
        "catalog_latest",
        "HTTP {catalog} latest",
        "p99",
        target=Target(catalog_latest.TARGET_P99_MS, at_most=True, on_ratio=False, unit="ms"),
    ),
    Headline(
        "two regions: register → replicated",
        "two_regions",
        "two regions: register → replicated (west committed)",
        "time",
        "register → durable in one region",
        "one region: register → durable",
        target=Target(1.3, at_most=True),
    ),
    Headline(
        "dedup: bytes sent for a checkpoint 90 % unchanged",
        "dedup",
        "90 %-unchanged checkpoint",
        "bytes sent / checkpoint bytes",
        "the full upload",
        "full checkpoint",
        target=Target(15, at_most=True, on_ratio=False, unit="%"),
    ),
    Headline(
        "trainer stall per save, {size}: memory staging (the default)",
        "trainer_stall",
        '{size}: memory staging: TorchCheckpointer(staging="memory").save',
        "stall",
        "a bare copy of the tensors into `/dev/shm`",
        "{size}: bare copy into /dev/shm (the limit)",
        target=Target(2.0, at_most=True),
    ),
    Headline(
        "trainer stall per save, {size}: disk staging",
        "trainer_stall",
        '{size}: disk staging: TorchCheckpointer(staging="disk").save',
        "stall",
        "a bare copy of the tensors into `/dev/shm`",
        "{size}: bare copy into /dev/shm (the limit)",
    ),
    Headline(
        "save returned → durable, {size}: memory staging",
        "trainer_stall",
        "{size}: save returned → durable, memory staging",
        "background",
        "disk staging",
        "{size}: save returned → durable, disk staging",
        target=Target(1.0, at_most=True),
    ),
    Headline(
        "DCP plugin: bytes each of 3 ranks reads of a tensor 2 ranks saved",
        "dcp_plugin",
        "2 -> 3 rank(s)",
        "bytes read per rank / tensor bytes",
        "the ideal 1/3",
    ),
    Headline(
        "DCP restore into N={world} ranks, `TierckptReader` from the region: bytes per rank",
        "dcp_restore",
        "N={world}: TierckptReader from the region",
        "bytes read per rank / checkpoint bytes",
        "every rank restoring the whole checkpoint",
        "N={world}: every rank restores the whole checkpoint",
    ),
    Headline(
        "restore from a peer agent's copy",
        "peers",
        "restore from a peer agent",
        "throughput",
        "from the region (presigned GETs)",
        "restore from the region",
    ),
)

_PLACEHOLDER = re.compile(r"\{(\w+)(\*?)\}")


def _pattern(variant: str) -> re.Pattern[str]:
    """``variant`` as a pattern: each ``{name}`` matches text without a
    comma or a colon (a catalog's name, a state's size: not the rest of a
    longer label), ``{name*}`` any text."""
    parts, last = [], 0
    for found in _PLACEHOLDER.finditer(variant):
        parts.append(re.escape(variant[last : found.start()]))
        parts.append(f"(?P<{found.group(1)}>{'.+?' if found.group(2) else '[^,:]+?'})")
        last = found.end()
    parts.append(re.escape(variant[last:]))
    return re.compile("".join(parts))


def _values(row: dict[str, Any]) -> list[float]:
    return [float(v) for v in row["summary"]["values"]]


def _spread(values: Sequence[float], unit: str = "") -> str:
    median = statistics.median(values)
    text = f"{_num(median)}{unit}"
    if len(values) > 1:
        text += f" ({_num(min(values))}–{_num(max(values))})"
    return text


def _with_unit(unit: str) -> str:
    if unit == "ratio":  # a fraction: the number says it
        return ""
    return unit if unit in ("", "%", "×") else f" {unit}"


def _ratios(figure: Sequence[float], contender: Sequence[float]) -> list[float]:
    """Paired repetition by repetition when both have as many; else the
    medians' ratio."""
    if len(figure) == len(contender):
        return [f / c for f, c in zip(figure, contender, strict=True) if c]
    return [statistics.median(figure) / statistics.median(contender)]


def _lines(headline: Headline, result: dict[str, Any]) -> Iterator[list[str]]:
    rows = result.get("rows", [])
    pattern = _pattern(headline.variant)
    matched = False
    for row in rows:
        found = pattern.fullmatch(row["variant"])
        if found is None or row["metric"] != headline.metric:
            continue
        matched = True
        names = found.groupdict()
        values = _values(row)
        unit = _with_unit(row["unit"])
        cells = [headline.figure.format(**names), _spread(values, unit), "", "—", "—"]
        judged: float | None = statistics.median(values)
        if headline.against is not None:
            variant = headline.against.format(**names)
            metric = headline.against_metric or headline.metric
            other = next(
                (r for r in rows if r["variant"] == variant and r["metric"] == metric), None
            )
            if other is None:
                raise LookupError(f"{headline.scenario}: no contender row {variant!r} / {metric!r}")
            theirs = _values(other)
            cells[2] = f"{headline.contender}: {_spread(theirs, _with_unit(other['unit']))}"
            ratios = _ratios(values, theirs)
            cells[3] = _spread(ratios, "×")
            if headline.target is not None and headline.target.on_ratio:
                judged = statistics.median(ratios)
        else:
            cells[2] = headline.contender or "—"
        if headline.target is not None and judged is not None:
            verdict = "met" if headline.target.met(judged) else "not met"
            cells[4] = f"{headline.target.text()}: {verdict}"
        yield cells
    if not matched:
        raise LookupError(f"{headline.scenario}: no row {headline.variant!r} / {headline.metric!r}")


def _not_measured(result: dict[str, Any] | None) -> str:
    if result is None:
        return "not run"
    if "error" in result:
        return f"failed: {result['error']}"
    return "; ".join(result.get("notes", [])[:1]) or "no figures"


def table_rows(report: dict[str, Any], headlines: Sequence[Headline] = HEADLINES) -> list[str]:
    """The table's Markdown lines (header included) for ``report``."""
    out = [
        "| figure | tierckpt | contender (same run) | ratio | target |",
        "| --- | --- | --- | --- | --- |",
    ]
    reported: set[str] = set()
    for headline in headlines:
        result = report["scenarios"].get(headline.scenario)
        if result is None or "error" in result or not result.get("rows"):
            if headline.scenario not in reported:
                reported.add(headline.scenario)
                out.append(f"| `{headline.scenario}` | {_not_measured(result)} | | | |")
            continue
        out += ["| " + " | ".join(cells) + " |" for cells in _lines(headline, result)]
    return out


def heading(report: dict[str, Any]) -> str:
    """The line above the table: which run, on what machine."""
    config, machine = report["config"], report["machine"]
    form = (
        "the quick form, `make bench QUICK=1`" if config["quick"] else "the full form, `make bench`"
    )
    commit = machine.get("git", {}).get("commit", "")[:10] or "unknown commit"
    dirty = " with uncommitted changes" if machine.get("git", {}).get("dirty") else ""
    return (
        f"From `benchmarks/results/latest.json`: {form}, {config['reps']} repetitions, "
        f"run {report['started_at']} at {commit}{dirty} on {machine['nproc']} CPUs "
        f"({machine['cpu_model']}), load average {machine['loadavg_start']} at the start and "
        f"{machine['loadavg_end']} at the end, {_num(report['seconds'] / 60)} min. "
        "Each figure is the median of its repetitions (min–max); a ratio is tierckpt's "
        "figure over the contender's, repetition by repetition. How each is measured: "
        "[benchmarks/README.md](benchmarks/README.md)."
    )


def render(report: dict[str, Any], headlines: Sequence[Headline] = HEADLINES) -> str:
    """The block between the markers, markers included."""
    return "\n".join([START, heading(report), "", *table_rows(report, headlines), END])


def replace_block(text: str, block: str) -> str:
    """``text`` with what lies between the markers (themselves included) replaced by ``block``."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the markers {START!r} … {END!r} are not in the file, in that order")
    return text[:start] + block + text[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.table", description=__doc__)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--readme", type=Path, default=README)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the README is not current")
    mode.add_argument("--print", action="store_true", help="print the table instead")
    args = parser.parse_args(argv)
    block = render(json.loads(args.results.read_text()))
    if args.print:
        print(block)
        return 0
    text = args.readme.read_text()
    updated = replace_block(text, block)
    if args.check:
        if updated != text:
            print(f"{args.readme} does not hold the table of {args.results}: run {parser.prog}")
            return 1
        return 0
    args.readme.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
