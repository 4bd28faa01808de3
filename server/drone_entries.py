"""Drones' entries in Redis: one per drone, written by the relay it is connected to and
refreshed every ``HEARTBEAT``; an entry its relay stopped refreshing (it died) is no drone."""

from __future__ import annotations

import json
import time
from typing import Any

from .live_state import DroneRoute

HEARTBEAT = 1.0
"""Seconds between a relay's refreshes of its drones' entries."""
PRESENCE_FLOOR = 2 * HEARTBEAT + 2.0
"""A drone entry lasts at least two heartbeats and a slow Redis write (``CALL_TIMEOUT``): a
relay late by a beat, or whose Redis is slow, is not dead."""
CLAIM = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held then
  local entry = cjson.decode(held)
  local age = tonumber(ARGV[4]) - math.max(entry.seen or 0, tonumber(ARGV[5]))
  if age <= (entry.lasts or tonumber(ARGV[6])) then
    return entry.instance ~= ARGV[3] and held or false
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return false
"""
"""A drone's entry written unless a live one is there; that one returned if another instance's
(arguments: drone id, entry, instance, now, ``_trusted_from``, ``PRESENCE_FLOOR``). Redis must
run scripts (``EVAL``): a relay checks that it may as it starts."""


def entry(route: DroneRoute, lasts: float) -> str:
    """A drone's entry, seen now, lasting ``lasts`` seconds unless refreshed."""
    return json.dumps({**route.model_dump(), "seen": time.time(), "lasts": lasts})


def alive(text: Any, trusted_from: float) -> DroneRoute | None:
    """The drone of an entry, unless its relay has not refreshed it within the time it said."""
    route, seen, lasts = _read(text)
    return None if time.time() - max(seen, trusted_from) > lasts else route


def route_of(text: Any) -> DroneRoute:
    """The drone of an entry, however old."""
    return _read(text)[0]


def _read(text: Any) -> tuple[DroneRoute, float, float]:
    """An entry's drone, when it was last seen, and how long it lasts unrefreshed."""
    fields = json.loads(text)
    lasts = float(fields.pop("lasts", PRESENCE_FLOOR))
    seen = float(fields.pop("seen", 0))
    return DroneRoute.model_construct(**fields), seen, lasts
