"""Why an adapter cannot be served: not found (404), found but refused (422 native / 400 OpenAI), its name taken
(409, run-time loads), or its source cannot be reached (503)."""


class AdapterError(Exception):
    """An adapter could not be served; the message says which and why."""


class AdapterNotFound(AdapterError):
    """No adapter by that name in the source asked for."""


class AdapterInvalid(AdapterError):
    """The adapter was found but cannot be served (unsupported option, bad tensors, ...)."""


class AdapterNameTaken(AdapterError):
    """A run-time load under a name that already serves an adapter, without asking to replace it (409)."""


class AdapterSourceUnavailable(AdapterError):
    """The adapter's source (the hub, S3) cannot be reached now: nothing is known of the adapter itself."""
