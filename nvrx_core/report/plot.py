"""The report's picture: a timeline (ranks x time) and, when the run has straggler reports, a
heatmap of their scores. Needs matplotlib
(`pip install nvrx-suite[report]`); the text report does not."""

import base64
import html
import io
from typing import Dict, List, Tuple

from nvrx_core import events as ev
from nvrx_core.report.goodput import run_span



class MissingExtra(RuntimeError):
    pass


MAX_MARKS = 100
"""More checkpoints than this are not marked one by one (nor more than a tenth as many
incidents labelled): a long run would be a solid band of ticks and overlapping words."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtra("the picture needs matplotlib: pip install 'nvrx-suite[report]'") from None
    return plt


def _rows(events: List[dict]) -> List[int]:
    return sorted({e["rank"] for e in events if isinstance(e.get("rank"), int)})


def straggler_matrix(events: List[dict]) -> Tuple[List[int], List[float], Dict[Tuple[int, int], float]]:
    """(ranks, report times, {(rank index, report index): score}) from the straggler reports."""
    reports = [e for e in events if e["kind"] == ev.STRAGGLER_SCORES and isinstance(e.get("scores"), dict)]
    ranks = sorted({int(r) for e in reports for r in e["scores"] if str(r).isdigit()})
    cells = {}
    for j, e in enumerate(reports):
        for r, score in e["scores"].items():
            if str(r).isdigit() and isinstance(score, (int, float)):
                cells[(ranks.index(int(r)), j)] = float(score)
    return ranks, [e["time"] for e in reports], cells


def draw(report, plt):
    events = report.loaded.events
    start, end = run_span(events) if events else (0.0, 1.0)
    ranks = _rows(events)
    row = {r: i for i, r in enumerate(ranks)}
    s_ranks, times, cells = straggler_matrix(events)
    height = 2.2 + 0.45 * max(len(ranks), 2)
    if cells:
        fig, (timeline, heat) = plt.subplots(2, 1, figsize=(12, height + 0.45 * len(s_ranks) + 1.5),
                                             gridspec_kw={"height_ratios": [max(len(ranks), 2), max(len(s_ranks), 2)]})
    else:
        fig, timeline = plt.subplots(1, 1, figsize=(12, height))
    rel = lambda t: t - start  # noqa: E731
    g = report.goodput
    for cycle, step, t0, t1, kept in (g.executions if g else ()):
        timeline.barh(row.get(0, 0), t1 - t0, left=rel(t0), height=0.6, color="tab:green" if kept else "tab:orange",
                      edgecolor="none")
    commits = sum(1 for e in events if e["kind"] == ev.CHECKPOINT_COMMITTED)
    for e in events:
        if e["kind"] == ev.CHECKPOINT_COMMITTED and e.get("rank") in row and commits <= MAX_MARKS:
            timeline.plot([rel(e["time"])] * 2, [row[e["rank"]] - 0.4, row[e["rank"]] + 0.4], color="tab:blue", lw=1)
        elif e["kind"] == ev.STRAGGLER_FOUND and e.get("straggler_rank") in row:
            timeline.plot(rel(e["time"]), row[e["straggler_rank"]], marker="v", color="tab:purple", ms=9)
    for incident in report.incidents:
        v = incident.verdict
        if incident.fault_time is not None:
            for r in v.culprits:
                timeline.plot(rel(incident.fault_time), row.get(r, 0), marker="X", color="red", ms=11)
        if incident.fault_time is not None and incident.detected_time is not None:
            for r in v.waiting:
                timeline.barh(row.get(r, 0), incident.detected_time - incident.fault_time, left=rel(incident.fault_time),
                              height=0.3, color="tab:gray", hatch="//", edgecolor="black", lw=0.3)
        if incident.detected_time is not None:
            timeline.axvline(rel(incident.detected_time), color="red", ls="--", lw=1)
        if incident.detected_time is not None and incident.first_step_time is not None:
            timeline.axvspan(rel(incident.detected_time), rel(incident.first_step_time), color="gold", alpha=0.25)
            if len(report.incidents) <= MAX_MARKS // 10:
                timeline.text(rel(incident.detected_time), len(ranks) - 0.4, f" {v.kind}", fontsize=8, va="top")
    timeline.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    timeline.set_xlim(0, max(rel(end), 1e-3))
    timeline.set_ylim(-0.7, max(len(ranks), 1) - 0.3)
    timeline.invert_yaxis()
    ettr = f"ETTR {100 * g.ettr:.1f}%" if g and g.ettr is not None else "ETTR unknown"
    timeline.set_title(f"timeline: steps (green kept, orange redone), checkpoints (blue), faults (red X), "
                       f"waiting (hatched), recovery (gold); {len(report.incidents)} incidents, {ettr}", fontsize=9)
    timeline.set_xlabel("seconds since the launcher started")
    if cells:
        grid = [[cells.get((i, j), float("nan")) for j in range(len(times))] for i in range(len(s_ranks))]
        image = heat.imshow(grid, aspect="auto", cmap="RdYlGn", vmin=0.0, vmax=1.0, interpolation="nearest",
                            extent=(rel(times[0]), rel(times[-1]) if len(times) > 1 else rel(times[0]) + 1,
                                    len(s_ranks) - 0.5, -0.5))
        heat.set_yticks(range(len(s_ranks)), [f"rank {r}" for r in s_ranks])
        fig.colorbar(image, ax=heat, label="performance score (1 = fastest)")
        heat.set_title("straggler scores per report", fontsize=9)
    fig.tight_layout()
    return fig


def png_bytes(report) -> bytes:
    plt = _pyplot()
    fig = draw(report, plt)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_png(report, path: str) -> None:
    data = png_bytes(report)
    with open(path, "wb") as f:
        f.write(data)


def write_html(report, path: str) -> None:
    image = base64.b64encode(png_bytes(report)).decode()
    page = (f"<!doctype html><meta charset='utf-8'><title>nvrx report</title>"
            f"<img alt='timeline' src='data:image/png;base64,{image}'>"
            f"<pre>{html.escape(report.text())}</pre>")
    with open(path, "w") as f:
        f.write(page)
