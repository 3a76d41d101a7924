"""Development support for tierckpt: what the test suite, the benchmarks and the
demo run against, never part of the installed distribution.

- `seaweed`: a real SeaweedFS S3 server as a subprocess, and a plain boto3 client;
- `postgres`: throw-away PostgreSQL databases on the local server;
- `agent`: the agent in process (real catalog, stores and worker) for integration tests;
- `processes`: the real `tierckpt` CLI and `tierckpt serve` as subprocesses;
- `tcpproxy`, `s3proxy`: fault injection (a TCP proxy with outage switches, an HTTP
  proxy in front of S3 that fails, throttles or delays), both on `loopthread`'s
  loopback server with its own event loop in a thread.

Nothing here imports pytest at module level, so the benchmarks and
examples/demo.py can use it; nothing here imports `tests`. Entry points find it
on the path because they run from the repository root (`python -m pytest`,
`python -m benchmarks.run`, `python -m examples.demo`).
"""
