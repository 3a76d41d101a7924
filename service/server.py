"""`tierckpt serve`'s HTTP server: uvicorn, with a drain on SIGTERM.

uvicorn alone turns SIGTERM into a shutdown at once: it closes its socket and
runs the lifespan shutdown, so the urgent checkpoint the trainer registers in
that same moment (a preempted node signals both) finds no agent. Here:

* the first SIGTERM starts the agent's drain (draining.py, agent.py): the
  socket stays open, the worker runs the node's work; when the drain ends
  the server exits the way uvicorn does (lifespan shutdown, then the signal
  is raised again, so the exit status still says SIGTERM);
* a second SIGTERM, or SIGINT, ends the drain at once; a SIGINT first (a
  person pressing Ctrl-C) skips it, as does ``[worker] drain_seconds = 0``;
* a signal before the agent is up is uvicorn's as always.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from .agent import AgentProcess

log = logging.getLogger("tierckpt.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_seconds: float) -> None:
        super().__init__(config)
        self._app = app
        self._drain_seconds = drain_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._draining = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it runs on the loop's thread between two
        # bytecodes, so it only schedules work on the loop.
        agent: AgentProcess | None = getattr(self._app.state, "agent", None)
        if self._loop is None or agent is None or not self.started or self.should_exit:
            super().handle_exit(sig, frame)
            return
        if self._draining:
            log.warning("signal %s during the drain: ending it now", signal.Signals(sig).name)
            self._captured_signals.append(sig)
            self._loop.call_soon_threadsafe(agent.drain.abort)
            return
        if sig != signal.SIGTERM or self._drain_seconds <= 0:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._captured_signals.append(sig)
        # A fresh context: the handler interrupted some task (a job, a
        # request) whose log context the drain must not inherit.
        self._loop.call_soon_threadsafe(self._start_drain, agent, context=contextvars.Context())

    def _start_drain(self, agent: AgentProcess) -> None:
        self._drain_task = asyncio.create_task(self._drain(agent), name="tierckpt-drain")

    async def _drain(self, agent: AgentProcess) -> None:
        try:
            await agent.drain_node()
        except Exception:
            log.exception("the drain failed; shutting down")
        finally:
            self.should_exit = True
