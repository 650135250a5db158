"""Errors that the command line reports as one line, without a traceback."""


class FedLightningError(Exception):
    """Base class for user-facing errors (bad config, bad data, refused action)."""


class ConfigError(FedLightningError):
    """A config value is invalid. The message names the key and what was expected."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config `{key}`: {message}")
        self.key = key


class DataError(FedLightningError):
    """A data file is missing or malformed. The message names the file and the field."""

    def __init__(self, path: object, message: str) -> None:
        super().__init__(f"data file {path}: {message}")
        self.path = path


class TooFewClients(FedLightningError):
    """Fewer than ``federation.min_clients`` clients' messages remain in a round after the
    server dropped the failing or rejected ones; the run stops after its last checkpoint."""


class RunStopped(Exception):
    """A caller stopped a run on purpose (a pruned sweep trial); its checkpoint stays."""
