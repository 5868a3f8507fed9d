"""Who caused a failed cycle, and what kind of fault it was, from the evidence in the events.

The rule everywhere: a rank that was waiting for another is named as waiting, never blamed.
- A hang: the node monitor asked every rank where it stood in each process group's collective
  sequence (ft.hang_evidence). Ranks blocked in the newest collective are waiting; a rank
  that never entered it stopped first. A rank that could not answer is frozen: stopped
  (SIGSTOP, the kernel says so) or stuck with the GIL held (the kernel says it is running).
  Without collective records the earliest silence decides.
- A crash: a rank's uncaught exception is recorded with its text (ft.uncaught). An error
  that says a peer went away (connection closed or reset, a collective timed out, an
  aborted communicator) is a victim's; any other exception, or a signal nvrx did not send,
  is the culprit's.
- Preemption, a straggler stop, a lost node and the rerun state machine's exits say who in
  their own events and exit codes.
- A stop signal the launcher received from outside (the scheduler) blames no rank, when
  nothing else in the cycle went wrong: its workers were stopped, they did not fail.
"""

import dataclasses
import re
import signal
from typing import Dict, List, Optional, Set

from nvrx_core import events as ev
from nvrx_core.exit_codes import ExitCode

KILLED = "rank killed"
EXCEPTION = "exception"
HANG = "hang"
HANG_GIL = "hang (GIL held)"
STOPPED = "stopped (SIGSTOP)"
COLLECTIVE_HANG = "hang inside a collective"
PREEMPTED = "preempted"
STRAGGLER = "straggler stop"
NODE_LOST = "node lost"
SIGNALED = "stopped by a signal to the launcher"
RERUN = "rerun state machine"
EXITED = "rank exited"
UNKNOWN = "unknown"

PEER_ERROR = re.compile(
    r"connection (closed|reset)|closed by peer|broken pipe|timed? ?out|remote process exited|"
    r"communicator was aborted|nccl.*(abort|remote)|read error|write error|recv|peer",
    re.IGNORECASE)
PEER_ERROR_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")


@dataclasses.dataclass
class Verdict:
    kind: str
    culprits: List[int]
    """Ranks blamed (empty when the fault came from outside: preemption, a lost node)."""
    waiting: List[int]
    """Ranks that only waited for a culprit."""
    evidence: List[str]
    basis: str
    """What the verdict rests on, in a few words."""
    node: Optional[str] = None
    fault_time: Optional[float] = None
    """When the fault began, as well as the evidence tells."""


def is_peer_error(exception: dict) -> bool:
    type_name = str(exception.get("type", "")).rsplit(".", 1)[-1]
    return type_name in PEER_ERROR_TYPES or bool(PEER_ERROR.search(str(exception.get("message", ""))))


def main_thread_frames(stacks: str, frames: int = 3) -> str:
    """The innermost frames of the thread the dump signal interrupted (the main thread)."""
    blocks = [b for b in re.split(r"\n\s*\n", stacks) if "most recent call first" in b]
    if not blocks:
        return ""
    block = next((b for b in blocks if b.lstrip().startswith("Current thread")), blocks[-1])
    found = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
    return " < ".join(f"{name} ({path.rsplit('/', 1)[-1]}:{line})" for path, line, name in found[:frames])


def _first_by_rank(events: List[dict], kind: str) -> Dict[int, dict]:
    out: Dict[int, dict] = {}
    for e in events:
        if e["kind"] == kind and isinstance(e.get("rank"), int):
            out.setdefault(e["rank"], e)
    return out


def _exit_codes(events: List[dict]) -> Dict[int, int]:
    codes: Dict[int, int] = {}
    for e in events:
        if e["kind"] == ev.WORKERS_FAILED:
            for rank, code in (e.get("exit_codes") or {}).items():
                try:
                    codes.setdefault(int(rank), int(code))
                except (TypeError, ValueError):
                    continue
    return codes


