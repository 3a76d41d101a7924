"""tierckpt test suite: unit, integration (real SQLite/PostgreSQL/SeaweedFS) and e2e."""
