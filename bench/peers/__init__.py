"""Local HTTP stand-ins for upstream LLM services, speaking their real wire formats."""

from .base import RecordedRequest, Reply, ScriptedToolCall, UpstreamPeer
from .ollama_peer import OllamaPeer
from .openai_peer import OpenAIPeer

__all__ = [
    "OllamaPeer",
    "OpenAIPeer",
    "RecordedRequest",
    "Reply",
    "ScriptedToolCall",
    "UpstreamPeer",
]
