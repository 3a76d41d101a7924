"""The ``tierckpt`` command line.

Exit codes: 0 ok, 1 not found, 2 bad usage or input (including 4xx answers
of the service), 3 server error or unreachable (and `prefetch --wait`: a
node's prefetch failed or is still running at `--timeout`), 4 `verify`
found a corrupt copy (a repair is scheduled; see `status`). Errors print
``error: <message>`` on stderr, never a traceback. ``--json`` puts exactly
one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pydantic_core import to_jsonable_python

from . import _render
from ._api import DEFAULT_URL
from .errors import (
    BadRequestError,
    DestinationError,
    NotFoundError,
    TierckptError,
)
from .models import Checkpoint
from .sync_client import CheckpointClient

N = TypeVar("N", int, float)

OK, NOT_FOUND, BAD_INPUT, SERVER_ERROR, CORRUPT = 0, 1, 2, 3, 4
INTERRUPTED = 130


class _StderrHandler(logging.Handler):
    # Looks sys.stderr up at each record: rich's progress bar and pytest both
    # swap it, and a handler bound at start-up would write past them.
    def emit(self, record: logging.LogRecord) -> None:
        print(f"{record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)


_LOG_HANDLER = _StderrHandler(logging.INFO)


def _setup_logging() -> None:
    logger = logging.getLogger("tierckpt.client")
    if _LOG_HANDLER not in logger.handlers:
        logger.addHandler(_LOG_HANDLER)
        logger.setLevel(logging.INFO)


def _number(
    convert: Callable[[str], N], noun: str, refuse: Callable[[N], bool], rule: str
) -> Callable[[str], N]:
    """An argparse ``type``: ``convert`` the text, or say it is not ``noun``;
    a value ``refuse`` rejects is answered with ``rule``."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if refuse(value):
            raise argparse.ArgumentTypeError(f"{rule}: {text}")
        return value

    return parse


_non_negative = _number(int, "an integer", lambda value: value < 0, "must be >= 0")
_seconds = _number(float, "a number of seconds", lambda value: value < 0, "must be >= 0")
_positive_number = _number(
    float,
    "a number",
    lambda value: not value > 0 or value == float("inf"),
    "must be a number > 0",
)


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _metric(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"metric {name} is not a number: {value!r}") from None


def _parent(text: str) -> tuple[str, int] | int:
    """``RUN:STEP``, or a bare ``STEP`` in the same run."""
    run, sep, step = text.rpartition(":")
    if sep and not run:
        raise argparse.ArgumentTypeError(f"expected RUN:STEP, got {text!r}")
    step_value = _non_negative(step)
    return (run, step_value) if sep else step_value


