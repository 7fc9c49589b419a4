"""Errors the engine raises at its edge; services map them to status codes."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (bad token id, too long, bad sampling value).

    Raised by `LLMEngine.add` before anything is allocated (a reservation the request came
    with is given back), so the engine keeps serving other requests. Maps to INVALID_ARGUMENT /
    HTTP 400.
    """


class CheckpointError(EngineError):
    """A model folder cannot be loaded: missing or corrupt file, unsupported architecture."""


class RanksFailed(EngineError):
    """A parallel engine's step failed across its ranks (one died, or hung past the collectives'
    deadline): its process group is gone, and the engine can serve no more."""