def _stopped_by_launcher(events: List[dict]) -> Set[int]:
    """Ranks the launcher stopped because another rank failed (see FaultTolerantAgent)."""
    stopped: Set[int] = set()
    for e in events:
        if e["kind"] == ev.WORKERS_FAILED:
            stopped.update(r for r in e.get("stopped_ranks") or () if isinstance(r, int))
    return stopped


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def attribute(events: List[dict]) -> Verdict:
    """The verdict on one failed cycle (`events`: the cycle's events, in time order)."""
    codes = _exit_codes(events)
    for judge in (_preempted, _straggler, _node_lost, _rerun, _hang, _crash, _signaled):
        verdict = judge(events, codes)
        if verdict is not None:
            return verdict
    return Verdict(UNKNOWN, [], [], ["no failure record in this cycle"], "nothing")


def _preempted(events: List[dict], codes: Dict[int, int]) -> Optional[Verdict]:
    agreed = [e for e in events if e["kind"] == ev.PREEMPTION_AGREED]
    if not agreed and ExitCode.PREEMPTED not in codes.values():
        return None
    signals = sorted({s for e in agreed for s in e.get("signals_here") or ()})
    step = next((e.get("step") for e in agreed if e.get("step") is not None), None)
    evidence = [f"ranks agreed to stop at step {step} (signals received: {', '.join(signals) or 'none recorded'})"]
    return Verdict(PREEMPTED, [], [], evidence, "preemption records",
                   fault_time=min((e["time"] for e in agreed), default=None))


def _straggler(events: List[dict], codes: Dict[int, int]) -> Optional[Verdict]:
    stops = [e for e in events if e["kind"] == ev.STRAGGLER_FOUND and e.get("action") == "stop"]
    if not stops and ExitCode.STRAGGLER_STOP not in codes.values():
        return None
    ranks = sorted({e["straggler_rank"] for e in stops if isinstance(e.get("straggler_rank"), int)})
    evidence = [f"rank {e.get('straggler_rank')} {e.get('score_kind')} score {e.get('score')} "
                f"below {e.get('threshold')} ({e.get('scope')}, {e.get('consecutive')} reports in a row)" for e in stops]
    return Verdict(STRAGGLER, ranks, [], evidence or ["a rank exited with STRAGGLER_STOP"], "straggler reports",
                   node=next((e.get("straggler_node") for e in stops), None),
                   fault_time=min((e["time"] for e in stops), default=None))


def _node_lost(events: List[dict], codes: Dict[int, int]) -> Optional[Verdict]:
    lost = [e for e in events if e["kind"] == ev.NODE_LOST]
    if not lost:
        return None
    nodes = sorted({str(e.get("lost_agent")) for e in lost})
    evidence = [f"{e.get('seen_by', 'a node')} {e.get('agent')} lost the heartbeat of {e.get('lost_agent')} "
                f"(round {e.get('round')})" for e in lost[:4]]
    return Verdict(NODE_LOST, [], sorted(codes), evidence, "rendezvous heartbeats", node=", ".join(nodes),
                   fault_time=min(e["time"] for e in lost))


def _rerun(events: List[dict], codes: Dict[int, int]) -> Optional[Verdict]:
    rerun_codes = (ExitCode.RERUN_RESUME_ELSEWHERE, ExitCode.RERUN_VALIDATION_FAILED)
    ranks = sorted(r for r, c in codes.items() if c in rerun_codes)
    if not ranks:
        return None
    return Verdict(RERUN, ranks, [], [f"rank {r} exited {ExitCode(codes[r]).name}" for r in ranks], "exit codes")


