"""Helpers shared by the test suite and the demo: real SeaweedFS and PostgreSQL.

Nothing here imports pytest at module level, so examples/demo.py can reuse
the SeaweedFS launcher.
"""
