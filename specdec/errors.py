"""Error types the core raises for problems a user can fix, and for the states a service's core
refuses (unknown session, overload, a dependency down). Front ends (CLI, gRPC) turn them into
one-line messages or status codes at the edge (specdec/rpc/serving.py maps them, clients.py
maps status codes back); anything else is a bug and keeps its traceback."""


class SpecdecError(Exception):
    """Base class: the message is meant for the user, one line."""


class InvalidRequest(SpecdecError, ValueError):
    """Bad input: an empty prompt, an out-of-range parameter, a token outside the vocabulary."""


class ModelLoadError(SpecdecError):
    """A model path or id that cannot be loaded."""


class IncompatibleModels(SpecdecError):
    """A draft (or heads) that does not fit the target, e.g. a different vocabulary."""


class NotFound(SpecdecError):
    """An unknown (or evicted, or stale) session."""


class Overloaded(SpecdecError):
    """Too much work queued, or a request too large to serve."""


class Unavailable(SpecdecError):
    """A dependency is down or did not answer in time."""


class FailedPrecondition(SpecdecError):
    """The request is valid but cannot be served in the current state (e.g. a method not loaded)."""


class Aborted(SpecdecError):
    """A concurrent writer won (e.g. a session continued elsewhere)."""


class RemoteError(SpecdecError):
    """A service failed in a way the caller cannot fix (INTERNAL, UNKNOWN, ...)."""


def public_message(exc: BaseException, default: str) -> str:
    """The one line of an error a client may see (front ends map only SpecdecErrors through this)."""
    text = str(exc)
    return text.splitlines()[0][:500] if text.strip() else default