def _global_options(for_subcommand: bool) -> argparse.ArgumentParser:
    # The same options hang on the main parser and on every subcommand, so
    # they work on either side of it; the subcommand copies default to
    # SUPPRESS so they do not overwrite a value given before the subcommand.
    unset = argparse.SUPPRESS
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--server",
        metavar="URL",
        default=unset if for_subcommand else None,
        help=f"service URL (default: $TIERCKPT_URL, else {DEFAULT_URL})",
    )
    options.add_argument(
        "--json",
        action="store_true",
        default=unset if for_subcommand else False,
        help="print one JSON document on stdout, for machines",
    )
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierckpt",
        description="Tiered checkpoint storage for ML training.",
        parents=[_global_options(False)],
        epilog="The token comes from $TIERCKPT_TOKEN.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = [_global_options(True)]

    def command(name: str, handler: Callable[..., int], help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, parents=common, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        return sub

    for name, handler, text in (
        ("serve", _serve, "run the tierckpt service (agent) on this node"),
        ("migrate", _migrate, "upgrade the catalog database schema"),
    ):
        sub = command(name, handler, text)
        sub.add_argument("--config", metavar="FILE", help="TOML configuration file")

    sub = command("register", _register, "register a checkpoint written on this node")
    sub.add_argument("run")
    sub.add_argument("step", type=_non_negative)
    sub.add_argument("path", help="checkpoint directory on this node")
    sub.add_argument("--rank", type=_non_negative, default=0)
    sub.add_argument("--world-size", type=_positive, default=1)
    sub.add_argument("--epoch", type=_non_negative)
    sub.add_argument(
        "--metric",
        type=_metric,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a numeric metric; repeat for several",
    )
    sub.add_argument("--parent", type=_parent, metavar="RUN:STEP")
    sub.add_argument("--priority", choices=("normal", "urgent"), default="normal")
    sub.add_argument("--wait", action="store_true", help="wait until the checkpoint is durable")
    sub.add_argument(
        "--timeout", type=_seconds, metavar="S", help="give up waiting after S seconds"
    )

    sub = command("latest", _latest, "show the latest valid checkpoint of a run")
    sub.add_argument("run")
    sub.add_argument("--region", help="prefer this region's location")
    sub.add_argument("--node", help="report a local copy still on this node")
    sub.add_argument(
        "--peer-safe",
        action="store_true",
        help="the newest peer-safe checkpoint if newer than the newest durable "
        "(verified copies on [peers] copies other nodes; see docs/API.md for the risk)",
    )

    sub = command("restore", _restore, "download and verify a checkpoint into DEST")
    sub.add_argument("run")
    sub.add_argument("dest", help="new or empty directory")
    which = sub.add_mutually_exclusive_group()
    which.add_argument("--step", type=_non_negative, help="default: the latest valid checkpoint")
    which.add_argument(
        "--latest", action="store_true", help="the latest valid checkpoint (the default)"
    )
    sub.add_argument(
        "--if-any",
        action="store_true",
        help="job scripts: exit 0 and restore nothing when the run has no valid checkpoint"
        ' yet (--json then prints {"restored": null}; else {"restored": {run, step, path}})',
    )
    sub.add_argument("--region", help="preferred region; others are fallbacks")
    sub.add_argument("--rank", type=_non_negative, help="only this rank's files")
    sub.add_argument(
        "--node",
        default=os.environ.get("TIERCKPT_NODE") or None,
        help="this node's name as its agent knows it: copy from its intact local (T0) copy,"
        " its own or prefetched, verified, instead of downloading (default: $TIERCKPT_NODE)",
    )

    sub = command(
        "prefetch",
        _prefetch,
        "bring a checkpoint into nodes' local SSD (T0), verified, before a restart there",
    )
    sub.add_argument("run")
    sub.add_argument(
        "--node",
        dest="nodes",
        action="append",
        required=True,
        metavar="NODE",
        help="a node's name as its agent knows it ([server] node); repeat for several",
    )
    sub.add_argument("--step", type=_non_negative, help="default: the latest valid checkpoint")
    sub.add_argument(
        "--if-any",
        action="store_true",
        help="job scripts: exit 0 and prefetch nothing when the run has no valid checkpoint"
        ' yet (--json then prints {"run": RUN, "step": null, "jobs": []})',
    )
    sub.add_argument(
        "--wait", action="store_true", help="return once every node holds it (or failed)"
    )
    sub.add_argument(
        "--timeout", type=_seconds, metavar="S", help="with --wait: give up after S seconds"
    )

    sub = command("status", _status, "show the checkpoints of a run, or one in detail")
    sub.add_argument("run")
    sub.add_argument("step", nargs="?", type=_non_negative)
    sub.add_argument("--limit", type=_positive, default=20, help="checkpoints listed (default 20)")

    command("runs", _runs, "list runs")

    sub = command("lineage", _lineage, "show a checkpoint's ancestors and children as a tree")
    sub.add_argument("run")
    sub.add_argument("step", type=_non_negative)

    sub = command("advise", _advise, "checkpoint interval advice (Young, Daly) from observed costs")
    sub.add_argument("run")
    sub.add_argument(
        "--mtbf-hours",
        type=_positive_number,
        required=True,
        metavar="H",
        help="mean time between failures",
    )
    sub.add_argument(
        "--cost-seconds",
        type=_positive_number,
        metavar="S",
        help="use this checkpoint cost instead of the observed ones",
    )
    sub.add_argument(
        "--restart-seconds", type=_seconds, metavar="S", help="time to restart after a failure"
    )

    sub = command("verify", _verify, "re-read and re-hash every region's copy of a checkpoint")
    sub.add_argument("run")
    sub.add_argument("step", type=_non_negative)
    sub.add_argument("--timeout", type=_seconds, metavar="S", help="give up after S seconds")

    sub = command(
        "rebuild-catalog",
        _rebuild_catalog,
        "recreate a lost catalog from the regions' manifests, re-verifying every object",
    )
    sub.add_argument("--config", metavar="FILE", required=True, help="TOML configuration file")
    return parser


def _client(args: argparse.Namespace) -> CheckpointClient:
    server = args.server or os.environ.get("TIERCKPT_URL") or DEFAULT_URL
    # A person at a terminal wants a quick answer when the agent is down.
    return CheckpointClient(server, token=os.environ.get("TIERCKPT_TOKEN") or None, retries=2)


def _emit_json(value: Any) -> None:
    print(json.dumps(to_jsonable_python(value), indent=2))


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


class _ServiceMissing(TierckptError):
    """This install has the client without the service's dependencies."""


def _service(name: str) -> Callable[..., Any]:
    """A command of ``tierckpt.service.main``, imported only when run: the
    client installs and runs without the service's dependencies."""
    try:
        module = importlib.import_module("tierckpt.service.main")
    except ImportError as exc:
        raise _ServiceMissing(f"the tierckpt service is not available: {exc}") from exc
    command: Callable[..., Any] = getattr(module, name)
    return command


def _serve(args: argparse.Namespace) -> int:
    _service("serve")(args.config)
    return OK


def _migrate(args: argparse.Namespace) -> int:
    _service("migrate")(args.config)
    return OK


def _rebuild_catalog(args: argparse.Namespace) -> int:
    try:
        from tierckpt.service.main import rebuild_catalog

        from .rebuild_report import print_report
    except ImportError as exc:
        return _fail(f"the tierckpt service is not available: {exc}", SERVER_ERROR)
    return rebuild_catalog(args.config, as_json=args.json, show=print_report)


def _lineage(args: argparse.Namespace) -> int:
    with _client(args) as client:
        lineage = client.lineage(args.run, args.step)
    if args.json:
        _emit_json(lineage)
    else:
        _render.console().print(_render.lineage_tree(lineage))
    return OK


def _advise(args: argparse.Namespace) -> int:
    with _client(args) as client:
        advice = client.advice(
            args.run,
            args.mtbf_hours,
            cost_seconds=args.cost_seconds,
            restart_seconds=args.restart_seconds,
        )
    if args.json:
        _emit_json(advice)
        return OK
    from rich.table import Table

    def duration(seconds: float) -> str:
        if seconds >= 3600:
            return f"{seconds / 3600:.2f} h"
        return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.2f} s"

    table = Table(
        title=f"{advice.run}: checkpoint interval for MTBF {advice.mtbf_hours:g} h",
        caption="interval = compute time between checkpoints; lost = expected share of wall time",
    )
    for column in ("cost basis", "C", "Young", "Daly", "current"):
        table.add_column(column, justify="left" if column == "cost basis" else "right")
    for scenario in advice.scenarios:
        cells = []
        for value in (scenario.young, scenario.daly, scenario.current):
            if value is None:
                cells.append("-")
                continue
            steps = f", {value.every_steps} steps" if value.every_steps else ""
            cells.append(
                f"{duration(value.interval_seconds)}{steps}\nlost {value.waste_fraction:.2%}"
            )
        table.add_row(scenario.basis, duration(scenario.cost_seconds), *cells)
    _render.console().print(table)
    observed = advice.observed
    _render.console().print(
        f"observed over {observed.checkpoints} checkpoints: write "
        f"{observed.write_seconds.median_seconds or 0:.2f} s (n={observed.write_seconds.samples}),"
        f" upload {observed.upload_seconds.median_seconds or 0:.2f} s "
        f"(n={observed.upload_seconds.samples})"
    )
    return OK


