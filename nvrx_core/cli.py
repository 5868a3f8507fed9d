"""The `nvrx` command: `nvrx demo` and `nvrx report EVENTS_FILE_OR_RUN_DIR`."""

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="nvrx", description="nvrx-suite tools")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="4-rank CPU training under ft_launcher with an injected crash and hang")
    demo.add_argument("--nproc", type=int, default=4)
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--workdir", default=None, help="keep the run's files here (default: a temp dir)")
    for name, what in (("report", "what happened in a run, who caused it, and its goodput (ETTR)"),
                       ("incidents", "the same report (the command's earlier name)")):
        report = sub.add_parser(name, help=what)
        report.add_argument("events", metavar="EVENTS_FILE_OR_RUN_DIR",
                            help="an events file (ft_launcher --events-file), or a directory of *.jsonl files")
        report.add_argument("--png", default=None, help="also draw the timeline and straggler heatmap into this PNG")
        report.add_argument("--html", default=None, help="also write the report with its picture as one HTML page")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from nvrx_core.demo.run import run_demo

        return run_demo(nproc=args.nproc, steps=args.steps, workdir=args.workdir)
    from nvrx_core.report.build import build_report

    try:
        report = build_report(args.events)
    except (OSError, ValueError) as e:
        print(f"nvrx report: error: {e}", file=sys.stderr)
        return 2
    print(report.text())
    if args.png or args.html:
        from nvrx_core.report.plot import MissingExtra, write_html, write_png

        try:
            if args.png:
                write_png(report, args.png)
            if args.html:
                write_html(report, args.html)
        except MissingExtra as e:
            print(f"nvrx report: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
