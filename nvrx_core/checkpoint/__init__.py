"""Checkpointing. Not built yet."""
