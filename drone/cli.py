"""``hangar drone``: a worker that takes work orders from a relay and runs them."""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys

from hangar.shared import runtime
from hangar.shared.abort import AbortController, AbortError
from hangar.shared.cli import (
    add_log_level,
    add_setting,
    model_name,
    seconds,
    url,
    whole_number,
    work_directory,
)
from hangar.shared.protocol import SHOWN_NAME_PATTERN, drone_name_of
from hangar.shared.shown import without_password

from .tools.policy import ToolPolicy
from .worker import DEFAULT_MODELS, PROVIDERS, DroneConfig, run_drone

OPERATOR_STOP = "The drone's operator stopped it."
SHUT_DOWN = "The drone was shut down."
MAX_CONCURRENCY = 1024
"""As many work orders as a drone may say it runs at once (``DroneRecord``)."""

http_url = url("http", "https")


def tool_policy(text: str) -> ToolPolicy:
    try:
        return ToolPolicy.parse(text)
    except ValueError as error:
        raise ValueError(f"{error}.") from None


def yes_no(text: str) -> bool:
    answer = text.strip().lower()
    if answer in ("yes", "true", "1", "on"):
        return True
    if answer in ("no", "false", "0", "off"):
        return False
    raise ValueError(f"expected yes or no, got {text!r}.")


def worker_count(text: str) -> int | None:
    """A number of worker processes, or None for ``auto``."""
    if text.strip().lower() == "auto":
        return None
    return whole_number(0, MAX_CONCURRENCY, "auto or a whole number")(text)


def auto_workers(concurrency: int) -> int:
    """One worker process per core, at most one per work order run at once."""
    return min(concurrency, os.cpu_count() or 1)


def relay_urls(text: str) -> str:
    """One relay URL, or several separated by commas."""
    urls = [part.strip() for part in text.split(",")]
    for part in urls:
        try:
            http_url(part)
        except ValueError:
            raise ValueError(
                f"expected relay URLs starting with http:// or https://, separated by commas, "
                f"got {without_password(part)!r}."
            ) from None
    return ",".join(urls)


def ollama_host(text: str) -> str:
    """As Ollama itself reads ``OLLAMA_HOST``: a URL, or a bare ``host[:port]`` over http."""
    try:
        return http_url(text if "://" in text else f"http://{text}")
    except ValueError:
        raise ValueError(
            "expected a URL starting with http:// or https://, or host:port, got "
            f"{without_password(text)!r}."
        ) from None


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "drone", help="run a drone (worker)", description="Run a drone that takes work orders."
    )
    add_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_log_level(parser)
    add_setting(
        parser,
        "--server",
        env="HANGAR_SERVER",
        default="http://127.0.0.1:8080",
        check=relay_urls,
        help="relay URL, or several separated by commas, tried in turn on reconnect "
        "(HANGAR_SERVER; default %(default)s)",
    )
    add_setting(
        parser,
        "--token",
        env="HANGAR_DRONE_TOKEN",
        default="",
        help="the relay's drone token (HANGAR_DRONE_TOKEN)",
    )
    add_setting(
        parser,
        "--name",
        env="HANGAR_DRONE_NAME",
        default="",
        check=drone_name,
        help="name shown to people (HANGAR_DRONE_NAME; default: the drone token's name, else "
        "the host name)",
    )
    add_setting(
        parser,
        "--provider",
        env="HANGAR_PROVIDER",
        default="openai",
        check=provider,
        help="openai or ollama (HANGAR_PROVIDER; default %(default)s)",
    )
    add_setting(
        parser,
        "--model",
        env="HANGAR_MODEL",
        default="",
        check=model_name,
        help="model name (HANGAR_MODEL; default gpt-4o-mini for openai, llama3.2 for ollama)",
    )
    add_setting(
        parser,
        "--base-url",
        env=("HANGAR_BASE_URL", "OPENAI_BASE_URL"),
        default=None,
        check=http_url,
        help="OpenAI-compatible API base URL (HANGAR_BASE_URL or OPENAI_BASE_URL)",
    )
    add_setting(
        parser,
        "--api-key",
        env="OPENAI_API_KEY",
        default=None,
        help="OpenAI API key (OPENAI_API_KEY)",
    )
    add_setting(
        parser,
        "--ollama-host",
        env="OLLAMA_HOST",
        default=None,
        check=ollama_host,
        help="Ollama server URL (OLLAMA_HOST; default http://127.0.0.1:11434)",
    )
    add_setting(
        parser,
        "--concurrency",
        env="HANGAR_CONCURRENCY",
        default="1",
        check=whole_number(1, MAX_CONCURRENCY),
        help="work orders run at once (HANGAR_CONCURRENCY; default %(default)s)",
    )
    add_setting(
        parser,
        "--workers",
        env="HANGAR_WORKERS",
        default="auto",
        check=worker_count,
        help="worker processes that run the work orders, so the drone's connection stays "
        "responsive however busy they are; 0 runs them in the drone's own process "
        "(HANGAR_WORKERS; default auto: as many as the machine has cores, at most the "
        "concurrency)",
    )
    add_setting(
        parser,
        "--workdir",
        env="HANGAR_WORKDIR",
        default=".",
        check=work_directory,
        help="an existing directory, the only one the drone's tools may touch, and not one "
        "that holds a relay's database (HANGAR_WORKDIR; default: the current directory)",
    )
    add_setting(
        parser,
        "--deadline",
        env="HANGAR_DEADLINE",
        default="1800",
        check=seconds,
        help="seconds a work order may run before it ends in error (HANGAR_DEADLINE; "
        "default %(default)s; 0 for none)",
    )
    add_setting(
        parser,
        "--tools",
        env="HANGAR_TOOLS",
        default="",
        check=tool_policy,
        help="which tools run at once (allow), wait for a person's approval (ask) or are "
        "refused (deny), e.g. run_shell=ask,fetch_url=deny or all=allow (HANGAR_TOOLS; default "
        f"{ToolPolicy().describe()}; run_shell always asks where there is no sandbox)",
    )
    add_setting(
        parser,
        "--approval-timeout",
        env="HANGAR_APPROVAL_TIMEOUT",
        default="600",
        check=seconds,
        help="seconds a tool call waits for a person before it counts as declined "
        "(HANGAR_APPROVAL_TIMEOUT; default %(default)s)",
    )
    add_setting(
        parser,
        "--shell-network",
        env="HANGAR_SHELL_NETWORK",
        default="no",
        check=yes_no,
        help="whether sandboxed shell commands may use the network: yes or no "
        "(HANGAR_SHELL_NETWORK; default %(default)s)",
    )
    add_setting(
        parser,
        "--private-urls",
        env="HANGAR_PRIVATE_URLS",
        default="no",
        check=yes_no,
        help="whether fetch_url may reach private, loopback and link-local addresses: yes or no "
        "(HANGAR_PRIVATE_URLS; default %(default)s)",
    )
    add_setting(
        parser,
        "--cut-off",
        env="HANGAR_CUT_OFF",
        default="10",
        check=seconds,
        help="seconds out of touch with every relay after which running work orders are "
        "aborted; above the relays' --drone-grace plus 5 (HANGAR_CUT_OFF; default "
        "%(default)s; 0 for never)",
    )
    add_setting(
        parser,
        "--stall",
        env="HANGAR_STALL",
        default="120",
        check=seconds,
        help="seconds a model stream may bring nothing of its answer before it is closed and "
        "the work order ends in error (HANGAR_STALL; default %(default)s; 0 for none)",
    )
    add_setting(
        parser,
        "--status-line",
        env="HANGAR_STATUS_LINE",
        default="on",
        check=on_or_off,
        help="on: a live status line when standard error is a terminal; off: log lines only "
        "(HANGAR_STATUS_LINE; default %(default)s)",
    )


