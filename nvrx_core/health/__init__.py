"""GPU / NVLink / CUDA / node health checks. Not built yet."""
