#!/usr/bin/env python3
"""Which torch build `make install` takes: prints the pip index URL on stdout (empty: pip's own configured
index, i.e. PyPI's default build) and one line saying which and why on stderr. Standard library only: the
Makefile runs it with the system python3 before the virtual environment exists.

  no NVIDIA GPU (Linux)                -> the CPU index (PyPI's Linux torch is the CUDA build, several GB)
  GPU, driver runs the default's CUDA  -> PyPI's default build
  GPU, older CUDA 12 driver            -> the cu128 index (CUDA 12.8; CUDA minor-version compatibility runs it
                                          on any CUDA 12 driver, >= 525)
  GPU, driver older than CUDA 12       -> the CPU index, saying to update the driver or set TORCH_INDEX
  not Linux                            -> PyPI's default (there it is already the CPU / MPS build)
  TORCH_INDEX set                      -> that index as given (TORCH_INDEX=pypi: pip's own index)

An index chosen here (not one given in TORCH_INDEX) is used only if it answers: where it cannot be reached
(an offline machine, or a sandbox whose pip is configured with a local mirror or --find-links), pip's own
configuration decides instead of `--index-url` pointing pip at a host it cannot reach.

`torch_index.py --wrong-build INDEX`, run with the virtual environment's python and the same TORCH_SPEC and
TORCH_INDEX, chooses again and exits 0 (saying so) when it agrees on INDEX and the torch installed there is
known to be another build than INDEX gives, so that the Makefile uninstalls it first: `pip install torch==X`
would otherwise call the CUDA build's X "already satisfied" for the CPU index. Where pip's own configuration
stands in for an unreachable index, whatever torch is installed stays.

Probes can be faked, for tests only: LORAPLEX_FAKE_GPU=none | <the CUDA version the driver supports, e.g.
12.4>, LORAPLEX_FAKE_INDEX_REACHABLE=1 | 0, LORAPLEX_FAKE_PLATFORM=linux | darwin | ...
"""

from __future__ import annotations

import os
import re
import shutil
import ssl
import subprocess
import sys
import urllib.request

INDEX_ROOT = "https://download.pytorch.org/whl"
CPU_INDEX = f"{INDEX_ROOT}/cpu"
NVIDIA_SMI_ELSEWHERE = ("/usr/lib/wsl/lib/nvidia-smi", "/usr/bin/nvidia-smi")  # where PATH may not reach
PROC_VERSION = "/proc/driver/nvidia/version"

# The CUDA version of PyPI's default Linux wheel, per torch minor version (read from the wheel's metadata:
# torch 2.13.0 requires cuda-toolkit==13.0.3), and the CUDA-12 index taken for an older driver. Update this
# with TORCH_SPEC's pin; for a torch not listed here a GPU machine gets PyPI's default, with a note.
DEFAULT_CUDA = {"2.13": (13, 0)}
CUDA12_INDEX = ("cu128", (12, 8))

# The oldest Linux driver of each CUDA version (NVIDIA's CUDA Toolkit release notes, table 3), used when only
# /proc/driver/nvidia/version names the driver (no nvidia-smi).
DRIVER_CUDA = [
    ((580, 65, 6), (13, 0)),
    ((575, 51, 3), (12, 9)),
    ((570, 26, 0), (12, 8)),
    ((560, 28, 3), (12, 6)),
    ((555, 42, 2), (12, 5)),
    ((550, 54, 14), (12, 4)),
    ((545, 23, 6), (12, 3)),
    ((535, 54, 3), (12, 2)),
    ((530, 30, 2), (12, 1)),
    ((525, 60, 13), (12, 0)),
    ((520, 61, 5), (11, 8)),
    ((450, 80, 2), (11, 0)),
]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in v)


