"""The ``asyncpaged`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _configure_logging(level: str) -> None:
    """The command line is an application: it routes the library's structlog events to stderr."""
    import logging
    import sys

    import structlog

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncpaged", description=__doc__)
    parser.add_argument("--log-level", default="warning", help="engine events on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    from asyncpaged.tools import (
        bench,
        chat,
        demo,
        pool_bench,
        sharing_report,
        simulate,
        waste_report,
    )

    demo.add_parser(sub)
    chat.add_parser(sub)
    bench.add_parser(sub)
    waste_report.add_parser(sub)
    pool_bench.add_parser(sub)
    sharing_report.add_parser(sub)
    simulate.add_parser(sub)
    args = parser.parse_args(argv)
    _configure_logging(args.log_level)
    from asyncpaged.tools.malloc_tuning import tune_this_process

    tune_this_process()  # an application's choice: keeps freed activations for reuse
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
