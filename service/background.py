"""The agent's background work: the job worker and the periodic passes.

Built here once for both places it runs: inside the agent's own process
(``[worker] separate_process = "no"``, and the tests that drive an app in
process) or in the worker's child process
(worker_process.py), which keeps the agent's event loop and GIL for the
requests and the registration writer.
"""

from __future__ import annotations

import logging
from functools import partial

from .integrity.jobs import VerifyJobs
from .integrity.scrub import Scrubber
from .jobs.kinds import KINDS
from .jobs.worker import JobHandler, Worker
from .peers.push import PeerPushJobs
from .peers.upkeep import PeerUpkeep
from .periodic import Periodic
from .prefetch.jobs import PrefetchJobs
from .replication.jobs import ReplicationJobs
from .resources import Resources
from .retention.at_durable import RetainJobs
from .retention.jobs import DeleteJobs
from .retention.sweeper import sweep
from .uploads.jobs import UploadJobs


def job_handlers(resources: Resources) -> dict[str, JobHandler]:
    """A handler for every kind in the registry, and only those."""
    handlers = {
        **UploadJobs(resources).handlers(),
        **ReplicationJobs(resources).handlers(),
        **VerifyJobs(resources).handlers(),
        **DeleteJobs(resources).handlers(),
        **RetainJobs(resources).handlers(),
        **PeerPushJobs(resources).handlers(),
        **PrefetchJobs(resources).handlers(),
    }
    if handlers.keys() != KINDS.keys():
        raise RuntimeError(
            f"job kinds without a handler: {sorted(KINDS.keys() - handlers.keys())}, "
            f"handlers without a kind: {sorted(handlers.keys() - KINDS.keys())}"
        )
    return handlers


def background(resources: Resources) -> tuple[Worker, list[Periodic]]:
    """The worker with a handler for every job kind, and the periodic passes
    (the scrubber when ``[scrub]`` enables it, the retention sweeper).
    Work enqueued in the process that runs them (a scrub pass, a sweep)
    wakes the worker at once: ``resources.wake`` is set to it."""
    settings = resources.settings
    worker = Worker(
        resources.sessionmaker, job_handlers(resources), settings.worker, settings.server.node
    )
    resources.wake = worker.wake
    passes = []
    if settings.scrub.enabled:
        scrubber = Scrubber(resources, settings.scrub)
        passes.append(
            Periodic(
                "scrub",
                scrubber.run_once,
                settings.scrub.interval_seconds,
                log=logging.getLogger("tierckpt.scrub"),
            )
        )
    # Heartbeat (always: peers and restores see this agent live), takeover of
    # a dead agent's uploads, peer retention and the re-read of peer copies.
    upkeep = PeerUpkeep(resources)
    passes.append(
        Periodic(
            "peers",
            upkeep.run_once,
            # Peer tier off: only the heartbeat (GET /v1/agents), less often.
            settings.peers.interval_seconds
            if settings.peers.copies
            else max(settings.peers.interval_seconds, settings.peers.lease_seconds / 3),
            log=logging.getLogger("tierckpt.peers"),
        )
    )
    interval = settings.retention.interval_seconds
    passes.append(
        Periodic(
            "retention",
            partial(sweep, resources),
            interval,
            # Not at start: an agent restarting often (a crash loop, a
            # deploy) must not run a pass each time.
            first_delay=interval,
            log=logging.getLogger("tierckpt.retention"),
        )
    )
    return worker, passes
