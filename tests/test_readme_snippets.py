"""Every ```python and ```bash block of README.md runs as pasted (the issue "A user's first hour").

Each block is one test, named by its line in README.md. Blocks that talk to `make serve`'s server
(127.0.0.1:8080 / localhost:8080) get a live server started with `make serve`'s flags; blocks that talk to
another port (8081) get a live server started with the flags of the README's last `loraplex serve ... --port
8081` block before them (the README shows how that server is started; the test starts it itself). The address
is rewritten to the live server's, then the block runs as a subprocess from the repository's root: bash blocks
with `bash -euo pipefail` (curl failing on an HTTP error status), python blocks with this interpreter (the
venv's). A block that cannot run here is preceded by `<!-- snippet: skip (reason) -->`.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass

import pytest

from tests.helpers import live_server

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LANGUAGES = ("python", "bash")
SKIP = re.compile(r"^\s*<!--\s*snippet:\s*skip\b\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")
FENCE_OPEN = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
ADDRESS = re.compile(r"\b(?:127\.0\.0\.1|localhost):(?P<port>\d+)")
MAKE_SERVE_PORT = "8080"
# At most this many blocks may be skipped (7 today: `make serve`/`make test`, two lists of server starts and
# benchmarks, the three extra servers the test starts itself, one benchmark). Raise it only for a block that
# truly cannot run in a test, never to get a broken example out of the way.
MAX_SKIPPED = 8
BLOCK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # the marker's reason ("" if the marker has none); None: not marked


def readme_blocks() -> list[Block]:
    lines = README.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE_OPEN.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, start = len(opening["indent"]), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1  # the closing fence
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP.match(before)
        skip = None if marker is None else (marker["reason"] or "").strip()
        blocks.append(Block(start + 1, opening["lang"], "\n".join(body) + "\n", skip))
    return blocks


BLOCKS = [b for b in readme_blocks() if b.lang in LANGUAGES]
RUNNABLE = [b for b in BLOCKS if b.skip is None]


def make_serve_args() -> tuple[str, ...]:
    """`make serve`'s flags (the Makefile's serve target), but its host and port."""
    adapters = sorted(p.name for p in (ROOT / "examples" / "adapters").iterdir() if p.is_dir())
    args = ("--default-max-tokens", "256", "--adapter-source", "local", "--adapter-root", "examples/adapters",
            "--preloaded-adapter-ids", *adapters)
    recipe = (ROOT / "Makefile").read_text().split("\nserve:", 1)[1].split("\n\n", 1)[0]
    for flag in (a for a in args if a.startswith("--")):
        assert flag in recipe, f"make serve no longer passes {flag}: update make_serve_args"
    return args


def serve_args(block: Block, port: str) -> tuple[str, ...]:
    """The flags of the README's last `loraplex serve ... --port <port>` command before `block`, without the port."""
    found = None
    for earlier in BLOCKS:
        if earlier.line >= block.line:
            break
        if earlier.lang != "bash":
            continue
        for command in earlier.code.replace("\\\n", " ").splitlines():
            if not command.startswith(".venv/bin/loraplex serve "):
                continue
            words = shlex.split(command, comments=True)
            if "--port" in words:
                at = words.index("--port")
                if words[at + 1] == port:
                    found = tuple(words[2:at] + words[at + 2:])
    assert found is not None, f"README.md:{block.line} talks to port {port}, but no earlier block starts a server there"
    return found


@pytest.fixture(scope="module")
def servers():
    """Live servers by their flags, started on first use, stopped when the module ends."""
    with ExitStack() as stack:
        started: dict[tuple[str, ...], str] = {}

        def server(args: tuple[str, ...]) -> str:
            if args not in started:
                started[args] = stack.enter_context(live_server(*args))
            return started[args]

        yield server


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: f"README.md:{b.line}-{b.lang}")
def test_readme_block_runs_as_pasted(block: Block, servers):
    code = block.code
    for port in sorted({m["port"] for m in ADDRESS.finditer(code)}):
        args = make_serve_args() if port == MAKE_SERVE_PORT else serve_args(block, port)
        url = servers(args).removeprefix("http://")
        code = re.sub(rf"\b(?:127\.0\.0\.1|localhost):{port}\b", url, code)
    if block.lang == "bash":
        # curl -s exits 0 on a 4xx/5xx answer: make an error answer fail the block (its body still shown).
        command = ["bash", "-euo", "pipefail", "-c", 'curl() { command curl --fail-with-body "$@"; }\n' + code]
    else:
        command = [sys.executable, "-c", code]
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"README.md:{block.line} ({block.code.splitlines()[0]!r}) ran past {BLOCK_TIMEOUT_S} s "
                    f"(mark it `<!-- snippet: skip (reason) -->` if it cannot run in a test):\n{e.output or ''}")
    assert done.returncode == 0, (
        f"README.md:{block.line} ({block.code.splitlines()[0]!r}) exited {done.returncode}:\n{done.stdout}")


def test_skip_markers_give_a_reason_and_stay_few():
    lines = README.read_text().splitlines()
    blocks_by_line = {b.line: b for b in readme_blocks()}
    for number, line in enumerate(lines, 1):
        if SKIP.match(line) or "snippet:" in line:
            marker = SKIP.match(line)
            assert marker and (marker["reason"] or "").strip(), f"README.md:{number}: a skip marker needs a (reason)"
            following = next(n for n in range(number + 1, len(lines) + 1) if lines[n - 1].strip())
            assert following in blocks_by_line and blocks_by_line[following].lang in LANGUAGES, (
                f"README.md:{number}: a skip marker must stand right before a ```python or ```bash block")
    skipped = [b for b in BLOCKS if b.skip is not None]
    assert len(skipped) <= MAX_SKIPPED, (
        f"{len(skipped)} README blocks are skipped (at most {MAX_SKIPPED}): "
        + ", ".join(f"README.md:{b.line} ({b.skip})" for b in skipped))
    assert len(RUNNABLE) > len(skipped), "most README blocks must run"
