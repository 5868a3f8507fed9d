"""A rank that writes what it can see of the fork server it was forked from (its parent)."""

import json
import os
import sys

server = os.getppid()
with open(f"/proc/{server}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
with open(f"/proc/{server}/cmdline", "rb") as f:
    cmdline = f.read().split(b"\0")
fds = {}
for fd in os.listdir(f"/proc/{server}/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/{server}/fd/{fd}")
    except OSError:
        pass
with open(sys.argv[1], "w") as f:
    json.dump({"server": server, "server_parent": int(fields[1]), "server_started": int(fields[19]),
               "launcher": int(os.environ["NVRX_LAUNCHER_PID"]), "server_is_new_interpreter":
               any(b"forkserver import main" in part for part in cmdline), "server_fds": fds}, f)