def _hang(events: List[dict], codes: Dict[int, int]) -> Optional[Verdict]:
    evidence_events = [e for e in events if e["kind"] == ev.HANG_EVIDENCE]
    detected = [e for e in events if e["kind"] == ev.FAULT_DETECTED and e.get("fault") == "hang"]
    if not evidence_events and not detected:
        return None
    states: Dict[int, dict] = {}
    for e in evidence_events:
        for rank, state in (e.get("ranks") or {}).items():
            try:
                states.setdefault(int(rank), state if isinstance(state, dict) else {})
            except ValueError:
                continue
    answers = {r: e.get("groups") or {} for r, e in _first_by_rank(events, ev.COLLECTIVES_REPORTED).items()}
    culprits: Dict[int, str] = {}
    waiting: Dict[int, str] = {}
    for rank, state in states.items():
        if state.get("process") == "stopped":
            culprits[rank] = STOPPED
        elif answers and rank not in answers and state.get("process") == "running":
            culprits[rank] = HANG_GIL  # its peers' link threads answered; its own never ran
    notes = _collective_positions(answers, culprits, waiting)
    silent = sorted(r for r in states if answers and r not in answers and r not in culprits)
    if silent and not culprits:  # blocked (not spinning) and did not answer: the likeliest
        culprits.update({r: HANG for r in silent})
        notes.append(f"ranks {silent} did not say where they were")
    basis = "collective sequence (Flight Recorder)" if notes else "monitor records"
    if not culprits and not waiting:
        first = min(states, key=lambda r: states[r].get("last_progress_time") or float("inf"), default=None)
        if first is None and detected:
            first = detected[0].get("rank")
        if first is not None:
            culprits[first] = HANG
            notes.append(f"no collective record: rank {first} was the first to fall silent")
        basis = "heartbeat and section records"
    if not culprits:
        group_notes = "; ".join(notes)
        return Verdict(COLLECTIVE_HANG, [], sorted(waiting), [group_notes], basis,
                       fault_time=_earliest_silence(states, waiting))
    kinds = set(culprits.values())
    kind = next(k for k in (STOPPED, HANG_GIL, HANG) if k in kinds)
    stacks = _first_by_rank(events, ev.STACKS_REPORTED)
    lines = []
    for rank in sorted(culprits):
        state = states.get(rank, {})
        line = f"rank {rank}: {culprits[rank]}; process {state.get('process', '?')}, silent {state.get('silent_s', '?')} s"
        if state.get("open_sections"):
            line += f", in section {', '.join(state['open_sections'])}"
        frames = main_thread_frames(stacks[rank].get("stacks", "")) if rank in stacks else ""
        lines.append(line + (f"; stack: {frames}" if frames else ""))
    lines += notes
    lines += [f"rank {r}: waiting, {why}" for r, why in sorted(waiting.items())]
    return Verdict(kind, sorted(culprits), sorted(waiting), lines, basis,
                   fault_time=_earliest_silence(states, culprits))


def _collective_positions(answers: Dict[int, dict], culprits: Dict[int, str], waiting: Dict[int, str]) -> List[str]:
    """Compare where the answering ranks are in each group; fill culprits and waiting."""
    notes = []
    groups = sorted({g for groups in answers.values() for g in groups})
    for group in groups:
        positions = {r: groups[group] for r, groups in answers.items() if isinstance(groups.get(group), dict)}
        if not positions:
            continue
        front = max(p.get("enqueued", 0) for p in positions.values())
        behind = sorted(r for r, p in positions.items() if p.get("enqueued", 0) < front)
        for rank, p in positions.items():
            if rank in behind:
                culprits.setdefault(rank, HANG)
            elif p.get("op") and rank not in culprits:
                waiting.setdefault(rank, f"in {p['op']} #{front} of group {group}")
        if behind:
            notes.append(f"group {group}: ranks {behind} never entered collective #{front}, which the others wait in")
        elif len(positions) > 1 or culprits:
            notes.append(f"group {group}: every rank that answered is in collective #{front}")
    # a rank absent from a group its peers are blocked in has not reached it either
    for rank in answers:
        if rank not in culprits and rank not in waiting and any(r in waiting for r in answers):
            culprits[rank] = HANG
    return notes


