"""The socket.io packet both ends of a Hangar connection use: JSON text only.

python-socketio's own packet searches every payload, value by value, for bytes to send as
binary attachments before it encodes it: about half the cost of encoding an event, in the relay
and in a drone (docs/performance.md, "Less per event in socket.io"). Hangar sends JSON only; a
bytes value fails to encode, loudly.
"""

from __future__ import annotations

from socketio import packet


class TextPacket(packet.Packet):  # type: ignore[misc]
    """socket.io's packet without the search for binary values."""

    uses_binary_events = False
