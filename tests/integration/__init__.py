"""Tests against real SQLite, PostgreSQL and SeaweedFS S3."""
