"""The playground page in real headless Chromium, against the real `loraplex serve` process.

Chromium is driven over its DevTools protocol (a websocket, through aiohttp): real key input and real
mouse clicks at the elements' positions, and the DOM read back by polling with deadlines.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import pytest

from tests.helpers import live_server

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
]


@pytest.fixture(scope="module")
def server():
    with live_server("--max-concurrent-requests", "4") as url:
        yield url


@pytest.fixture(scope="module")
def devtools():
    """A headless Chromium; yields its DevTools HTTP endpoint."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "Chromium is not installed: run `make browser` (it installs Debian's chromium package)"
    profile = Path(tempfile.mkdtemp(prefix="loraplex-chromium-"))
    log = open(profile.parent / f"{profile.name}.log", "w+")
    proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        active = profile / "DevToolsActivePort"  # Chromium writes its chosen port here once it listens
        deadline = time.monotonic() + 30
        while not (active.exists() and active.read_text().strip()) and proc.poll() is None:
            assert time.monotonic() < deadline, "Chromium did not open its DevTools port in 30 s"
            time.sleep(0.05)
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"Chromium exited with {proc.returncode}:\n{log.read()[-4000:]}")
        yield f"http://127.0.0.1:{active.read_text().split()[0]}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        shutil.rmtree(profile, ignore_errors=True)
        os.unlink(log.name)


