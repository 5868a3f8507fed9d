"""Wire protocol between ranks (and the launcher) and the node monitor.

Versioned JSON lines over a Unix stream socket: one object per line, at most
MAX_MESSAGE_BYTES. JSON, never pickle: the socket is a trust boundary, and a garbage or
hostile line must cost the monitor nothing but a log line.

Rank -> monitor (fire and forget, except `init`):
  init        {rank, local_rank, pid, cycle}            -> reply init_ok {config, timeouts, stack_file}
  hb          heartbeat
  ss / se     section start / end {name}
  sea         end all open sections
  progress    {iteration}                                training progress (for no-progress detection)
  timeouts    {timeouts}                                 calculated timeouts for this rank
  state       {since_init, heartbeats, hb_age, sections_used, open {name: age}, section_ends, se_age,
               iteration, timeouts}                      the rank's whole view, ages in seconds: sent
                                                         after a reconnect, and instead of the messages
                                                         the socket could not take (see client_link)
  bye         the rank is shutting down cleanly: stop watching it
  collectives {groups, error?}                           answer to dump_collectives: where the rank is in each
                                                         process group's collective sequence (ft.collective_trace)
Launcher -> monitor (request / reply; refused from any other process):
  cycle       {cycle}                                    a new restart cycle begins -> ok
  stats       -> stats {ranks, heartbeats, section_ends, max_iteration}   for the cycle so far
  stop        the launcher is done: exit -> ok
Monitor -> rank:
  dump_collectives                                       a hang was detected in this cycle: say where you are
Monitor -> any peer:
  error       {reason}                                   a message was refused (advisory; may be dropped)
"""

import json
from typing import Any, List, Optional, Tuple

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says what is wrong."""


_NUMBER = (int, float)

WORKLOAD_ACTIONS = ("ExcludeThisNode", "ShutdownWorkload")
"""What a rank may ask the launcher to do at the next failure instead of restarting ("wc"):
leave the job with this node, or end it on every node (nvidia-resiliency-ext's names)."""

# type -> {field: allowed type(s)}; required fields only (a handler checks optional ones)
_SCHEMA = {
    "init": {"rank": int, "local_rank": int, "pid": int, "cycle": int},
    "hb": {},
    "ss": {"name": str},
    "se": {"name": str},
    "sea": {},
    "progress": {"iteration": int},
    "timeouts": {"timeouts": dict},
    "state": {"since_init": _NUMBER, "heartbeats": int, "section_ends": int, "open": dict},
    "bye": {},
    "collectives": {"groups": dict},
    "wc": {"action": str},  # workload control: what the launcher does at the next failure
    "cycle": {"cycle": int},
    "stats": {},
    "stop": {},
    # monitor -> client
    "init_ok": {"config": dict, "timeouts": dict},
    "ok": {},
    "stats_reply": {"stats": dict},
    "error": {"reason": str},
    "dump_collectives": {},
}


def encode(msg_type: str, **fields: Any) -> bytes:
    data = json.dumps({"v": PROTOCOL_VERSION, "t": msg_type, **fields}, separators=(",", ":")).encode()
    if len(data) + 1 > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{msg_type} message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data + b"\n"


def decode(line: bytes) -> dict:
    """Parse and validate one line (without its newline); raise ProtocolError if malformed."""
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("not a JSON object")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r}, expected {PROTOCOL_VERSION}")
    schema = _SCHEMA.get(msg.get("t"))
    if schema is None:
        raise ProtocolError(f"unknown message type {msg.get('t')!r}")
    for field, kind in schema.items():
        value = msg.get(field)
        # bool is an int subclass; a rank of `true` is still garbage.
        if not isinstance(value, kind) or (kind in (int, _NUMBER) and isinstance(value, bool)):
            name = "number" if kind is _NUMBER else kind.__name__
            raise ProtocolError(f"{msg['t']}: field {field!r} must be {name}, got {value!r:.200}")
    return msg


class LineBuffer:
    """Splits a byte stream into messages; oversized lines are discarded up to their newline."""

    def __init__(self, max_bytes: int = MAX_MESSAGE_BYTES):
        self._max = max_bytes
        self._buf = bytearray()
        self._discarding = False

    def feed(self, data: bytes) -> List[Tuple[Optional[dict], Optional[str]]]:
        """Return (message, None) for each good line and (None, reason) for each bad one."""
        out: List[Tuple[Optional[dict], Optional[str]]] = []
        self._buf += data
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > self._max:
                    if not self._discarding:
                        out.append((None, f"message longer than {self._max} bytes dropped"))
                    self._discarding = True
                    self._buf.clear()
                return out
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if self._discarding:
                self._discarding = False
                continue
            if len(line) > self._max:
                out.append((None, f"message longer than {self._max} bytes dropped"))
                continue
            if not line.strip():
                continue
            try:
                out.append((decode(line), None))
            except ProtocolError as e:
                out.append((None, str(e)))
