"""Why an adapter cannot be served: not found (404), or found but refused (422 native / 400 OpenAI)."""


class AdapterError(Exception):
    """An adapter could not be served; the message says which and why."""


class AdapterNotFound(AdapterError):
    """No adapter by that name in the source asked for."""


class AdapterInvalid(AdapterError):
    """The adapter was found but cannot be served (unsupported option, bad tensors, ...)."""
