"""The persistent cubin cache (stof_tvm.compiler.cubin_cache) behind the wgmma builds' nvcc step: a second build of
the same source is a hit, any change of source, flags or toolkit is a miss, a broken entry is rebuilt, the size
bound drops the least recently used entries, and processes sharing the cache at once all get whole cubins.

A fake nvcc (a Python script writing an ELF-looking file and counting its runs) keeps these fast and independent of
CUDA; one test runs the real nvcc on a one-line kernel where it is installed."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stof_tvm.compiler import cubin_cache
from stof_tvm.compiler.cubins import find_nvcc, nvcc_cubin, nvcc_flags

FAKE_NVCC = """\
#!{python}
import hashlib, os, sys, time
if sys.argv[1:] == ["--version"]:
    print("fake nvcc {version}")
    sys.exit(0)
out, src = sys.argv[sys.argv.index("-o") + 1], sys.argv[-1]
with open(os.environ["FAKE_NVCC_LOG"], "a") as log:
    log.write(src + "\\n")
time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP", "0")))
body = open(src, "rb").read() + " ".join(sys.argv[1:-3]).encode()
with open(out, "wb") as f:
    f.write(b"\\x7fELF" + hashlib.sha256(body).digest() * 64)
"""


def _fake_nvcc(folder: Path, version: str = "1.0") -> str:
    path = folder / f"nvcc-{version}"
    path.write_text(FAKE_NVCC.format(python=sys.executable, version=version))
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv(cubin_cache.ENV, str(folder))
    monkeypatch.setenv("FAKE_NVCC_LOG", str(tmp_path / "runs.log"))
    return folder


def _runs(tmp_path: Path) -> int:
    log = tmp_path / "runs.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.cubin"))


KERNEL = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }\n'


def test_second_build_of_a_source_is_a_hit(cache, tmp_path):
    nvcc = _fake_nvcc(tmp_path)
    first = nvcc_cubin(KERNEL, "sm_90a", nvcc)
    second = nvcc_cubin(KERNEL, "sm_90a", nvcc)
    assert first == second and first.startswith(b"\x7fELF")
    assert _runs(tmp_path) == 1
    assert len(_entries(cache)) == 1


def test_changed_source_flags_or_toolkit_miss(cache, tmp_path):
    nvcc = _fake_nvcc(tmp_path)
    base = nvcc_cubin(KERNEL, "sm_90a", nvcc)
    changed = nvcc_cubin(KERNEL.replace("2.0f", "3.0f"), "sm_90a", nvcc)
    other_arch = nvcc_cubin(KERNEL, "sm_80", nvcc)
    other_toolkit = nvcc_cubin(KERNEL, "sm_90a", _fake_nvcc(tmp_path, "2.0"))
    assert _runs(tmp_path) == 4
    assert len({base, changed, other_arch}) == 3          # the fake's output depends on source and flags
    assert other_toolkit == base                           # same fake output, but it was rebuilt, not reused
    assert len(_entries(cache)) == 4
    nvcc_cubin(KERNEL.replace("2.0f", "3.0f"), "sm_90a", nvcc)
    assert _runs(tmp_path) == 4                            # each of them is a hit now


def test_cache_off_always_compiles(cache, tmp_path, monkeypatch):
    monkeypatch.setenv(cubin_cache.ENV, "off")
    nvcc = _fake_nvcc(tmp_path)
    nvcc_cubin(KERNEL, "sm_90a", nvcc)
    nvcc_cubin(KERNEL, "sm_90a", nvcc)
    assert _runs(tmp_path) == 2
    assert not cache.exists()


def test_broken_entry_is_rebuilt(cache, tmp_path):
    nvcc = _fake_nvcc(tmp_path)
    good = nvcc_cubin(KERNEL, "sm_90a", nvcc)
    (entry,) = _entries(cache)
    entry.write_bytes(good[:3])                            # truncated: not an ELF image
    assert nvcc_cubin(KERNEL, "sm_90a", nvcc) == good
    assert _runs(tmp_path) == 2
    assert entry.read_bytes() == good


def test_size_bound_drops_least_recently_used(cache, tmp_path):
    nvcc = _fake_nvcc(tmp_path)
    sources = [KERNEL.replace("2.0f", f"{i}.0f") for i in range(4)]
    for src in sources:
        nvcc_cubin(src, "sm_90a", nvcc)
    paths = [cache / key[:2] / f"{key}.cubin"
             for key in (cubin_cache.cache_key(src, nvcc_flags("sm_90a"), nvcc) for src in sources)]
    for age, path in zip((40, 30, 20, 10), paths):          # built in this order, long ago
        os.utime(path, (path.stat().st_mtime - age, path.stat().st_mtime - age))
    nvcc_cubin(sources[0], "sm_90a", nvcc)                   # a hit: now the most recently used
    cubin_cache.prune(str(cache), limit=2 * paths[0].stat().st_size)
    assert [p.exists() for p in paths] == [True, False, False, True]
    runs = _runs(tmp_path)
    nvcc_cubin(sources[1], "sm_90a", nvcc)                   # dropped: built again
    assert _runs(tmp_path) == runs + 1


WORKER = """\
import importlib.util, sys
spec = importlib.util.spec_from_file_location("cubin_cache", sys.argv[1])
cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cache)
sys.path.insert(0, sys.argv[2])
source, nvcc = open(sys.argv[3]).read(), sys.argv[4]
flags = ["-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3"]

def build():
    import os, subprocess, tempfile
    with tempfile.TemporaryDirectory() as tmp:
        cu, out = os.path.join(tmp, "m.cu"), os.path.join(tmp, "m.cubin")
        open(cu, "w").write(source)
        subprocess.run([nvcc, *flags, "-o", out, cu], check=True)
        return open(out, "rb").read()

sys.stdout.write(cache.cached(cache.cache_key(source, flags, nvcc), build).hex())
"""


def test_processes_sharing_the_cache(cache, tmp_path, monkeypatch):
    """Four processes build the same source at once (each nvcc run overlapping the others), then four more read
    it: all print the same whole cubin, the cache holds one entry and no temporary file."""
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0.5")
    nvcc = _fake_nvcc(tmp_path)
    (tmp_path / "k.cu").write_text(KERNEL)
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    args = [sys.executable, str(tmp_path / "worker.py"), cubin_cache.__file__, str(tmp_path),
            str(tmp_path / "k.cu"), nvcc]
    outputs = []
    for _ in range(2):
        procs = [subprocess.Popen(args, stdout=subprocess.PIPE, env=os.environ.copy()) for _ in range(4)]
        outputs += [proc.communicate(timeout=60)[0] for proc in procs]
        assert all(proc.returncode == 0 for proc in procs)
    assert len(set(outputs)) == 1 and bytes.fromhex(outputs[0].decode()).startswith(b"\x7fELF")
    assert len(_entries(cache)) == 1
    assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".cubin")]
    assert 1 <= _runs(tmp_path) <= 4                       # the second four were hits


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_real_nvcc_builds_once_then_reads_the_cache(cache, tmp_path):
    first = nvcc_cubin(KERNEL, "sm_90a", find_nvcc())
    (entry,) = _entries(cache)
    assert first.startswith(b"\x7fELF") and entry.read_bytes() == first
    entry.write_bytes(b"\x7fELF marker")                     # what a hit must return, untouched by nvcc
    assert nvcc_cubin(KERNEL, "sm_90a", find_nvcc()) == b"\x7fELF marker"
