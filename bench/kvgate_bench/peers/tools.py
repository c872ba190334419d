"""What ``kvgate_bench.peers`` needs, installed on first use (:func:`ensure_tools`; every step
returns what it found and how long the install took, 0 when nothing was installed; errors:
:class:`InstallError` with the reason):

* nginx and wrk: Debian's packages ``nginx`` and ``wrk`` (``apt-get install``), as root or with
  password-less sudo. The nginx package's postinst would start its service through
  invoke-rc.d, so a policy-rc.d answering 101 ("action forbidden") is in place during the
  install, as ``scripts/install-prometheus`` does and as Debian documents it
  (https://people.debian.org/~hmh/invokerc.d-policyrc.d-specification.txt); a policy-rc.d the
  machine had is put back afterwards. The benchmark starts its own nginx processes with their
  own configuration files.
* LiteLLM: from PyPI into a virtual environment of its own outside git
  (``$KVGATE_CACHE/peers/litellm-venv``, default ``~/.cache/kvgate/peers/litellm-venv``), so
  neither kvgate nor its development environment depends on it. ``KVGATE_LITELLM`` names a
  ``litellm`` executable to use instead.
* the llm-d inference simulator: ``KVGATE_LLMD_SIM``, else ``scripts/build-deps`` (a cached Go
  build).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: LiteLLM's proxy extra pulls the server (FastAPI, uvicorn, ...); pinned so reruns compare alike.
LITELLM_SPEC = os.environ.get("KVGATE_LITELLM_SPEC", "litellm[proxy]==1.108.0")
APT_PACKAGES = ("nginx", "wrk")
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
_POLICY_TEXT = "#!/bin/sh\n# kvgate_bench.peers: start no service while installing\nexit 101\n"


class InstallError(RuntimeError):
    """A tool the benchmark needs is missing and could not be installed."""


@dataclass(frozen=True, slots=True)
class Tools:
    """Paths of the peers' executables and the seconds their installation took this run."""

    nginx: str
    wrk: str
    litellm: str
    llmd_sim: str
    install_seconds: dict[str, float]


def cache_dir() -> Path:
    """``$KVGATE_CACHE/peers`` (default ``~/.cache/kvgate/peers``)."""
    root = Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate"))
    return root / "peers"


def _nginx_path() -> str | None:
    return shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None
    )


def _as_root() -> list[str]:
    if os.geteuid() == 0:
        return []
    if (
        shutil.which("sudo")
        and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0
    ):
        return ["sudo", "-n"]
    raise InstallError("installing nginx and wrk from Debian needs root (or sudo -n)")


def clean_env() -> dict[str, str]:
    """This process's environment without what would point another Python at kvgate's
    environment (``PYTHONPATH``, ``VIRTUAL_ENV``, ``PYTHONHOME``): for LiteLLM's own venv."""
    drop = {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, env=clean_env())
    if done.returncode != 0:
        raise InstallError(f"{' '.join(cmd)} exited {done.returncode}")


def install_apt(packages: tuple[str, ...] = APT_PACKAGES) -> float:
    """``apt-get install`` ``packages`` with services kept from starting; returns seconds."""
    if shutil.which("apt-get") is None:
        raise InstallError(f"no apt-get: install {' '.join(packages)} yourself and rerun")
    root = _as_root()
    saved = POLICY_RC_D.read_bytes() if POLICY_RC_D.exists() else None
    start = time.monotonic()
    print(f"installing Debian's {' '.join(packages)} (first time only)...", file=sys.stderr)
    try:
        _run([*root, "sh", "-c", f"printf '%s' '{_POLICY_TEXT}' > {POLICY_RC_D}"])
        _run([*root, "chmod", "755", str(POLICY_RC_D)])
        apt = [*root, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-q",
               "-o", "DPkg::Lock::Timeout=300"]  # fmt: skip
        known = subprocess.run(["apt-cache", "show", *packages], capture_output=True)
        if known.returncode != 0:
            _run([*apt, "update"])
        _run([*apt, "install", "-y", "--no-install-recommends", *packages])
    finally:
        if saved is None:
            subprocess.run([*root, "rm", "-f", str(POLICY_RC_D)], check=False)
        else:
            tmp = cache_dir() / "policy-rc.d.saved"
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(saved)
            subprocess.run([*root, "cp", str(tmp), str(POLICY_RC_D)], check=False)
            tmp.unlink()
    return time.monotonic() - start


def install_litellm() -> tuple[str, float]:
    """The ``litellm`` executable (``KVGATE_LITELLM`` or the cached venv, created on first use)
    and the seconds the install took."""
    given = os.environ.get("KVGATE_LITELLM")
    if given:
        if not os.access(given, os.X_OK):
            raise InstallError(f"KVGATE_LITELLM={given} is not executable")
        return given, 0.0
    venv = cache_dir() / "litellm-venv"
    exe = venv / "bin" / "litellm"
    stamp = venv / "kvgate-spec.txt"
    if exe.exists() and stamp.exists() and stamp.read_text() == LITELLM_SPEC:
        return str(exe), 0.0
    start = time.monotonic()
    print(f"installing {LITELLM_SPEC} into {venv} (first time only)...", file=sys.stderr)
    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "-q", "--disable-pip-version-check"]
    _run([*pip, "install", LITELLM_SPEC])
    if not exe.exists():
        raise InstallError(f"{LITELLM_SPEC} installed no {exe}")
    stamp.write_text(LITELLM_SPEC)
    return str(exe), time.monotonic() - start


def find_llmd_sim(repo: Path) -> tuple[str, float]:
    """The llm-d simulator: ``KVGATE_LLMD_SIM``, else what ``scripts/build-deps`` prints
    (building it on first use), with the seconds that took."""
    given = os.environ.get("KVGATE_LLMD_SIM")
    if given:
        if not os.access(given, os.X_OK):
            raise InstallError(f"KVGATE_LLMD_SIM={given} is not executable")
        return given, 0.0
    start = time.monotonic()
    done = subprocess.run(
        [str(repo / "scripts" / "build-deps")], stdout=subprocess.PIPE, stderr=sys.stderr, text=True
    )
    if done.returncode != 0:
        raise InstallError("scripts/build-deps failed: set KVGATE_LLMD_SIM to a built simulator")
    return done.stdout.strip().splitlines()[-1], time.monotonic() - start


def ensure_tools(repo: Path, *, litellm: bool = True) -> Tools:
    """Find or install everything; ``litellm=False`` skips LiteLLM (its arm is left out)."""
    seconds: dict[str, float] = {}
    if _nginx_path() is None or shutil.which("wrk") is None:
        seconds["nginx+wrk (apt)"] = install_apt()
    nginx, wrk = _nginx_path(), shutil.which("wrk")
    if nginx is None or wrk is None:
        raise InstallError("the apt install left no nginx or no wrk on PATH")
    lite = ""
    if litellm:
        lite, seconds["litellm (pip)"] = install_litellm()
    sim, seconds["llm-d-inference-sim"] = find_llmd_sim(repo)
    return Tools(nginx, wrk, lite, sim, {k: v for k, v in seconds.items() if v > 0})
