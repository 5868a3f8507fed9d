"""The launcher's handle on its node monitor process: start it, talk to it, stop it.

The launcher binds the listening socket itself (in a private 0700 directory, socket 0600)
and hands the descriptor to the monitor, so ranks can connect the moment the socket exists
and no readiness handshake is needed.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Optional

from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.protocol import decode, encode


class MonitorHandle:
    def __init__(self, config: FTConfig, events_file: Optional[str]):
        self.directory = tempfile.mkdtemp(prefix="nvrx-ft-")
        os.chmod(self.directory, 0o700)
        self.socket_path = os.path.join(self.directory, "monitor.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        os.chmod(self.socket_path, 0o600)
        listener.listen(1024)
        cmd = [
            sys.executable, "-m", "nvrx_core.ft.monitor",
            "--fd", str(listener.fileno()),
            "--config-json", json.dumps(config.to_json()),
            "--parent-pid", str(os.getpid()),
        ]
        if events_file:
            cmd += ["--events-file", events_file]
        self.process = subprocess.Popen(cmd, pass_fds=[listener.fileno()], stdin=subprocess.DEVNULL)
        listener.close()
        self._control: Optional[socket.socket] = None

    def request(self, msg_type: str, timeout: float = 10.0, **fields) -> dict:
        """Send a control request and wait for the reply."""
        if self._control is None:
            self._control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._control.settimeout(timeout)
            self._control.connect(self.socket_path)
        self._control.sendall(encode(msg_type, **fields))
        buf = b""
        while b"\n" not in buf:
            chunk = self._control.recv(65536)
            if not chunk:
                raise ConnectionError("node monitor closed the control connection")
            buf += chunk
        return decode(buf.split(b"\n", 1)[0])

    def new_cycle(self, cycle: int) -> None:
        self.request("cycle", cycle=cycle)

    def cycle_stats(self) -> dict:
        return self.request("stats")["stats"]

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