def probe_gpu() -> tuple[tuple[int, int] | None, str]:
    """(the CUDA version the NVIDIA driver supports, or None without a usable GPU; what was seen)."""
    fake = os.environ.get("LORAPLEX_FAKE_GPU")
    if fake is not None:
        if fake.strip().lower() in ("", "none", "0"):
            return None, "LORAPLEX_FAKE_GPU=none"
        return _version(fake)[:2], f"LORAPLEX_FAKE_GPU={fake}: a driver for CUDA {fake}"
    smi = shutil.which("nvidia-smi") or next(
        (p for p in NVIDIA_SMI_ELSEWHERE if os.access(p, os.X_OK)), None
    )
    if smi:
        try:
            out = subprocess.run([smi], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"nvidia-smi did not run ({exc})"
        if out.returncode != 0:
            first = (out.stdout + out.stderr).strip().splitlines()[:1]
            return None, f"nvidia-smi failed ({first[0] if first else 'exit ' + str(out.returncode)})"
        m = re.search(r"CUDA Version\s*:\s*(\d+)\.(\d+)", out.stdout)
        if m:
            cuda = (int(m.group(1)), int(m.group(2)))
            return cuda, f"nvidia-smi: driver supports CUDA {_fmt(cuda)}"
    try:
        with open(PROC_VERSION) as f:
            text = f.read()
    except OSError:
        return None, "no nvidia-smi, no /proc/driver/nvidia/version" if not smi else "nvidia-smi names no CUDA"
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", text)
    m = m or re.search(r"\b(\d{3}\.\d+(?:\.\d+)?)\b", text)
    if not m:
        return None, "/proc/driver/nvidia/version names no driver version"
    driver = _version(m.group(1))
    cuda = next((c for d, c in DRIVER_CUDA if driver >= d), (10, 0))
    return cuda, f"NVIDIA driver {m.group(1)} ({PROC_VERSION}): CUDA {_fmt(cuda)}"


def index_reachable(url: str) -> tuple[bool, str]:
    fake = os.environ.get("LORAPLEX_FAKE_INDEX_REACHABLE")
    if fake is not None:
        return fake.strip() not in ("", "0", "no", "false"), "LORAPLEX_FAKE_INDEX_REACHABLE=" + fake
    cafile = os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE")
    try:
        ctx = ssl.create_default_context(cafile=cafile if cafile and os.path.isfile(cafile) else None)
        req = urllib.request.Request(url.rstrip("/") + "/torch/", method="HEAD")
        with urllib.request.urlopen(req, timeout=4, context=ctx):
            return True, "reachable"
    except Exception as exc:  # any failure (DNS, refused, TLS, HTTP error) means: do not point pip at it
        return False, str(getattr(exc, "reason", exc))


def torch_minor(spec: str) -> str | None:
    m = re.search(r"==\s*(\d+)\.(\d+)", spec)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def url_label(index: str) -> str | None:
    """The local version label ('cpu', 'cu128', ...) of the torch an index URL serves; None: unknown."""
    last = index.rstrip("/").rsplit("/", 1)[-1]
    return last if re.fullmatch(r"cpu|cu\d+|rocm[\d.]+|xpu", last) else None


def choose(spec: str, override: str, platform: str, gpu, reachable) -> tuple[str, str | None, str]:
    """(index URL, '' for pip's own; the local version label of the build it gives ('' for PyPI's default,
    None where unknown); the reason). gpu and reachable are the probes, called only where needed."""
    override = override.strip()
    pypi_label = "" if platform.startswith("linux") else None
    if override:
        if override.lower() in ("pypi", "default"):
            return "", pypi_label, f"TORCH_INDEX={override}: pip's own index (PyPI's default build)"
        return override, url_label(override), f"TORCH_INDEX={override} given"
    if not platform.startswith("linux"):
        return "", None, f"{platform}: PyPI's default torch is the CPU build here"
    cuda, seen = gpu()
    minor = torch_minor(spec)
    if cuda is None:
        index, why = CPU_INDEX, f"no NVIDIA GPU ({seen}): the CPU build, not PyPI's CUDA build"
    elif minor not in DEFAULT_CUDA:
        return "", "", (
            f"NVIDIA GPU ({seen}): PyPI's default build (its CUDA for {spec} is not in"
            " requirements/torch_index.py's table; set TORCH_INDEX=.../cuXXX if the driver is older)"
        )
    elif cuda >= DEFAULT_CUDA[minor]:
        return "", "", f"NVIDIA GPU ({seen}): PyPI's default build (CUDA {_fmt(DEFAULT_CUDA[minor])})"
    elif cuda >= (12, 0):
        name, v = CUDA12_INDEX
        index = f"{INDEX_ROOT}/{name}"
        why = (
            f"NVIDIA GPU ({seen}), older than PyPI's default build's CUDA {_fmt(DEFAULT_CUDA[minor])}: the {name}"
            f" build (CUDA {_fmt(v)}; runs on CUDA 12 drivers by minor-version compatibility, fully on >= 570)"
        )
    else:
        index = CPU_INDEX
        why = (
            f"NVIDIA GPU ({seen}), but torch {minor} has no build for a driver older than CUDA 12:"
            " the CPU build; update the driver (>= 525, best >= 580) or set TORCH_INDEX"
        )
    ok, detail = reachable(index)
    if not ok:
        return "", None, (
            f"{why} -- but {index} is unreachable ({detail}): pip's own configured indexes decide instead"
            " (on plain PyPI that is the CUDA build; TORCH_INDEX=... forces one)"
        )
    return index, url_label(index), why


def wrong_build(index: str, choice: tuple[str, str | None, str]) -> str | None:
    """Why the installed torch must go before INDEX's is installed (the choice made anew agreeing on INDEX);
    None: it may stay, or there is none, or which build INDEX gives is not known (pip's own configuration
    standing in for an unreachable index, an index URL without a label)."""
    from importlib import metadata

    chosen, want, _ = choice
    if chosen != index or want is None:
        return None
    try:
        installed = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    if installed.partition("+")[2] == want:
        return None
    return f"installed torch {installed} is not the {want or 'default'} build of {index or 'PyPI'}: reinstalling it"


def main(argv: list[str]) -> int:
    platform = os.environ.get("LORAPLEX_FAKE_PLATFORM", sys.platform)
    spec = os.environ.get("TORCH_SPEC") or "torch==2.13.0"
    choice = choose(spec, os.environ.get("TORCH_INDEX", ""), platform, probe_gpu, index_reachable)
    if argv[:1] == ["--wrong-build"]:
        why = wrong_build(argv[1] if len(argv) > 1 else "", choice)
        if why:
            print(f"torch: {why}", file=sys.stderr)
        return 0 if why else 1
    index, _, why = choice
    print(index)
    print(f"torch build: {'--index-url ' + index if index else 'pip default index'} -- {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
