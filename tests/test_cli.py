"""The `nanovllm` command line: every flag from the command line, else NANOVLLM_<FLAG>, else its default."""

from __future__ import annotations

import os

import pytest

from nanovllm import cli
from nanovllm.cli import (
    CLIENT_FLAGS,
    ENGINE_FLAGS,
    LOG_FLAGS,
    ROUTER_FLAGS,
    SERVE_FLAGS,
    WORKER_FLAGS,
    build_parser,
)
from nanovllm.common.server_config import RequestLimits, RouterConfig
from nanovllm.flags import Flag, build, resolve_all
from nanovllm.server_process import LISTENING_RE
from nanovllm.worker.config import EngineConfig

COMMANDS = {"serve": SERVE_FLAGS, "worker": WORKER_FLAGS, "router": ROUTER_FLAGS, "client": CLIENT_FLAGS}
ALL_FLAGS = [flag for flags in COMMANDS.values() for flag in flags]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No NANOVLLM_* variable from the surrounding environment leaks into these tests."""
    for name in list(os.environ):
        if name.startswith("NANOVLLM_"):
            monkeypatch.delenv(name)


def resolve(argv: list[str]) -> dict:
    args = build_parser().parse_args(argv)
    return resolve_all(COMMANDS[args.command], args)


# --- values ---------------------------------------------------------------------------------------------


def test_env_sets_a_value_flag(monkeypatch):
    """NANOVLLM_MAX_NUM_SEQS reaches max_num_seqs, converted to the flag's type."""
    monkeypatch.setenv("NANOVLLM_MAX_NUM_SEQS", "7")
    assert resolve(["worker", "--model", "m"])["max_num_seqs"] == 7


def test_command_line_beats_env(monkeypatch):
    """A flag on the command line wins over its environment variable."""
    monkeypatch.setenv("NANOVLLM_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("NANOVLLM_MODEL", "from-env")
    options = resolve(["worker", "--model", "m", "--max-num-seqs", "3"])
    assert options["max_num_seqs"] == 3
    assert options["model"] == "m"


@pytest.mark.parametrize(
    "argv, dest, value", [(["--port", "0"], "port", 0), (["--temperature", "0"], "temperature", 0.0)]
)
def test_falsy_command_line_value_still_beats_env(monkeypatch, argv, dest, value):
    """--port 0 or --temperature 0 on the command line is a value, not "unset": the env must not win."""
    monkeypatch.setenv("NANOVLLM_" + dest.upper(), "9")
    command = "client" if dest == "temperature" else "router"
    extra = ["p"] if command == "client" else ["--worker", "w:1"]
    assert resolve([command, *argv, *extra])[dest] == value


def test_defaults_apply_without_flag_or_env():
    """Neither flag nor env: each flag's default, typed."""
    options = resolve(["worker", "--model", "m"])
    assert options["max_num_seqs"] == 256
    assert options["port"] == 50061
    assert options["gpu_memory_utilization"] == 0.9
    assert options["kv_cache_memory"] is None  # 2GiB on CPU, the utilization share on CUDA
    assert options["no_prefix_caching"] is False
    assert options["log_level"] == "info"


def test_empty_env_counts_as_unset(monkeypatch):
    """NANOVLLM_X= (empty) gives the default, not a conversion error or an empty value."""
    monkeypatch.setenv("NANOVLLM_MAX_NUM_SEQS", "")
    monkeypatch.setenv("NANOVLLM_DEVICE", "")
    options = resolve(["worker", "--model", "m"])
    assert options["max_num_seqs"] == 256
    assert options["device"] == "auto"


def test_float_from_env(monkeypatch):
    """Float flags are converted from the environment too."""
    monkeypatch.setenv("NANOVLLM_TEMPERATURE", "0.7")
    monkeypatch.setenv("NANOVLLM_TOP_P", "0.5")
    options = resolve(["client", "hello"])
    assert options["temperature"] == pytest.approx(0.7)
    assert options["top_p"] == pytest.approx(0.5)


# --- lists ----------------------------------------------------------------------------------------------


def test_list_flag_from_env(monkeypatch):
    """NANOVLLM_WORKER is comma-separated; blanks around items and empty items are dropped."""
    monkeypatch.setenv("NANOVLLM_WORKER", "a:1, b:2,")
    assert resolve(["router"])["worker"] == ["a:1", "b:2"]


def test_list_flag_on_command_line_ignores_env(monkeypatch):
    """Repeated --worker flags replace the env list entirely (no merging)."""
    monkeypatch.setenv("NANOVLLM_WORKER", "a:1,b:2")
    assert resolve(["router", "--worker", "c:3", "--worker", "d:4"])["worker"] == ["c:3", "d:4"]


def test_list_flag_default(monkeypatch):
    """--stop without flag or env is an empty list; from the env it splits on commas."""
    assert resolve(["client", "p"])["stop"] == []
    monkeypatch.setenv("NANOVLLM_STOP", "END,###")
    assert resolve(["client", "p"])["stop"] == ["END", "###"]


# --- switches -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
        ("on", True),
        ("false", False),
        ("0", False),
    ],
)
def test_switch_from_env(monkeypatch, raw, expected):
    """A switch reads true/1/yes/on (any case) from the env as on, anything else as off."""
    monkeypatch.setenv("NANOVLLM_NO_PREFIX_CACHING", raw)
    assert resolve(["worker", "--model", "m"])["no_prefix_caching"] is expected