def _verify(args: argparse.Namespace) -> int:
    with _client(args) as client:
        checkpoint = client.verify(args.run, args.step, timeout=args.timeout)
    bad = [r for r in checkpoint.replicas if r.state == "corrupt"]
    if args.json:
        _emit_json(checkpoint)
    else:
        _render.console().print(_render.verify_table(checkpoint))
    # Corruption found is neither "ok" nor a usage error: its own exit code,
    # so scripts can tell it apart.
    return CORRUPT if bad else OK


def _register(args: argparse.Namespace) -> int:
    with _client(args) as client:
        checkpoint = client.register(
            args.run,
            args.step,
            args.path,
            rank=args.rank,
            world_size=args.world_size,
            metrics=dict(args.metric) or None,
            parent=args.parent,
            priority=args.priority,
            epoch=args.epoch,
        )
        if not args.json:
            _render.console().print(
                f"registered {checkpoint.run}:{checkpoint.step} rank {args.rank}: ",
                _render.state(checkpoint.state),
                sep="",
            )
        if args.wait or args.timeout is not None:
            show = not args.json and sys.stdout.isatty()
            with _render.wait_progress(f"{args.run}:{args.step}", show) as progress:
                checkpoint = _wait_durable(client, args.run, args.step, args.timeout, progress)
            if not args.json:
                _render.console().print(
                    f"{checkpoint.run}:{checkpoint.step} is ",
                    _render.state(checkpoint.state),
                    sep="",
                )
    if args.json:
        _emit_json(checkpoint)
    return OK


