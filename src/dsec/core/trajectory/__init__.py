"""The trajectory log: record, replay, rebuild."""
