"""FastAPI's built-in OpenTelemetry, turned off for every app dsec serves.

dsec exports no traces, metrics or logs through OpenTelemetry; left on, FastAPI asks on each request
whether a provider was configured, through environment lookups that made 6% of the daemon's Python time
in a burst of creations (py-spy, 2026-12-06).
"""

from __future__ import annotations

from fastapi.telemetry import TelemetryConfig

OFF: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
