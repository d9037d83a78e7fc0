"""The exceptions user-facing commands turn into one line on stderr and an exit code."""


class UserError(Exception):
    """Bad input from the user (paths, flags, configs): reported without a traceback, exit 2."""


class Interrupted(Exception):
    """A run stopped on a signal after saving its state; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, exit_code: int, resume: str | None = None) -> None:
        super().__init__(message if resume is None else f"{message}; {resume}")
        self.exit_code, self.stopped, self.resume = exit_code, message, resume

    def resumed_by(self, how: str) -> "Interrupted":
        """The same stop, told how to continue from the command that ran it (compare: rerun it)."""
        return Interrupted(self.stopped, self.exit_code, how)
