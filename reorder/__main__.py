"""Command line: `python -m reorder demo` (real processes, invariants checked every window) and
`python -m reorder simulate` (what-if replay of your own per-sample costs); `python -m reorder -h`.

Exit status: 0 success, 1 the run failed (an invariant, a rank), 2 bad flags or a bad input file.
"""

from __future__ import annotations

import argparse
import os
import sys


def _prog() -> str:
    """How the user ran us: `python -m reorder` (argv[0] is this file) or the `reorder` console script."""
    return "python -m reorder" if os.path.basename(sys.argv[0]) == "__main__.py" else "reorder"


def main(argv=None) -> int:
    from reorder.cli import demo
    from reorder.cli import simulate
    from reorder.cli.common import CliError

    prog = _prog()
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Rebalance multimodal micro-batches across DP ranks: demo and "
                                                 "what-if simulator.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_args(sub.add_parser(
        "demo", help="real Gloo processes reorder a synthetic stream; every invariant checked every window",
        description=demo.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter))
    simulate.add_args(sub.add_parser(
        "simulate", help="replay per-sample costs / image sizes from a file (or a synthetic mix) per balancer",
        description=simulate.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            demo.run(args)
        else:
            simulate.run(args)
    except CliError as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr, flush=True)
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