def _wait_durable(
    client: CheckpointClient,
    run: str,
    step: int,
    timeout: float | None,
    on_poll: Callable[[Checkpoint], None],
    poll_interval: float = 0.2,
) -> Checkpoint:
    """``client.wait(..., state="durable")`` (the same flow), showing every
    poll to ``on_poll``."""
    return client._run(client._wait_for(run, step, "durable", timeout, poll_interval, on_poll))


def _latest(args: argparse.Namespace) -> int:
    with _client(args) as client:
        checkpoint = client.latest(
            args.run, region=args.region, node=args.node, peer_safe=args.peer_safe
        )
    if checkpoint is None:
        return _fail(f"run {args.run} has no valid checkpoint", NOT_FOUND)
    if args.json:
        _emit_json(checkpoint)
    else:
        _render.console().print(_render.latest_table(checkpoint))
    return OK


def _restore(args: argparse.Namespace) -> int:
    with _client(args) as client:
        step = args.step
        if step is None:
            latest = client.latest(args.run, region=args.region)
            if latest is None:
                if args.if_any:
                    # A fresh start for an orchestrator's job script, not an error.
                    if args.json:
                        _emit_json({"restored": None})
                    print("no checkpoint yet", file=sys.stderr)
                    return OK
                return _fail(f"run {args.run} has no valid checkpoint", NOT_FOUND)
            step = latest.step
        show = not args.json and sys.stdout.isatty()
        with _render.transfer_meter(f"{args.run}:{step}", show) as meter:
            path = client.restore(
                args.run,
                args.dest,
                step=step,
                region=args.region,
                rank=args.rank,
                progress=meter,
                node=args.node,
            )
    if args.json:
        restored = {"run": args.run, "step": step, "path": str(path), "bytes": meter.total}
        _emit_json({"restored": restored} if args.if_any else restored)
    else:
        size = _render.size(meter.total)
        _render.console().print(f"restored {args.run}:{step} ({size}, verified) to {path}")
    return OK


def _prefetch(args: argparse.Namespace) -> int:
    if args.timeout is not None and not args.wait:
        return _fail("--timeout needs --wait", BAD_INPUT)
    with _client(args) as client:
        try:
            prefetch = client.prefetch(
                args.run, args.nodes, step=args.step, wait=args.wait, timeout=args.timeout
            )
        except NotFoundError as exc:
            if not args.if_any or args.step is not None:
                raise
            # A fresh start for an orchestrator's job script, not an error.
            if args.json:
                _emit_json({"run": args.run, "step": None, "jobs": []})
            print(f"no checkpoint yet: {exc.message}", file=sys.stderr)
            return OK
    if args.json:
        _emit_json(prefetch)
    else:
        for job in prefetch.jobs:
            why = f": {job.error}" if job.error else ""
            _render.console().print(
                f"{prefetch.run}:{prefetch.step} on {job.node}: {job.state}{why}"
            )
    failed = prefetch.failed
    if failed:
        nodes = ", ".join(job.node for job in failed)
        return _fail(f"prefetch of {prefetch.run}:{prefetch.step} failed on {nodes}", SERVER_ERROR)
    return OK


def _status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.step is not None:
            checkpoint = client.get(args.run, args.step)
            if args.json:
                _emit_json(checkpoint)
            else:
                _render.console().print(_render.checkpoint_detail(checkpoint))
            return OK
        checkpoints = client.list_checkpoints(args.run, limit=args.limit)
    if not checkpoints:
        return _fail(f"run {args.run} has no checkpoints", NOT_FOUND)
    if args.json:
        _emit_json({"run": args.run, "checkpoints": checkpoints})
    else:
        _render.console().print(_render.checkpoints_table(checkpoints, title=args.run))
    return OK


def _runs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        runs = client.runs()
    if args.json:
        _emit_json({"runs": runs})
    else:
        _render.console().print(_render.runs_table(runs))
    return OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        # argparse already printed usage or help.
        return exc.code if isinstance(exc.code, int) else BAD_INPUT
    _setup_logging()
    try:
        return int(args.handler(args))
    except NotFoundError as exc:
        return _fail(exc.message, NOT_FOUND)
    except (BadRequestError, DestinationError) as exc:
        return _fail(exc.message, BAD_INPUT)
    except TierckptError as exc:
        # ServerError, RestoreError, CheckpointFailedError
        return _fail(exc.message, SERVER_ERROR)
    except TimeoutError as exc:
        return _fail(str(exc), SERVER_ERROR)
    except KeyboardInterrupt:
        return _fail("interrupted", INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
