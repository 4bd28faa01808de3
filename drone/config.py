"""A drone's settings, and the model provider they name (the drone's process and its worker
processes build theirs from the same settings)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from hangar.shared.protocol import DroneRecord, drone_name_of

from .approvals import APPROVAL_TIMEOUT
from .providers import OllamaProvider, OpenAIProvider, Provider
from .tools.policy import ToolPolicy

PROVIDERS = ("openai", "ollama")
DEFAULT_MODELS = {"openai": "gpt-4o-mini", "ollama": "llama3.2"}
_INSTANCE = secrets.token_hex(3)


@dataclass
class DroneConfig:
    server: str = "http://127.0.0.1:8080"
    token: str = ""
    name: str = ""
    provider: str = "openai"
    model: str = ""
    base_url: str | None = None
    api_key: str | None = None
    ollama_host: str | None = None
    concurrency: int = 1
    deadline: float | None = 1800.0
    stall: float | None = 120.0
    """Seconds a model stream may send nothing before the work order fails (None: no limit)."""
    cut_off: float | None = 10.0
    """Seconds out of touch with every relay after which the drone aborts what it runs: the
    relays have ended those turns by then (``--drone-grace``, and 5 s more after a relay
    restart). None: never."""
    max_retries: int = 2
    workdir: str | None = "."
    """Where the drone's tools read, write and run commands; None disables tools."""
    tools: ToolPolicy = field(default_factory=ToolPolicy)
    """Which tools run at once, wait for a person's approval, or are refused."""
    approval_timeout: float = APPROVAL_TIMEOUT
    shell_network: bool = False
    """Whether sandboxed shell commands may use the network."""
    allow_private_urls: bool = False
    """Whether ``fetch_url`` may reach private and loopback addresses."""
    workers: int = 0
    """Worker processes that run the work orders (``pool``); 0 runs them in the drone's own
    process (``hangar drone`` has its own default, see ``cli``)."""

    def drone_id(self) -> str:
        """The name a drone token carries; otherwise one stable for the life of this process,
        so a reconnect is recognised as the same drone."""
        return drone_name_of(self.token) or f"{self.name}-{_INSTANCE}"

    def record(self) -> DroneRecord:
        """What the relay is told of this drone (the provider and model ``make_provider``
        makes)."""
        return DroneRecord(
            drone_id=self.drone_id(),
            name=self.name,
            provider=self.provider,
            model=self.model or DEFAULT_MODELS[self.provider],
            concurrency=self.concurrency,
        )


def make_provider(config: DroneConfig) -> Provider:
    if config.provider == "openai":
        return OpenAIProvider(
            config.model or DEFAULT_MODELS["openai"],
            api_key=config.api_key,
            base_url=config.base_url,
            max_retries=config.max_retries,
        )
    if config.provider == "ollama":
        return OllamaProvider(config.model or DEFAULT_MODELS["ollama"], host=config.ollama_host)
    raise ValueError(f"Unknown provider {config.provider!r}: use one of {', '.join(PROVIDERS)}.")
