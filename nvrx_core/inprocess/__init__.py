"""In-process restart (issue: in-process restart and health checks). Not built yet."""
