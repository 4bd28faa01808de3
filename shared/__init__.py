"""What the relay and the drone both use: the wire protocol, the abort primitives, how the
processes run, and the ``hangar`` command."""


def main() -> int:
    """The installed ``hangar`` command: a Ctrl-C while the command loads exits 130 quietly
    (``hangar.shared.cli`` catches those that come later).

    While it loads, Ctrl-C is held back and looked at once loading is done: one that broke into
    an import could surface as another error (CPython turns it into a TypeError where it
    interrupts the building of an ImportError that the code catches).
    """
    import sys

    try:
        import signal

        # Held back unless ignored from the start (a script's background job): then it stays so.
        hold = hasattr(signal, "pthread_sigmask") and signal.getsignal(signal.SIGINT) is not (
            signal.SIG_IGN
        )
        if hold:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        from .cli import main as run

        if hold:
            if signal.SIGINT in signal.sigpending():
                raise KeyboardInterrupt
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a later one: raised here
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return run()
