"""Where a rank stands in each process group's collective sequence, for hang attribution.

When one rank hangs, its peers soon wait for it inside a collective, and a heartbeat or
section timeout then expires on every rank at about the same time: timeouts alone cannot say
who stopped first. The collective sequence can. Each process group numbers its collectives;
a rank blocked in collective N of a group has enqueued N and completed N-1, while the rank
that stopped making progress never enqueued N. torch's Flight Recorder keeps these numbers
(for gloo and NCCL alike) when TORCH_FR_BUFFER_SIZE is set, which ft_launcher does for its
workers unless the user chose a value.

The node monitor asks every rank of a hung cycle for this summary (a `dump_collectives`
message); the rank's link thread answers, which works while the training thread is blocked
in C code with the GIL released (a collective, a sleep). A rank whose Python is stuck with
the GIL held, or stopped, does not answer, and that silence is evidence too.
"""

import json
import sys
from typing import Any, Dict

DEFAULT_BUFFER_ENTRIES = 2000
"""Collectives kept per process when ft_launcher turns the Flight Recorder on."""
MAX_GROUPS = 32
"""Process groups reported per rank (those with a collective in flight first): bounds the message."""


def summarize_flight_recorder(raw: Dict[str, Any]) -> Dict[str, dict]:
    """{group name: {"enqueued": n, "completed": m, "op": name of collective n or None,
    "since_ns": when the rank entered it}} from a Flight Recorder dump."""
    names = {}
    ops = {}
    for entry in raw.get("entries") or ():
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue
        pg_id = str(entry.get("pg_id"))
        group = entry.get("process_group")
        if isinstance(group, list) and len(group) == 2:
            names[pg_id] = str(group[1])
        ops[(pg_id, entry.get("collective_seq_id"))] = entry
    groups = {}
    for pg_id, status in (raw.get("pg_status") or {}).items():
        try:
            enqueued = int(status["last_enqueued_collective"])
            completed = int(status["last_completed_collective"])
        except (KeyError, TypeError, ValueError):
            continue
        entry = ops.get((str(pg_id), enqueued)) if enqueued > completed else None
        groups[names.get(str(pg_id), str(pg_id))] = {
            "enqueued": enqueued,
            "completed": completed,
            "op": entry.get("profiling_name") if entry else None,
            "since_ns": entry.get("time_created_ns") if entry else None,
        }
    busy_first = sorted(groups, key=lambda name: (groups[name]["op"] is None, name))
    return {name: groups[name] for name in busy_first[:MAX_GROUPS]}


def collective_positions() -> Dict[str, dict]:
    """This process's summary (see summarize_flight_recorder); empty before any group exists."""
    if "torch" not in sys.modules:
        # No process group without torch. Importing it here would run the link thread through
        # seconds of Python while the monitor's stack dump signal arrives, and faulthandler's
        # all-thread dump can crash on a thread that runs Python meanwhile.
        return {}
    # imported here: the client imports this module, and `ft_launcher` (nvrx_core.ft.command)
    # must stay torch-free so the fork server's import of torch overlaps the launcher's
    from nvrx_core import torch_compat

    raw = torch_compat.flight_recorder_json()
    return summarize_flight_recorder(json.loads(raw))


def collectives_message() -> bytes:
    """The rank's answer to the monitor's `dump_collectives` (a protocol line; never raises)."""
    from nvrx_core.ft.protocol import MAX_MESSAGE_BYTES, encode

    try:
        message = encode("collectives", groups=collective_positions())
    except Exception as e:  # a torch without the recorder, a malformed dump: say so, do not die
        return encode("collectives", groups={}, error=f"{type(e).__name__}: {e}"[:500])
    if len(message) > MAX_MESSAGE_BYTES:
        return encode("collectives", groups={}, error="summary larger than a protocol message")
    return message
