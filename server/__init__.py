"""The relay: browsers and drones connect here; it turns requests into work orders and ends
each turn exactly once."""
