"""Rerun state machine. Not built yet."""
