"""Layer 3: durable state in SQLite (WAL)."""
