"""common/logging.py as the servers configure it, in a child process (configuration is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys

_LOG_AN_EXCEPTION = """
from nanovllm.common.logging import configure_logging, get_logger

configure_logging("info", json=True)
try:
    {}["missing"]
except KeyError as exc:
    try:
        raise RuntimeError("the engine step failed") from exc
    except RuntimeError:
        get_logger("test").exception("engine_step_failed", step=7)
"""


def test_json_log_carries_the_exception_type_message_and_traceback() -> None:
    """exc_info in a JSON log line becomes the exception chain (type, message, frames), not `true`."""
    proc = subprocess.run(
        [sys.executable, "-c", _LOG_AN_EXCEPTION], capture_output=True, text=True, timeout=60, check=True
    )
    (line,) = proc.stderr.splitlines()
    record = json.loads(line)
    assert (record["event"], record["level"], record["step"]) == ("engine_step_failed", "error", 7)
    assert "exc_info" not in record
    error, cause = record["exception"]
    assert (error["exc_type"], error["exc_value"]) == ("RuntimeError", "the engine step failed")
    assert (cause["exc_type"], cause["exc_value"], cause["is_cause"]) == ("KeyError", "'missing'", True)
    assert [frame["lineno"] for frame in error["frames"]] == [9]
    assert all("locals" not in frame for frame in error["frames"] + cause["frames"])


_LOG_FROM_ASYNCIO = """
import asyncio, gc
from nanovllm.common.logging import LogConfig

LogConfig(log_level="info", log_format="json").apply()

async def fail() -> None:
    raise ValueError("nobody awaits this")

async def main() -> None:
    task = asyncio.get_running_loop().create_task(fail())
    await asyncio.sleep(0)
    del task
    gc.collect()

asyncio.run(main())
"""


def test_a_server_renders_standard_library_records_as_json_too() -> None:
    """asyncio's "Task exception was never retrieved" (logged through the logging module) is one JSON line
    with the exception as a field, like the server's own events, not a plain-text traceback."""
    proc = subprocess.run(
        [sys.executable, "-c", _LOG_FROM_ASYNCIO], capture_output=True, text=True, timeout=60, check=True
    )
    (line,) = proc.stderr.splitlines()
    record = json.loads(line)
    assert (record["level"], record["logger"]) == ("error", "asyncio")
    assert record["event"].startswith("Task exception was never retrieved\nfuture: <Task finished")
    (error,) = record["exception"]
    assert (error["exc_type"], error["exc_value"]) == ("ValueError", "nobody awaits this")
