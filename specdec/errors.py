"""Error types the core raises for problems a user can fix. Front ends (CLI, gRPC) turn them
into one-line messages or status codes; anything else is a bug and keeps its traceback."""


class SpecdecError(Exception):
    """Base class: the message is meant for the user, one line."""


class InvalidRequest(SpecdecError, ValueError):
    """Bad input: an empty prompt, an out-of-range parameter, a token outside the vocabulary."""


class ModelLoadError(SpecdecError):
    """A model path or id that cannot be loaded."""


class IncompatibleModels(SpecdecError):
    """A draft (or heads) that does not fit the target, e.g. a different vocabulary."""
