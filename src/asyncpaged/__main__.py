"""The ``asyncpaged`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncpaged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from asyncpaged.tools import pool_bench, sharing_report, waste_report

    waste_report.add_parser(sub)
    pool_bench.add_parser(sub)
    sharing_report.add_parser(sub)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
