"""Durable daemon state (SQLite in the state dir by default)."""
