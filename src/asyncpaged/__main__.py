"""The ``asyncpaged`` command line."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence


class _Version(argparse.Action):
    """``--version``: the versions it runs with, one per line (argparse's own action would
    rewrap them), then exit."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from asyncpaged.versions import version_text

        print(version_text())
        parser.exit()


def _error_line(exc: BaseException) -> str:
    """One line for a failure: its message (its type when it has none), then its cause's."""
    text = str(exc) or type(exc).__name__
    cause = exc.__cause__
    if cause is not None:
        text += f" ({type(cause).__name__}: {cause})" if str(cause) else f" ({cause!r})"
    return " ".join(text.split())


def _parser() -> argparse.ArgumentParser:
    from asyncpaged.tools import (
        bench,
        chat,
        cli_log,
        demo,
        pool_bench,
        serve,
        sharing_report,
        simulate,
        waste_report,
    )

    parser = argparse.ArgumentParser(prog="asyncpaged", description=__doc__)
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="the versions it runs with (torch, transformers, the kernels' "
                             "build, ...), and exit")  # fmt: skip
    parser.add_argument("--log-level", default="warning", choices=cli_log.LEVELS,
                        help="engine events shown on stderr (default: warning)")  # fmt: skip
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--system-malloc", action="store_true",
                        help="keep glibc's malloc settings (no tools/malloc_tuning.py), as a "
                             "host that embeds the engine has them")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    for tool in (demo, chat, bench, waste_report, pool_bench, sharing_report, simulate):
        tool.add_parser(sub)
    serve.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status. A failure is one line on stderr
    (``asyncpaged: error: ...``, the traceback too with ``--debug``) and status 2."""
    parser = _parser()
    args = parser.parse_args(argv)
    from asyncpaged.tools import cli_log
    from asyncpaged.tools.malloc_tuning import tune_this_process

    cli_log.configure(args.log_level)
    if not args.system_malloc:
        tune_this_process()  # an application's choice: keeps freed activations for reuse
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        sys.stderr.write(f"{parser.prog}: interrupted\n")
        return 130
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        sys.stderr.write(f"{parser.prog}: error: {_error_line(exc)}\n")
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
