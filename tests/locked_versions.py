"""The versions the suite runs with, against requirements/lock.txt (the versions CI last passed with).

A fresh machine installs through the lock, so the parity tests compare against the transformers and PEFT
they were written for. When the installed set drifts from it (an install made without the lock, or a lock
changed without reinstalling), the drift is named here, before any numeric mismatch it may cause.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

LOCK = pathlib.Path(__file__).resolve().parent.parent / "requirements" / "lock.txt"
# The libraries the parity tests take as ground truth, and torch (pinned by the Makefile, not the lock).
REFERENCES = ("torch", "transformers", "peft", "tokenizers", "safetensors")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, str]:
    """Package (normalized name) -> version, as the lock pins it."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        match = _PIN.match(line.strip())
        if match:
            pins[_normalized(match[1])] = match[2]
    return pins


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def drift() -> list[str]:
    """One line per locked package whose installed version differs (or that is missing)."""
    lines = []
    for name, version in sorted(locked().items()):
        have = installed(name)
        if have != version:
            lines.append(f"{name}: installed {have or 'nothing'}, the lock says {version}")
    return lines


def summary() -> list[str]:
    """The report header's lines: the reference libraries' versions, then the drift if any."""
    references = ", ".join(f"{name} {installed(name) or 'missing'}" for name in REFERENCES)
    lines = [f"versions: {references}"]
    found = drift()
    if found:
        lines.append(f"DRIFT from {LOCK.name}: {len(found)} package(s) differ (make install-test installs the lock):")
        lines.extend(f"  {line}" for line in found)
    else:
        lines.append(f"versions match {LOCK.relative_to(LOCK.parent.parent)} ({len(locked())} packages)")
    return lines
