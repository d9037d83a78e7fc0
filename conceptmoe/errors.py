"""The one exception type user-facing commands turn into a one-line error and exit code 2."""


class UserError(Exception):
    """Bad input from the user (paths, flags, configs): reported without a traceback."""
