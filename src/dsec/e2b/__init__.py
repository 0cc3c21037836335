"""E2B-compatible API: the control API and the in-sandbox (envd) API of the e2b SDKs, served on dsec's core."""
