"""Observability of an agent: Prometheus metrics, structured logs, request ids.

- ``context``: the request id and the job being run, as context variables
  (set by the request middleware and by the worker around each job).
- ``logs``: a logging filter that copies that context onto every record, and
  the JSON-lines / console formatters `tierckpt serve` installs.
- ``metrics``: the in-process counters and histograms, and the one-line
  ``observe_*`` hooks the job modules call.
- ``catalog``: the gauges computed from the catalog at scrape time (queues,
  replicas, the recovery point of every run and region).
- ``middleware`` / ``routes``: the ASGI middleware and ``GET /metrics``.
"""
