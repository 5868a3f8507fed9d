"""Holds a PathCheckpointer's background worker just before it publishes a save.

Tests of "this call finishes the write in flight first" (load, remove, Lightning's
remove_checkpoint) need a save that is certainly still in flight when the call is made, and
need to see that the call waited on it. The gate stops the worker at `publish` until
`released` is set; `open_when_waited_on()` sets it at the moment the training thread blocks
on a save's result (SavePipeline.wait), and records that it did (`waited`).
"""

import threading

from nvrx_core.checkpoint import path_checkpointer
from nvrx_core.checkpoint.pipeline import SavePipeline


class PublishGate:
    def __init__(self, monkeypatch):
        self.reached, self.released, self.waited = threading.Event(), threading.Event(), threading.Event()
        self._monkeypatch = monkeypatch
        publish = path_checkpointer.publish

        def gated(*args, **kwargs):
            self.reached.set()
            assert self.released.wait(120), "the test never opened the gate"
            return publish(*args, **kwargs)

        monkeypatch.setattr(path_checkpointer, "publish", gated)

    def open_when_waited_on(self) -> None:
        """Release the worker once the training thread waits on a save's result."""
        wait = SavePipeline.wait

        def waiting(pipeline, pending, timeout=None):
            self.waited.set()
            self.released.set()
            return wait(pipeline, pending, timeout)

        self._monkeypatch.setattr(SavePipeline, "wait", waiting)

    def reset(self) -> None:
        """Hold the next save too."""
        self.released.clear(), self.reached.clear(), self.waited.clear()
