"""The plain-text report (needs nothing beyond the core)."""

from typing import List, Optional

from nvrx_core.report.events_file import Events
from nvrx_core.report.goodput import CATEGORIES, Goodput
from nvrx_core.report.incidents import Incident
from nvrx_core.report.respawns import Respawn, describe_respawn


def _s(value: Optional[float]) -> str:
    return "?" if value is None else f"{value:.2f} s"


def _ranks(ranks: List[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def describe_incident(incident: Incident) -> List[str]:
    v = incident.verdict
    who = f"culprit rank {_ranks(v.culprits)}" if v.culprits else "no rank at fault"
    if v.node:
        who += f" (node {v.node})"
    head = f"cycle {incident.cycle}: {v.kind}: {who}"
    if v.waiting:
        head += f"; waiting: rank {_ranks(v.waiting)}"
    lines = [head]
    lines += [("  evidence: " if i == 0 else "            ") + text for i, text in enumerate(v.evidence)]
    lines.append(f"  basis: {v.basis}")
    lines.append(f"  timings: detected after {_s(incident.detect_s)}, all stopped {_s(incident.stop_s)} later, "
                 f"restarted after {_s(incident.restart_s)}, first step {_s(incident.first_step_s)} later; "
                 f"training resumed {_s(incident.resumed_after)} after the fault")
    redone = incident.steps_redone
    lines.append(f"  steps: last done {incident.last_step}, resumed from {incident.resumed_from}, "
                 f"redone {redone if redone is not None else '?'}")
    if incident.injected is not None:
        inj = incident.injected
        when = f"at iteration {inj['iteration']}" if inj.get("iteration") is not None else "from a timer"
        lines.append(f"  injected (ground truth): {inj.get('fault')} in rank {inj.get('rank')} {when}")
    return lines


def describe_goodput(g: Optional[Goodput]) -> List[str]:
    if g is None:
        return ["run: no events"]
    if g.ettr is None:
        return [f"run: wall {g.wall_s:.1f} s; ETTR unknown: no step records (rank 0's step_done events)"]
    parts = ", ".join(f"{k} {g.seconds[k]:.1f} s ({100 * g.seconds[k] / g.wall_s:.1f}%)"
                      for k in CATEGORIES if g.seconds[k] > 0.005 or k == "productive")
    return [f"run: wall {g.wall_s:.1f} s, ETTR {100 * g.ettr:.1f}% ({g.steps_kept} steps kept, "
            f"{g.steps_redone} redone, median step {_s(g.step_median_s)})",
            f"  where the time went: {parts}"]


def render(loaded: Events, incidents: List[Incident], g: Optional[Goodput], respawns: List[Respawn] = ()) -> str:
    lines = [f"nvrx report: {', '.join(loaded.paths)} ({len(loaded.events)} events"
             + (f"; {len(loaded.problems)} lines with problems, listed at the end)" if loaded.problems else ")")]
    lines += describe_goodput(g)
    lines.append(f"incidents: {len(incidents)}")
    for incident in incidents:
        lines += describe_incident(incident)
    if respawns:
        lines.append(f"respawns: {len(respawns)}")
        lines += ["  " + describe_respawn(r) for r in respawns]
    if loaded.problems:
        lines.append("problems:")
        lines += ["  " + p.describe() for p in loaded.problems]
    return "\n".join(lines)
