"""A persistent, content-addressed cache of the cubins nvcc builds, shared by every compile on this machine.

A recompile with the same tuning records emits the same CUDA source as the compile before it, and nvcc on that
source (one translation unit of a base model's ~30 kernels: 5-10 s, on one core) would only rebuild the same
cubin. :func:`.cubins.nvcc_cubin` looks here first.

- Where: ``$STOF_TVM_CUBIN_CACHE`` if set (``off``, ``0`` or an empty value: no cache), else
  ``$XDG_CACHE_HOME/stof-tvm/cubins`` (``~/.cache/stof-tvm/cubins``).
- Key: SHA-256 of everything the cubin depends on: the source, the nvcc command line and ``nvcc --version``
  (another CUDA toolkit never reuses a cubin). An entry is ``<key[:2]>/<key>.cubin``.
- Safe across processes: an entry is written to a temporary file in its folder and renamed into place
  (``os.replace`` is atomic), so readers see a whole cubin or none; two processes building the same source both
  write the same bytes. A file that is not an ELF image (a disk-full truncation) reads as a miss and is rebuilt.
- Bounded: after each write, the oldest entries (by last use; a hit refreshes its time) are removed while the
  cache holds more than ``$STOF_TVM_CUBIN_CACHE_MB`` megabytes (default 2048).
"""
from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import tempfile

ENV = "STOF_TVM_CUBIN_CACHE"
LIMIT_ENV = "STOF_TVM_CUBIN_CACHE_MB"
DEFAULT_LIMIT_MB = 2048
_OFF = ("", "0", "off", "none")
_ELF = b"\x7fELF"


def cache_dir() -> str | None:
    """The cache folder, or None when the cache is off."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF else os.path.expanduser(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "stof-tvm", "cubins")


@functools.lru_cache(maxsize=None)
def compiler_identity(nvcc: str) -> str:
    """``nvcc --version`` of this toolkit (part of every key)."""
    proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    return f"{os.path.realpath(nvcc)}\n{proc.stdout}"


def cache_key(source: str, command: list[str], nvcc: str) -> str:
    """The key of the cubin ``command`` (nvcc's flags, without file names) builds from ``source``."""
    digest = hashlib.sha256()
    for part in (compiler_identity(nvcc), "\0".join(command), source):
        digest.update(part.encode())
        digest.update(b"\0\0")
    return digest.hexdigest()


def cached(key: str, build) -> bytes:
    """The cubin stored under ``key``; else ``build()``'s, stored under it for the next time."""
    binary = load(key)
    if binary is None:
        binary = build()
        store(key, binary)
    return binary


def _entry(folder: str, key: str) -> str:
    return os.path.join(folder, key[:2], f"{key}.cubin")


def load(key: str) -> bytes | None:
    """The cached cubin of ``key``, or None (no cache, no entry, or an unreadable one)."""
    folder = cache_dir()
    if folder is None:
        return None
    path = _entry(folder, key)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if not data.startswith(_ELF):
        return None
    try:
        os.utime(path)              # last use, for the size bound
    except OSError:
        pass
    return data


def store(key: str, cubin: bytes) -> None:
    """Put ``cubin`` under ``key`` (atomically); a cache that cannot be written is skipped silently."""
    folder = cache_dir()
    if folder is None:
        return
    path = _entry(folder, key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return
    prune(folder)


def _limit_bytes() -> int:
    try:
        return int(float(os.environ.get(LIMIT_ENV, DEFAULT_LIMIT_MB)) * 2**20)
    except ValueError:
        return DEFAULT_LIMIT_MB * 2**20


def prune(folder: str, limit: int | None = None) -> None:
    """Remove the least recently used entries while ``folder`` holds more than ``limit`` bytes."""
    limit = _limit_bytes() if limit is None else limit
    entries = []
    for sub in os.scandir(folder):
        if not sub.is_dir():
            continue
        for item in os.scandir(sub.path):
            if item.name.endswith(".cubin"):
                try:
                    stat = item.stat()
                except OSError:         # removed by another process meanwhile
                    continue
                entries.append((stat.st_mtime, stat.st_size, item.path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        try:
            os.unlink(path)
        except OSError:
            pass
        total -= size
