"""Sandbox kinds: one Backend implementation per ``kind=``."""
