"""Health-check hooks for the launcher tests (`--health-check health_hooks:NAME`)."""
import os


def healthy():
    return True, "all good"


def sick_after_first_start():
    """Healthy for the first start, then reports the node broken (e.g. a GPU fell off the bus)."""
    marker = os.environ["HEALTH_MARKER"]
    if os.path.exists(marker):
        return False, "GPU 3 fell off the bus (simulated)"
    open(marker, "w").close()
    return True, "all good"
