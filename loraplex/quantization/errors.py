"""The one error quantization raises to the user."""


class QuantizationError(ValueError):
    """A quantization setting or checkpoint that cannot be served here; the message says why (one line, for the user)."""
