"""What the relay and the drone both use: the wire protocol, the abort primitives, how the
processes run, and the ``hangar`` command."""
