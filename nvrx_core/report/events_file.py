"""Loading an events file, or a run directory of them, line by line.

The file is written by many processes, some of which die mid-write, and may mix lines from
nvrx versions before and after an upgrade. A report must still come out: every line that
cannot be used is listed with its number and why, and the rest is analysed.
"""

import dataclasses
import json
import os
from typing import List

from nvrx_core.events import EVENTS_FORMAT


SOURCE = "_file"
"""Added to each record: which of the run's files it came from. Each ft_launcher counts its own
restart cycles, so a cycle is one node's: (file, node, cycle) names it."""


@dataclasses.dataclass
class Problem:
    path: str
    line: int
    reason: str

    def describe(self) -> str:
        return f"{os.path.basename(self.path)}:{self.line}: {self.reason}"


@dataclasses.dataclass
class Events:
    events: List[dict]
    """Usable events, in time order."""
    problems: List[Problem]
    paths: List[str]


def events_paths(path: str) -> List[str]:
    """The events files of `path`: the file itself, or a run directory's *.jsonl files."""
    if os.path.isdir(path):
        found = sorted(os.path.join(path, name) for name in os.listdir(path) if name.endswith(".jsonl"))
        if not found:
            raise FileNotFoundError(f"{path}: a run directory with no events file (*.jsonl) in it")
        return found
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such events file or run directory")
    return [path]


def load(path: str) -> Events:
    paths = events_paths(path)
    events: List[dict] = []
    problems: List[Problem] = []
    for index, p in enumerate(paths):
        with open(p, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            last_unterminated = number == len(lines)
            record, reason = _parse(raw, last_unterminated)
            if reason is not None:
                problems.append(Problem(p, number, reason))
            if record is not None:
                record[SOURCE] = index
                events.append(record)
    events.sort(key=lambda e: e["time"])
    return Events(events, problems, paths)


def _parse(raw: bytes, unterminated: bool):
    """(record or None, problem or None) for one line."""
    try:
        record = json.loads(raw)
    except ValueError as e:
        if unterminated:
            return None, "truncated: the last line has no end (a writer died mid-line); skipped"
        return None, f"not JSON ({e.msg} at column {e.colno}); skipped"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an event object; skipped"
    kind, when = record.get("kind"), record.get("time")
    if not isinstance(kind, str):
        return None, "no 'kind' field; skipped"
    if not isinstance(when, (int, float)) or isinstance(when, bool):
        return None, f"{kind}: 'time' is {when!r:.40}, not a number; skipped"
    version = record.get("v", 1)
    if not isinstance(version, int) or version > EVENTS_FORMAT:
        return record, (f"{kind}: written in events format {version!r:.20}, newer than this reader's "
                        f"({EVENTS_FORMAT}); read as far as understood")
    for field in ("rank", "cycle"):
        value = record.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            record[field] = None
            return record, f"{kind}: '{field}' is {value!r:.40}, not an integer; read without it"
    return record, None