def test_switch_on_command_line(monkeypatch):
    """A switch given on the command line is on, whatever the env says."""
    monkeypatch.setenv("NANOVLLM_COMPLETION", "false")
    assert resolve(["client", "--completion", "p"])["completion"] is True
    assert resolve(["client", "p"])["completion"] is False


def test_switch_default_is_false_when_unset():
    """--completion has no declared default; unset it must still resolve to a falsy value, not crash."""
    assert not resolve(["client", "p"])["completion"]


# --- required flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, flag, env",
    [
        (["router"], "--worker", "NANOVLLM_WORKER"),
    ],
)
def test_missing_required_flag_names_its_env(monkeypatch, argv, flag, env):
    """Without the flag and its env variable the command exits, naming both."""
    with pytest.raises(SystemExit) as exc:
        resolve(argv)
    message = str(exc.value.code)
    assert flag in message and env in message


def test_required_flag_with_empty_env_still_missing(monkeypatch):
    """NANOVLLM_WORKER= (empty) does not satisfy --worker."""
    monkeypatch.setenv("NANOVLLM_WORKER", "")
    with pytest.raises(SystemExit, match="NANOVLLM_WORKER"):
        resolve(["router"])


def test_model_from_env_or_the_embedded_default(monkeypatch):
    """--model can come from the env alone; without either, None selects the embedded model."""
    assert resolve(["serve"])["model"] is None
    monkeypatch.setenv("NANOVLLM_MODEL", "/models/qwen")
    assert resolve(["serve"])["model"] == "/models/qwen"


# --- every flag -----------------------------------------------------------------------------------------


def sample(flag: Flag) -> tuple[str, object]:
    """An env value for `flag` and what it should resolve to."""
    if flag.kind == "switch":
        return "1", True
    if flag.kind == "tristate":
        return "off", False
    if flag.kind == "list":
        return "p:1,q:2", [flag.type("p:1"), flag.type("q:2")]
    if flag.type is int:
        return "5", 5
    if flag.type is float:
        return "0.5", 0.5
    return "xyz", flag.type("xyz")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_settable_from_env(monkeypatch, command):
    """Each flag of each subcommand is read from NANOVLLM_<FLAG>, and _resolve returns exactly the flags'
    destinations."""
    flags = COMMANDS[command]
    expected = {}
    for flag in flags:
        raw, value = sample(flag)
        monkeypatch.setenv(flag.env, raw)
        expected[flag.dest] = value
    argv = [command] + (["p"] if command == "client" else [])
    assert resolve(argv) == expected


def test_env_names_follow_the_flag_names():
    """NANOVLLM_<FLAG>: the documented naming, e.g. --max-num-seqs -> NANOVLLM_MAX_NUM_SEQS."""
    assert Flag("--max-num-seqs", "").env == "NANOVLLM_MAX_NUM_SEQS"
    for flag in ALL_FLAGS:
        assert flag.env == "NANOVLLM_" + flag.name.removeprefix("--").replace("-", "_").upper()


def _sample_value(flag: Flag) -> list[str]:
    """A command-line value for `flag` that parses and differs from its default (none for a switch)."""
    if flag.kind in ("switch", "tristate"):
        return []
    value = {int: "7", float: "0.25" if flag.default == 0.5 else "0.5"}.get(flag.type, "sample")
    assert str(flag.default) != value, flag.name
    return [value]


