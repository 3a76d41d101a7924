"""End-to-end tests: the real CLI and server as subprocesses."""
