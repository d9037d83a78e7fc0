"""The exceptions user-facing commands turn into one line on stderr and an exit code."""


class UserError(Exception):
    """Bad input from the user (paths, flags, configs): reported without a traceback, exit 2."""


class Interrupted(Exception):
    """A run stopped on a signal after saving its state; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