def _holds(command: list[str], args: list[str]) -> bool:
    return any(command[i : i + len(args)] == args for i in range(len(command)))


def test_serve_takes_every_worker_and_router_flag_and_hands_each_on():
    """`serve` takes every flag its worker and router take, and hands a value given to it to the process
    that takes that flag: the router's public address and ports to the router alone (its worker listens on
    a free local port), what both take otherwise (drain, tracing, logs, the TLS between them) to both."""
    serve = {flag.dest for flag in SERVE_FLAGS}
    assert {flag.dest for flag in ENGINE_FLAGS + LOG_FLAGS} <= serve
    assert {flag.dest for flag in ENGINE_FLAGS + LOG_FLAGS} <= {flag.dest for flag in WORKER_FLAGS}
    worker_names, router_names = {f.name for f in WORKER_FLAGS}, {f.name for f in ROUTER_FLAGS}
    for flag in WORKER_FLAGS + ROUTER_FLAGS:
        given = [flag.name, *_sample_value(flag)]
        worker, router = cli.serve_commands(resolve(["serve", *given]))
        to_worker = flag.name in worker_names and flag.name not in cli.SERVE_ROUTER_ONLY
        assert _holds(worker, given) == to_worker, (flag.name, worker)
        assert _holds(router, given) == (flag.name in router_names), (flag.name, router)
    assert cli.serve_commands(resolve(["serve"]))[0][:5] == ["worker", "--host", "127.0.0.1", "--port", "0"]


def test_required_flags_have_no_default():
    """A required flag with a default would never report itself missing."""
    for flag in ALL_FLAGS:
        if flag.required:
            assert flag.default is None, flag.name


# --- help -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_every_env_variable(command, capsys):
    """`nanovllm <command> --help` shows, for every flag, its env variable and default if any."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for flag in COMMANDS[command]:
        assert flag.name in text
        shown = "" if flag.default in (None, False, []) else f"; default {flag.default}"
        assert f"[env {flag.env}{shown}]" in text, flag.name


def test_top_level_help_lists_the_subcommands(capsys):
    """`nanovllm --help` lists the four subcommands."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


def test_a_subcommand_is_required(capsys):
    """`nanovllm` alone is a usage error, not a crash."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([])
    assert exc.value.code == 2
    assert "command" in capsys.readouterr().err


def test_announced_line_is_what_serve_waits_for(capsys):
    """run_serve and the tests read both addresses from the servers' first stdout line."""
    cli._announce("worker")("127.0.0.1:50061", "127.0.0.1:9091")
    line = capsys.readouterr().out
    assert LISTENING_RE.search(line).group(1) == "127.0.0.1:50061"
    assert line.rsplit(" ", 1)[-1].strip() == "127.0.0.1:9091"


def test_invalid_env_value_exits_naming_the_variable(monkeypatch):
    """A malformed environment value is a one-line error naming the variable, not a traceback."""
    monkeypatch.setenv("NANOVLLM_MAX_NUM_SEQS", "abc")
    with pytest.raises(SystemExit, match=r"NANOVLLM_MAX_NUM_SEQS='abc' is not a valid --max-num-seqs"):
        resolve(["worker", "--model", "m"])


# --- flags are the config dataclasses' fields -----------------------------------------------------------


def test_flags_build_the_configs_they_come_from(qwen3_dir):
    """Each flag sets its field, whatever the flag is called (--block-size is kvcache_block_size), and a
    negating switch turns its field off (--no-prefix-caching)."""
    model = ["--model", str(qwen3_dir)]
    options = resolve(["worker", *model, "--block-size", "32", "--no-prefix-caching", "--num-threads", "3"])
    engine = build(EngineConfig, options)
    assert (engine.kvcache_block_size, engine.enable_prefix_caching, engine.num_threads) == (32, False, 3)
    assert build(EngineConfig, resolve(["worker", *model])).enable_prefix_caching
    options = resolve(["router", "--worker", "a:1", "--drain-timeout", "5", "--max-prompt-bytes", "100"])
    router = build(RouterConfig, options, limits=build(RequestLimits, options))
    assert (router.workers, router.drain_timeout_s, router.limits.max_prompt_bytes) == (["a:1"], 5.0, 100)
    assert router.limits.max_stop_strings == RequestLimits().max_stop_strings