def config_from(args: argparse.Namespace) -> DroneConfig:
    return DroneConfig(
        server=args.server,
        token=args.token,
        name=args.name or drone_name_of(args.token) or host_name(),
        provider=args.provider,
        model=args.model or DEFAULT_MODELS.get(args.provider, ""),
        base_url=args.base_url,
        api_key=args.api_key,
        ollama_host=args.ollama_host,
        concurrency=args.concurrency,
        workers=auto_workers(args.concurrency) if args.workers is None else args.workers,
        deadline=args.deadline or None,
        stall=args.stall or None,
        cut_off=args.cut_off or None,
        workdir=args.workdir,
        tools=args.tools,
        approval_timeout=args.approval_timeout,
        shell_network=args.shell_network,
        allow_private_urls=args.private_urls,
    )


NO_API_KEY = (
    "hangar drone: the openai provider needs an API key (--api-key or OPENAI_API_KEY), or "
    "--base-url for a service that needs none."
)


def on_or_off(text: str) -> bool:
    """``--status-line``: on or off (in any case)."""
    if text.strip().lower() not in ("on", "off"):
        raise ValueError(f"expected on or off, got {text!r}.")
    return text.strip().lower() == "on"


def provider(text: str) -> str:
    if text not in PROVIDERS:
        raise ValueError(f"expected one of {', '.join(PROVIDERS)}, got {text!r}.")
    return text


def run(args: argparse.Namespace) -> int:
    if not args.token:
        print(
            "hangar drone: a drone token is required (--token or HANGAR_DRONE_TOKEN).",
            file=sys.stderr,
        )
        return 2
    config = config_from(args)
    if config.provider == "openai" and not (config.api_key or config.base_url):
        print(NO_API_KEY, file=sys.stderr)  # every turn would fail, 401, once it came
        return 2
    live_status = sys.stderr.isatty() and args.status_line

    async def main() -> int:
        root = AbortController()
        runtime.abort_on_signals(
            root,
            AbortError(OPERATOR_STOP, cause="operator"),
            AbortError(SHUT_DOWN, cause="shutdown"),
        )
        try:
            return await run_drone(config, root, live_status=live_status)
        except AbortError as error:
            if error is not root.signal.reason:
                raise
            return 0  # stopped while it started: its workers never ran (``WorkerPool.start``)

    return runtime.run(main())


def drone_name(text: str) -> str:
    """``--name``: a drone's id starts with it (empty: the token's name, else the host's)."""
    if text and not re.fullmatch(SHOWN_NAME_PATTERN, text):
        raise ValueError(
            "expected 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit, "
            f"got {text!r}."
        )
    return text


def host_name() -> str:
    """The host's name as a drone's name: what a name may hold of it (a name never reads as
    another drone's), cut to 64 characters."""
    kept = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()).lstrip("_.-")[:64]
    return kept or "drone"