def _earliest_silence(states: Dict[int, dict], ranks) -> Optional[float]:
    times = [states[r].get("last_progress_time") for r in ranks if r in states]
    times = [t for t in times if isinstance(t, (int, float))]
    return min(times) if times else None


def _signaled(events: List[dict], codes: Dict[int, int]) -> Optional[Verdict]:
    signaled = [e for e in events if e["kind"] == ev.LAUNCHER_SIGNALED]
    if not signaled:
        return None
    evidence = [f"ft_launcher received {e.get('signal')} and forwarded it to ranks {e.get('running_ranks')}; "
                f"then the workers exited with {e.get('exit_codes')}" for e in signaled]
    return Verdict(SIGNALED, [], [], evidence, "the launcher's signal record", fault_time=signaled[0]["time"])


def _crash(events: List[dict], codes: Dict[int, int]) -> Optional[Verdict]:
    if not codes:
        return None
    exceptions = _first_by_rank(events, ev.WORKER_EXCEPTION)
    gone = _first_by_rank(events, ev.RANK_DISCONNECTED)
    stopped = _stopped_by_launcher(events)
    culprits: Dict[int, str] = {}
    waiting: List[int] = []
    lines = []
    for rank in sorted(set(codes) | set(exceptions)):
        code, exc = codes.get(rank), exceptions.get(rank)
        if exc is not None:
            text = f"{str(exc.get('type', '')).rsplit('.', 1)[-1]}: {str(exc.get('message', ''))[:200]}"
            if is_peer_error(exc):
                waiting.append(rank)
                lines.append(f"rank {rank}: failed waiting for a peer ({text})")
            else:
                culprits[rank] = EXCEPTION
                where = _innermost_frame(str(exc.get("traceback", "")))
                lines.append(f"rank {rank}: raised {text}" + (f" at {where}" if where else ""))
        elif rank in stopped:
            waiting.append(rank)
            lines.append(f"rank {rank}: stopped by the launcher ({_signal_name(code)}) after another rank failed")
        elif code is not None and code < 0:
            culprits[rank] = KILLED
            lines.append(f"rank {rank}: killed by {_signal_name(code)} (not sent by nvrx)")
    # A rank that vanished after another rank raised (not a peer error) was stopped because of it
    # (torch stops the other workers before the agent reports the failure), not killed by the fault.
    noticed = min([e["time"] for e in events if e["kind"] == ev.WORKERS_FAILED]
                  + [exceptions[r]["time"] for r in culprits if culprits[r] == EXCEPTION],
                  default=float("inf"))
    vanished = {r for r, e in gone.items() if e["time"] <= noticed}
    for rank in sorted(vanished - set(codes) - set(exceptions) - stopped):
        # gone before the agent looked (a peer's failure ended the cycle first), with no
        # exception: its process vanished, as a killed one does
        culprits[rank] = KILLED
        lines.append(f"rank {rank}: its process vanished (connection to the monitor dropped, no exception "
                     f"recorded): killed")
    if not culprits:
        unexplained = sorted(r for r, c in codes.items() if r not in waiting and c != 0)
        for rank in unexplained:
            culprits[rank] = EXITED
            lines.append(f"rank {rank}: exited with code {codes[rank]} (no exception recorded)")
    if not culprits:
        return Verdict(UNKNOWN, [], waiting, lines, "exit codes")
    kinds = set(culprits.values())
    kind = next(k for k in (KILLED, EXCEPTION, EXITED) if k in kinds)
    times = [exceptions[r]["time"] if r in exceptions else gone[r]["time"] for r in culprits if r in exceptions or r in gone]
    basis = "exception records" if EXCEPTION in kinds else "exit codes"
    return Verdict(kind, sorted(culprits), waiting, lines, basis, fault_time=min(times) if times else None)


def _innermost_frame(traceback_text: str) -> str:
    found = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', traceback_text)
    if not found:
        return ""
    path, line, name = found[-1]
    return f"{name} ({path.rsplit('/', 1)[-1]}:{line})"
