"""Helpers shared by the test suite and the demo: real SeaweedFS and PostgreSQL,
the agent in process or as a subprocess, and fault injection (`tcpproxy`: a
TCP proxy with an outage switch; `s3proxy`: an HTTP proxy in front of S3 that
throttles, fails or delays).

Nothing here imports pytest at module level, so examples/demo.py can reuse
the SeaweedFS launcher.
"""
