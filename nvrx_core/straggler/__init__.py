"""Straggler detection. Not built yet."""
