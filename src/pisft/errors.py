"""Errors a user can cause. Each message names what is wrong and what to do."""


class PisftError(Exception):
    """A problem with the user's input, config or environment (not a bug in pisft).

    The CLI prints the message alone (no traceback) and exits with status 2.
    """


class DataError(PisftError):
    """Bad input data: the message names the file, episode and column."""


class ModelLoadError(PisftError):
    """Weights that do not match the architecture, or a source that cannot be read."""


class DeviceError(PisftError):
    """A requested device or backend is not available here."""


class Terminated(BaseException):
    """SIGTERM (or SIGHUP) reached the stage: raised in the main thread like KeyboardInterrupt for
    SIGINT, so every `finally` and `atomic_dir` cleans up (no temporary output left behind)."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def stop_on_termination() -> dict:
    """Turn SIGTERM and SIGHUP into `Terminated` in this process (main thread only); returns the
    handlers it replaced (`restore_handlers` puts them back, for a caller such as a test run)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, _frame):
        raise Terminated(signum)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}


def restore_handlers(previous: dict) -> None:
    import signal

    for sig, handler in previous.items():
        signal.signal(sig, handler)
