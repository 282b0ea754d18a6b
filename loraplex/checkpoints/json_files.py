"""Reading a JSON object from a file that may be hostile (an adapter's or a model's config): bounded in size,
deep nesting caught, anything but an object refused. Callers turn `JsonFileError` into their own error; its
text never holds the file's path."""

from __future__ import annotations

import json
import pathlib
from typing import Any


class JsonFileError(ValueError):
    """Why the file is not a readable JSON object, as a predicate ("is not valid JSON (...)")."""


def read_json_object(path: pathlib.Path, max_bytes: int) -> dict[str, Any]:
    try:
        if path.stat().st_size > max_bytes:
            raise JsonFileError(f"is larger than {max_bytes} bytes")
        value = json.loads(path.read_text())
    except OSError as exc:  # its strerror only: the exception's text holds the path
        raise JsonFileError(f"cannot be read ({exc.strerror})") from exc
    except RecursionError:
        raise JsonFileError("is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JsonFileError(f"is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise JsonFileError("is not a JSON object")
    return value
