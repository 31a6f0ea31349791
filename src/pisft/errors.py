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
