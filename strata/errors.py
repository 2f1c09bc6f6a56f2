"""User-facing error types: every problem a user can fix is a StrataError whose message names the
key or input, the bad value and what would be valid. The CLI prints these without a traceback."""


class StrataError(Exception):
    """Base class for errors caused by user input (config, files, command line)."""


class ConfigError(StrataError):
    """One or more problems in an experiment config; the message lists all of them."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config ({n} problem{'s' if n != 1 else ''}):\n{lines}")


class DataError(StrataError):
    """A token file or corpus that cannot be used as given."""


class CheckpointError(StrataError):
    """A checkpoint that is missing, incomplete or does not match the run."""
