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

        # A Ctrl-C stops the command whenever it comes, also when a shell script started it in
        # the background, with SIGINT ignored (it was ignored while the command loaded, then
        # taken once its loop ran).
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        hold = hasattr(signal, "pthread_sigmask")
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
