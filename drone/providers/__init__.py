"""Model providers: the agent loop sees only ``Provider``; each SDK stays in its own module."""

from .base import (
    ChatEvent,
    ChatOptions,
    Heard,
    Provider,
    ProviderError,
    TextChunk,
    ToolCallRequest,
    ToolSpec,
    UsageReport,
)
from .ollama_provider import OllamaProvider
from .openai_provider import OpenAIProvider

__all__ = [
    "ChatEvent",
    "ChatOptions",
    "Heard",
    "OllamaProvider",
    "OpenAIProvider",
    "Provider",
    "ProviderError",
    "TextChunk",
    "ToolCallRequest",
    "ToolSpec",
    "UsageReport",
]