class Page:
    """The few DevTools commands the tests need, on one page target."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.ids, self.pending, self.errors = ws, itertools.count(1), {}, []
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self.ws:
            data = json.loads(message.data)
            if "id" in data:
                self.pending.pop(data["id"]).set_result(data)
            elif data.get("method") == "Runtime.exceptionThrown":
                self.errors.append(data["params"]["exceptionDetails"])

    async def call(self, method: str, **params) -> dict:
        future = asyncio.get_running_loop().create_future()
        self.pending[message_id := next(self.ids)] = future
        await self.ws.send_json({"id": message_id, "method": method, "params": params})
        answer = await asyncio.wait_for(future, timeout=15)
        assert "error" not in answer, f"{method}: {answer['error']}"
        return answer["result"]

    async def js(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, f"{expression}: {result['exceptionDetails']}"
        return result["result"].get("value")

    async def wait_for(self, expression: str, what: str, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while not (value := await self.js(expression)):
            assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
            await asyncio.sleep(0.02)
        return value

    async def click(self, selector: str) -> None:
        """A real mouse click at the middle of the element."""
        box = await self.js(f"(() => {{ const e = document.querySelector({selector!r}); e.scrollIntoView({{block: 'center'}});"
                            f" const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()")
        for kind in ("mousePressed", "mouseReleased"):
            await self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    async def fill(self, selector: str, text: str) -> None:
        """Click into a field, select what is there and type over it."""
        await self.click(selector)
        await self.js(f"document.querySelector({selector!r}).select()")
        await self.call("Input.insertText", text=text)

    async def text(self, selector: str) -> str:
        return await self.js(f"(document.querySelector({selector!r}) || {{}}).textContent || ''")


VISITS = itertools.count(1)


async def open_playground(devtools: str, server: str, session: aiohttp.ClientSession) -> Page:
    async with session.get(f"{devtools}/json/list") as response:
        targets = [t for t in await response.json() if t["type"] == "page"]
    ws = await session.ws_connect(targets[0]["webSocketDebuggerUrl"], max_msg_size=0)
    page = Page(ws)
    await page.call("Runtime.enable")
    await page.call("Page.enable")
    visit = f"?visit={next(VISITS)}"  # a fresh page each time; tells the new document from the last one
    await page.call("Page.navigate", url=f"{server}/playground{visit}")
    await page.wait_for(f"location.search === {visit!r} && document.readyState === 'complete'", "the page to load")
    await page.wait_for("document.getElementById('model').dataset.loaded === 'true'", "the model picker to fill")
    return page


def run_in_browser(devtools: str, server: str, scenario) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            page = await open_playground(devtools, server, session)
            try:
                await scenario(page)
                assert not page.errors, f"JavaScript errors on the page: {page.errors}"
            finally:
                await page.ws.close()
                page.reader.cancel()

    asyncio.run(main())


async def wait_until_idle(page: Page) -> None:
    await page.wait_for("!document.getElementById('send').disabled", "the generation to end")


def test_page_is_self_contained_and_root_redirects(server):
    root = httpx.get(f"{server}/", timeout=10)
    assert root.status_code in (302, 307) and root.headers["location"] == "/playground"
    page = httpx.get(f"{server}/playground", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    for ident in ("prompt", "send", "stop", "output", "tps", "count", "model", "mode-chat", "max-new-tokens",
                  "temperature", "top-p", "top-k", "repetition-penalty", "seed", "stop-sequences"):
        assert f'id="{ident}"' in html
    for external in ('src="http', "src='http", 'href="http', "@import", "url(", "//fonts."):
        assert external not in html, f"the page must work offline; found {external!r}"


def test_completion_streams_token_by_token(server, devtools):
    listed = httpx.get(f"{server}/v1/models", timeout=10)
    expected_ids = [m["id"] for m in listed.json()["data"]] if listed.status_code == 200 else [BASE_MODEL]
    prompt, max_new = "The capital of France is", 24
    reference = httpx.post(f"{server}/generate", json={"inputs": prompt, "parameters": {
        "max_new_tokens": max_new, "ignore_eos_token": True}}, timeout=120).json()["generated_text"]

    async def scenario(page: Page) -> None:
        options = await page.js("[...document.querySelectorAll('#model option')].map(o => o.value)")
        assert BASE_MODEL in options and set(expected_ids) <= set(options), options
        assert await page.js("document.getElementById('model').value") == BASE_MODEL
        await page.fill("#max-new-tokens", str(max_new))
        await page.click("#ignore-eos")
        await page.fill("#prompt", prompt)
        await page.click("#send")
        seen: list[str] = []  # distinct partial outputs observed while the request was running
        deadline = time.monotonic() + 40
        while True:
            state = await page.js("({text: (document.getElementById('reply') || {}).textContent || '',"
                                  " busy: document.getElementById('send').disabled})")
            if state["busy"] and state["text"] and state["text"] not in seen:
                seen.append(state["text"])
            if not state["busy"]:
                break
            assert time.monotonic() < deadline, "generation did not finish in 40 s"
            await asyncio.sleep(0.01)
        status = await page.text("#status")
        assert status.startswith("done"), status
        assert await page.text("#reply") == await page.text("#output") == reference
        assert int(await page.text("#count")) == max_new
        assert float(await page.text("#tps")) > 0
        assert int(await page.js("document.getElementById('output').dataset.reads")) > 1, "the body arrived in one read"
        assert len(seen) >= 2 and all(reference.startswith(s) for s in seen), seen  # it grew while streaming

    run_in_browser(devtools, server, scenario)


def batch_size(server: str) -> float:
    for line in httpx.get(f"{server}/metrics", timeout=10).text.splitlines():
        if line.startswith("lorax_batch_current_size "):
            return float(line.split()[1])
    raise AssertionError("lorax_batch_current_size missing from /metrics")


def test_stop_aborts_the_request_on_the_server(server, devtools):
    async def scenario(page: Page) -> None:
        await page.fill("#max-new-tokens", "2000")
        await page.click("#ignore-eos")
        await page.fill("#prompt", "Count to one thousand:")
        await page.click("#send")
        await page.wait_for("Number(document.getElementById('count').textContent) >= 3", "the first tokens")
        assert batch_size(server) == 1
        await page.click("#stop")
        await wait_until_idle(page)
        assert (await page.text("#status")).startswith("stopped"), await page.text("#status")
        count = int(await page.text("#count"))
        assert 3 <= count < 2000
        deadline = time.monotonic() + 15
        while batch_size(server) != 0:  # the server dropped the request when the browser went away
            assert time.monotonic() < deadline, "the server kept generating after Stop"
            await asyncio.sleep(0.05)
        assert int(await page.text("#count")) == count

    run_in_browser(devtools, server, scenario)


def test_chat_mode_keeps_the_conversation(server, devtools):
    async def scenario(page: Page) -> None:
        await page.click("#mode-chat")
        await page.fill("#max-new-tokens", "12")
        for n, message in enumerate(["Hello! What is your name?", "And what can you do?"], start=1):
            await page.fill("#prompt", message)
            await page.click("#send")
            await wait_until_idle(page)
            assert (await page.text("#status")).startswith("done"), await page.text("#status")
            turns = await page.js("[...document.querySelectorAll('#output .turn')].map(t => [t.dataset.role, t.textContent])")
            assert [role for role, _ in turns] == ["user", "assistant"] * n
            assert turns[-2][1] == message and turns[-1][1].strip()
            assert await page.js("document.getElementById('prompt').value") == ""

    run_in_browser(devtools, server, scenario)


def test_api_docs_render_the_routes_in_the_browser(server, devtools):
    """/docs in Chromium: Swagger UI must read the OpenAPI document FastAPI writes (3.1) and list the routes."""

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{devtools}/json/list") as response:
                targets = [t for t in await response.json() if t["type"] == "page"]
            ws = await session.ws_connect(targets[0]["webSocketDebuggerUrl"], max_msg_size=0)
            page = Page(ws)
            try:
                await page.call("Runtime.enable")
                await page.call("Page.enable")
                await page.call("Page.navigate", url=f"{server}/docs?visit={next(VISITS)}")
                await page.wait_for("document.querySelectorAll('.opblock').length > 5 || (document.body !== null "
                                    "&& document.body.innerText.includes('Unable to render'))", "Swagger UI to render")
                text = await page.js("document.body.innerText")
                assert "Unable to render" not in text, text[:500]
                paths = await page.js("[...document.querySelectorAll('.opblock-summary-path')].map(e => e.innerText)")
                for route in ("/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions", "/info"):
                    assert any(p.replace("\u200b", "") == route for p in paths), (route, paths)
                assert not page.errors, f"JavaScript errors on the page: {page.errors}"
            finally:
                await page.ws.close()
                page.reader.cancel()

    asyncio.run(main())
