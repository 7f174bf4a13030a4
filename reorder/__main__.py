"""Command line: `python -m reorder demo` (more sub-commands: `python -m reorder -h`)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from reorder import demo

    parser = argparse.ArgumentParser(prog="python -m reorder")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_args(sub.add_parser("demo", help="reorder a synthetic stream and check every invariant"))
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
