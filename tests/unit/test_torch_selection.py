"""requirements/torch_index.py (which torch build `make install` takes) with its probes faked, and the
Makefile's torch stamp: torch is reinstalled when the chosen index differs from the one recorded."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "requirements" / "torch_index.py"
CPU = "https://download.pytorch.org/whl/cpu"
CU128 = "https://download.pytorch.org/whl/cu128"


def _env(gpu: str | None = None, reachable: str = "1", **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX", "TORCH_SPEC", "MAKEFLAGS", "MFLAGS")}
    env.update(LORAPLEX_FAKE_PLATFORM="linux", LORAPLEX_FAKE_INDEX_REACHABLE=reachable)
    if gpu is not None:
        env["LORAPLEX_FAKE_GPU"] = gpu
    env.update(extra)
    return env


def select(gpu: str | None, reachable: str = "1", **extra: str) -> tuple[str, str]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT)], env=_env(gpu, reachable, **extra), capture_output=True, text=True, check=True
    )
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torch build: "), out.stderr  # one line: which, and why
    return out.stdout.strip(), lines[0]


def test_no_gpu_takes_the_cpu_index():
    index, why = select("none")
    assert index == CPU
    assert "no NVIDIA GPU" in why and CPU in why


def test_recent_driver_takes_pypis_default():
    index, why = select("13.0")
    assert index == ""
    assert "PyPI's default build" in why and "CUDA 13.0" in why


def test_older_cuda12_driver_takes_cu128():
    index, why = select("12.4")
    assert index == CU128
    assert "CUDA 12.4" in why and "cu128" in why


def test_driver_older_than_cuda12_says_so_and_takes_the_cpu_build():
    index, why = select("11.8")
    assert index == CPU
    assert "update the driver" in why and "TORCH_INDEX" in why


def test_unreachable_index_leaves_pips_configuration():
    # A sandbox whose pip reads a local mirror / --find-links: no --index-url to a host pip cannot reach.
    index, why = select("none", reachable="0")
    assert index == ""
    assert "unreachable" in why and "pip's own configured indexes" in why


def test_torch_index_overrides_the_probe():
    assert select("none", TORCH_INDEX=CU128)[0] == CU128
    index, why = select("none", TORCH_INDEX="pypi")
    assert index == "" and "TORCH_INDEX=pypi" in why


def test_not_linux_takes_pypis_default():
    index, why = select("none", LORAPLEX_FAKE_PLATFORM="darwin")
    assert index == "" and "darwin" in why


def test_unlisted_torch_version_takes_the_default_with_a_note():
    index, why = select("12.4", TORCH_SPEC="torch==2.9.0")
    assert index == "" and "not in" in why


@pytest.fixture(scope="module")
def torch_index():
    spec = importlib.util.spec_from_file_location("torch_index", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "driver, cuda",
    [
        ("580.82.07", (13, 0)),
        ("570.124.06", (12, 8)),
        ("550.90.07", (12, 4)),
        ("535.54.03", (12, 2)),
        ("470.256.02", (11, 0)),
    ],
)
def test_driver_version_without_nvidia_smi(torch_index, tmp_path, monkeypatch, driver, cuda):
    proc = tmp_path / "version"
    proc.write_text(
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver}  Release Build  (dvs-builder@U16)\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    monkeypatch.delenv("LORAPLEX_FAKE_GPU", raising=False)
    monkeypatch.setattr(torch_index.shutil, "which", lambda name: None)
    monkeypatch.setattr(torch_index, "NVIDIA_SMI_ELSEWHERE", ())
    monkeypatch.setattr(torch_index, "PROC_VERSION", str(proc))
    assert torch_index.probe_gpu()[0] == cuda
    monkeypatch.setattr(torch_index, "PROC_VERSION", str(tmp_path / "absent"))
    assert torch_index.probe_gpu()[0] is None


def test_wrong_build_only_when_known(torch_index, monkeypatch):
    import importlib.metadata as metadata

    linux = "linux"
    gpu_13 = lambda: ((13, 0), "fake")  # noqa: E731
    no_gpu = lambda: (None, "fake")  # noqa: E731
    up = lambda url: (True, "up")  # noqa: E731
    down = lambda url: (False, "down")  # noqa: E731

    def wrong(installed: str, index: str, gpu, reachable, override: str = "") -> bool:
        monkeypatch.setattr(metadata, "version", lambda name: installed)
        choice = torch_index.choose("torch==2.13.0", override, linux, gpu, reachable)
        return torch_index.wrong_build(index, choice) is not None

    assert wrong("2.13.0", CPU, no_gpu, up)  # the CUDA build where the CPU index was chosen
    assert not wrong("2.13.0+cpu", CPU, no_gpu, up)
    assert wrong("2.13.0+cpu", "", gpu_13, up)  # a CPU build on a GPU machine that takes PyPI's default
    assert not wrong("2.13.0", "", gpu_13, up)
    assert not wrong("2.13.0+cpu", "", no_gpu, down)  # pip's configuration stood in: whatever it gave stays
    assert wrong("2.13.0+cpu", CU128, no_gpu, up, override=CU128)
    assert not wrong("2.13.0", "https://mirror.example/simple", no_gpu, up, override="https://mirror.example/simple")
    assert not wrong("2.13.0", CPU, no_gpu, down)  # chosen anew differently (index went down): leave it


# --- the Makefile: `make -n install` against a virtual environment whose torch stamp records a choice ----------

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _venv(tmp_path: Path, recorded: str | None) -> Path:
    venv = tmp_path / "venv"
    venv.mkdir()
    now = time.time()
    if recorded is not None:
        (venv / ".loraplex-torch").write_text(recorded + "\n")
        os.utime(venv / ".loraplex-torch", (now - 10, now - 10))
    (venv / ".loraplex-installed").touch()
    os.utime(venv / ".loraplex-installed", (now + 3600, now + 3600))  # newer than the Makefile, pyproject, lock
    return venv


def make_n(venv: Path, gpu: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-n", "-C", str(ROOT), "install", f"VENV={venv}", *args],
        env=_env(gpu),
        capture_output=True,
        text=True,
        check=True,
    )


@needs_make
def test_make_same_choice_has_nothing_to_do(tmp_path):
    venv = _venv(tmp_path, f"torch==2.13.0 {CPU}")
    out = make_n(venv, "none")
    assert "Nothing to be done" in out.stdout and "pip install" not in out.stdout
    assert "torch build: --index-url " + CPU in out.stderr


@needs_make
def test_make_other_torch_index_reinstalls_torch(tmp_path):
    venv = _venv(tmp_path, f"torch==2.13.0 {CPU}")
    out = make_n(venv, "none", f"TORCH_INDEX={CU128}")
    assert f"pip install -q torch==2.13.0 --index-url {CU128}" in out.stdout
    assert "--wrong-build" in out.stdout and "pip uninstall -q -y torch" in out.stdout
    assert f"echo 'torch==2.13.0 {CU128}' > {venv}/.loraplex-torch" in out.stdout


@needs_make
def test_make_probe_change_reinstalls_torch(tmp_path):
    # Recorded: the CPU build; now a GPU with a recent driver: PyPI's default, no --index-url.
    venv = _venv(tmp_path, f"torch==2.13.0 {CPU}")
    out = make_n(venv, "13.0")
    installs = [line.rstrip() for line in out.stdout.splitlines() if "pip install -q torch==" in line]
    assert installs and installs[0].endswith("pip install -q torch==2.13.0")  # no --index-url
    assert f"echo 'torch==2.13.0 pypi' > {venv}/.loraplex-torch" in out.stdout


@needs_make
def test_make_venv_without_torch_stamp_runs_the_torch_step(tmp_path):
    # A virtual environment made before the stamp existed: the torch step runs (a no-op when the build fits).
    venv = _venv(tmp_path, None)
    out = make_n(venv, "none")
    assert f"pip install -q torch==2.13.0 --index-url {CPU}" in out.stdout


@needs_make
def test_make_lock_and_browser_do_not_probe(tmp_path):
    out = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "browser", f"VENV={tmp_path}"], env=_env("none"), capture_output=True, text=True
    )
    assert "torch build:" not in out.stderr
