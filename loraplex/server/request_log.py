"""One structured log line per HTTP request, on the logger `loraplex.requests`, written when the response ends.

`RequestLog` is a plain ASGI middleware, outside FastAPI's error handlers: it sees every request, those
refused before a route runs (validation errors, unknown paths, a missing API key, a body too large or too slow)
and those whose exception escapes (a 500) included; each that did not end ok and that nothing counted yet is
counted in `lorax_request_failure` as its line is written (Metrics.on_request_end), so the metric and the log
lines agree. A streamed response is logged when its stream ends or the client cuts it, not when its headers
go out. The request's `RequestRecord` is `request.state.log`, and `current()` anywhere in the request's
task (and the tasks it starts): the routes name the adapter there, `Metrics` adds the engine's numbers.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Sequence

from loraplex.server import tracing

if TYPE_CHECKING:
    from loraplex.engine.requests.output import RequestOutput

log = logging.getLogger("loraplex.requests")
NOT_LOGGED = ("counted_as", "arrived", "queued")  # the record's bookkeeping, not facts of the log line
MAX_REQUEST_ID = 128  # longer (or unprintable) x-request-id headers are replaced by our own id


@dataclass
class RequestRecord:
    request_id: str
    method: str
    route: str
    adapter: str | None = None  # as the client named it; None: the base model (or none named yet)
    status: int = 500  # until a response starts: an exception that escapes becomes a 500
    prompt_tokens: int = 0  # summed over the engine requests it ran (each of n choices, best_of runs)
    generated_tokens: int = 0  # every token its engine requests made, finished or not (cut, failed, timed out)
    queue_seconds: float = 0.0  # the longest of its engine requests'
    inference_seconds: float = 0.0
    total_seconds: float = 0.0
    complete: bool = False  # False: the response was cut (client gone), never sent, or ended by an error event
    # A failure after the response started (a stream's error event): its status stays the 200 that went out.
    error: str | None = None
    # How it ended, one of OUTCOMES; set where it is known (a timeout, the client leaving, the engine failing),
    # else from the status when the response ends. The log line, the trace span and the metrics say the same.
    outcome: str | None = None
    # The `err` label it was counted under in lorax_request_failure (Metrics): a request that did not end ok is
    # counted once, where its reason is known, else by RequestLog when it ends. Not a field of the log line.
    counted_as: str | None = None
    arrived: float = field(default_factory=time.perf_counter)  # when its record was made: as the request arrived
    queued: bool = False  # an engine request of it was queued (lorax_request_validation_duration observed then)

    def started_run(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens += num_prompt_tokens
        self.queued = True

    def finished_run(self, final: "RequestOutput") -> None:
        queue, total = final.timings.get("queue", 0.0), final.timings.get("total", 0.0)
        self.queue_seconds = max(self.queue_seconds, queue)
        self.inference_seconds = max(self.inference_seconds, total - queue)

    def span_attributes(self) -> dict:
        """The record's facts as its trace span carries them (tracing.py)."""
        return {
            "http.request.method": self.method, "http.route": self.route, "http.response.status_code": self.status,
            "loraplex.request_id": self.request_id, "loraplex.adapter": self.adapter or "",
            "loraplex.prompt_tokens": self.prompt_tokens, "loraplex.generated_tokens": self.generated_tokens,
            "loraplex.queue_seconds": self.queue_seconds, "loraplex.inference_seconds": self.inference_seconds,
            "loraplex.complete": self.complete, "loraplex.error": self.error or "",
            "loraplex.outcome": self.outcome or "",
        }

    @property
    def failed(self) -> bool:
        return self.status >= 500 or self.error is not None

    def settle(self) -> None:
        """The outcome, where nothing named it earlier: from the status and whether the response ended."""
        if self.outcome is None:
            self.outcome = ("failed" if self.failed else "refused" if self.status >= 400
                            else "ok" if self.complete else "client_gone")

    def fields(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items() if k not in NOT_LOGGED}


OUTCOMES = ("ok", "refused", "client_gone", "timed_out", "shutdown", "failed")

_current: ContextVar[RequestRecord | None] = ContextVar("loraplex_request", default=None)


def current() -> RequestRecord | None:
    """The record of the HTTP request being served (None outside one: the engine's own tests, /health's probe)."""
    return _current.get()


def note_failure(message: str) -> None:
    """The engine failed the request after its response may have started (a stream then ends with an error
    event): the log line says so, at WARNING, with complete=false, whatever status went out."""
    record = _current.get()
    if record is not None:
        first = (message.strip().splitlines() or ["generation failed"])[0]
        record.error = first if len(first) <= 200 else first[:197] + "..."
        record.outcome = "failed"


def note_unfinished_run(seconds: float) -> None:
    """An engine request ended without finishing (cut, failed, timed out) after `seconds` of running."""
    record = _current.get()
    if record is not None:
        record.inference_seconds = max(record.inference_seconds, seconds)


def note_token() -> None:
    """One more token made for the request (counted as made, so a cut or failed request reports them too)."""
    record = _current.get()
    if record is not None:
        record.generated_tokens += 1


def note_adapter(adapter_id: str | None, merged_ids: Sequence[str] = ()) -> None:
    """The adapter a request names, for its log line and its metrics' `adapter` label; a merge is named by its
    ids, comma-joined (as LoRAX's x-adapter-id header)."""
    record = _current.get()
    if record is not None and (adapter_id or merged_ids):
        record.adapter = adapter_id or ",".join(merged_ids)


class RequestLog:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, started_ns = time.perf_counter(), time.time_ns()
        record = RequestRecord(_request_id(scope), scope["method"], scope["path"])
        scope.setdefault("state", {})["log"] = record
        token = _current.set(record)

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", record.request_id.encode())]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                record.complete = record.error is None
            await send(message)

        escaped = False
        try:
            await self.app(scope, receive, send_and_note)
        except BaseException:
            escaped = True  # its 500 is counted by its handler (errors.py: internal), outside this layer
            raise
        finally:
            _current.reset(token)
            route = scope.get("route")  # set by the router: the template, not the path (no ids in routes)
            record.route = getattr(route, "path", record.route)
            record.total_seconds = time.perf_counter() - started
            record.settle()
            state = getattr(getattr(scope.get("app"), "state", None), "loraplex", None)
            if state is not None and not escaped:  # refused before any route (401, 404, 413...): counted here
                state.metrics.on_request_end(record)
            fields = record.fields()
            log.log(logging.WARNING if record.failed else logging.INFO, key_values(fields), extra={"fields": fields})
            tracing.record_span(f"{record.method} {record.route}", record.span_attributes(), record.failed,
                                started_ns, time.time_ns(), scope.get("headers", ()))


def _request_id(scope) -> str:
    """The client's x-request-id when it is a sane one (to correlate its logs with ours), else a new id."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            given = value.decode("latin-1")
            if 0 < len(given) <= MAX_REQUEST_ID and given.isprintable():
                return given
    return uuid.uuid4().hex


def key_values(fields: dict) -> str:
    return " ".join(f"{k}={_text(v)}" for k, v in fields.items())


def _text(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    # Client-given values (adapter, request id) are quoted when they could break the line's shape.
    if not text or text == "-" or any(c.isspace() or c in '"=\\' for c in text) or not text.isprintable():
        return json.dumps(text)
    return text
