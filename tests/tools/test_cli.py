"""The command line's manners: --version, one-line errors with status 2 (--debug: the
traceback), --log-level through stdlib logging, a line on stderr for the kernel build."""

from __future__ import annotations

import shutil
from importlib.metadata import version
from pathlib import Path

import pytest

from asyncpaged import __version__
from asyncpaged.__main__ import main
from asyncpaged.kernels import cpu_build
from asyncpaged.tools import cli_log
from asyncpaged.versions import NOT_INSTALLED, distribution_version


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """``--version`` prints what the engine runs with: Python, the distributions its results
    depend on and the native kernels' build, one ``name version`` line each."""
    import platform

    import torch
    import transformers

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert lines["asyncpaged"] == __version__
    assert lines["python"] == platform.python_version()
    assert lines["torch"] == torch.__version__
    assert lines["transformers"] == transformers.__version__
    assert lines["xgrammar"] == version("xgrammar")
    target = cpu_build.select_target()
    compiler = cpu_build.find_compiler()
    assert compiler is not None
    library = cpu_build.library_path(cpu_build.SOURCES, target, compiler, Path(),
                                     cpu_build.HEADERS)  # fmt: skip
    assert lines["cpu_kernels"] == f"{target} {library.stem.rsplit('-', 1)[-1]}"
    assert distribution_version("no-such-distribution-here") == NOT_INSTALLED


def test_log_level_choices_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--log-level", "loud", "pool-bench"])
    assert done.value.code == 2
    assert "invalid choice: 'loud'" in capsys.readouterr().err


def test_an_error_is_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = str(tmp_path / "no-such-checkpoint")
    assert main(["generate", "--model", missing, "Hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncpaged: error: ") and err.count("\n") == 1, err
    assert "no-such-checkpoint" in err
    assert main(["--debug", "generate", "--model", missing, "Hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.splitlines()[-1].startswith("asyncpaged: error: ")


def test_log_level_shows_the_events_on_stderr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from asyncpaged.testing.tiny_models import build_tiny_checkpoint

    model = str(build_tiny_checkpoint("llama-gqa", tmp_path / "m"))
    capsys.readouterr()
    assert main(["generate", "--model", model, "The block", "--max-tokens", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("The block")
    assert "engine_started" not in captured.err and "request_added" not in captured.err
    argv = ["--log-level", "debug", "generate", "--model", model, "x", "--max-tokens", "2"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert " INFO    asyncpaged.engine: engine_started " in err
    assert " DEBUG   asyncpaged.actors.scheduler: request_added actor='scheduler'" in err


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_kernel_build_prints_a_progress_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int asyncpaged_vec_bytes() { return ASYNCPAGED_VEC_BYTES; }\n')
    cli_log.configure("warning")
    assert cpu_build.build(source, "baseline", tmp_path / "cache") is not None
    lines = capsys.readouterr().err.splitlines()
    cache = tmp_path / "cache"
    assert lines[0] == f"asyncpaged: building native CPU kernels (one time, ~15 s) in {cache} ..."
    assert lines[1].startswith("asyncpaged: native CPU kernels built in ")
    assert len(lines) == 2
    assert cpu_build.build(source, "baseline", tmp_path / "cache") is not None  # cached
    assert capsys.readouterr().err == ""


def test_system_malloc_leaves_glibc_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncpaged.tools import malloc_tuning

    calls: list[bool] = []
    monkeypatch.setattr(malloc_tuning, "tune_this_process", lambda: calls.append(True) or True)
    missing = str(tmp_path / "no-such-checkpoint")
    assert main(["--system-malloc", "generate", "--model", missing, "Hi"]) == 2
    assert calls == []
    assert main(["generate", "--model", missing, "Hi"]) == 2
    assert calls == [True]
    capsys.readouterr()
