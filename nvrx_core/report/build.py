"""One call from an events file (or run directory) to a finished report."""

import dataclasses
from typing import List, Optional

from nvrx_core.report.events_file import Events, load
from nvrx_core.report.goodput import Goodput, goodput
from nvrx_core.report.incidents import Incident, find_incidents
from nvrx_core.report.respawns import Respawn, find_respawns
from nvrx_core.report.text import render


@dataclasses.dataclass
class Report:
    loaded: Events
    incidents: List[Incident]
    goodput: Optional[Goodput]
    respawns: List[Respawn] = dataclasses.field(default_factory=list)

    def text(self) -> str:
        return render(self.loaded, self.incidents, self.goodput, self.respawns)


def build_report(path: str) -> Report:
    loaded = load(path)
    incidents = find_incidents(loaded.events)
    return Report(loaded, incidents, goodput(loaded.events, incidents), find_respawns(loaded.events))
