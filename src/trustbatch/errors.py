"""The one exception type that the CLI turns into a one-line message and exit code 2."""


class UserError(ValueError):
    """Bad input from the user: a config key, a value, a path, a name. The message names cause and fix."""
