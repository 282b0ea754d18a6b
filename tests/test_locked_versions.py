"""The suite runs with the versions in requirements/lock.txt; a silent ecosystem change is named here first."""

from __future__ import annotations

from tests import locked_versions


def test_installed_versions_match_the_lock():
    pins = locked_versions.locked()
    assert {"transformers", "peft", "tokenizers", "safetensors"} <= set(pins), "the lock must pin the references"
    found = locked_versions.drift()
    assert not found, "installed versions differ from requirements/lock.txt:\n" + "\n".join(found)


def test_a_changed_pin_is_named(monkeypatch, tmp_path):
    lock = tmp_path / "lock.txt"
    peft = locked_versions.installed("peft")
    lock.write_text(f"# a comment\npeft=={peft}\ntransformers==0.0.1 ; python_version >= '3'\nno-such-package==1.0\n")
    monkeypatch.setattr(locked_versions, "LOCK", lock)
    assert locked_versions.drift() == [
        "no-such-package: installed nothing, the lock says 1.0",
        f"transformers: installed {locked_versions.installed('transformers')}, the lock says 0.0.1",
    ]
    assert any(line.startswith("DRIFT") for line in locked_versions.summary())
