"""The `nvrx` command: `nvrx demo` and `nvrx incidents EVENTS_FILE`."""

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
    incidents = sub.add_parser("incidents", help="summarise the incidents in an events file")
    incidents.add_argument("events_file")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from nvrx_core.demo.run import run_demo

        return run_demo(nproc=args.nproc, steps=args.steps, workdir=args.workdir)
    from nvrx_core.events import read_events
    from nvrx_core.ft.incidents import summarize

    found = summarize(read_events(args.events_file))
    for incident in found:
        print(incident.describe())
    if not found:
        print("no failed restart cycles in", args.events_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
