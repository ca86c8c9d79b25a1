"""Pack onnxruntime-gpu for the GPU machine in as few device calls as possible.

The GPU machine has no package registry and a call carries at most 64 MiB, but the onnxruntime-gpu 1.31.1 wheel
(CUDA 13 build, cp312) is 256 MB. Most of it is the CUDA provider's device code: its ``.nv_fatbin`` section holds
one cubin per architecture (sm_75, 80, 86, 89, 90, 120: 219 MB, already compressed), and the H200 can only run
the sm_90 ones (SASS is not portable across major versions and the library has no PTX). ``prepare`` therefore

1. unpacks the wheel (the installed tree: ``onnxruntime/`` and its ``.dist-info``, what ``pip install --target``
   writes);
2. zeroes, in place, the payload of every cubin for another architecture in every fatbin container that has an
   sm_90 one (headers, offsets and sizes unchanged, so the loader still parses every container and picks the
   sm_90 image as before; a container without one is left whole);
3. packs the tree as one xz stream (x86 filter, preset 9e), ``.whl/ort.tar.xz``, and cuts it into parts named
   ``ort-part-K-of-N`` under ``.whl/`` (git-ignored), small enough to ride along with the TVM devkit's parts.

On the GPU machine ``source scripts/ort_install.sh`` (tracked) copies whichever parts a call carried to
/tmp/ort-parts, and once all N are there joins and unpacks them into /tmp/ortsite and puts it first on
PYTHONPATH (the machine's own CPU-only onnxruntime 1.30 is then shadowed). The device calls: scripts/bench_e2e.py.

    .venv/bin/python scripts/ort_parts.py prepare        # downloads the wheel with pip first if .whl lacks it
"""
from __future__ import annotations

import argparse
import glob
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
WHEEL_GLOB = "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_*_x86_64.whl"
PIP_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
PACKED = WHEELS / "ort.tar.xz"
FATBIN_MAGIC = 0xBA55ED50
ELF_ENTRY = 2


# ------------------------------------------------------------------------------------------ fatbin pruning
def _sections(data) -> dict[str, tuple[int, int]]:
    """``{name: (file offset, size)}`` of a 64-bit little-endian ELF file's sections."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    entsize, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * entsize) for i in range(count)]
    names_at = headers[names_index][4]

    def name(offset):
        end = data.find(b"\0", names_at + offset)
        return bytes(data[names_at + offset:end]).decode()

    return {name(h[0]): (h[4], h[5]) for h in headers}


def fatbin_entries(data, start: int, end: int):
    """Yield ``(container offset, [(kind, arch, payload offset, payload size)])`` for every fatbin container
    between ``start`` and ``end`` (containers are 8-byte aligned; the gaps between them are skipped)."""
    pos = start
    while pos + 16 <= end:
        magic, _, header_size, size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        entries, entry, stop = [], pos + header_size, pos + header_size + size
        while entry < stop:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            entries.append((kind, arch, entry + entry_header, payload))
            entry += entry_header + payload
        yield pos, entries
        pos = stop


def prune_fatbins(data: bytearray, keep_arch: int) -> dict:
    """Zero, in ``data`` (an ELF shared library), the payloads of cubins for other architectures than
    ``keep_arch`` in every fatbin container that holds a ``keep_arch`` cubin. Returns the containers seen and the
    payload bytes zeroed and kept in those pruned."""
    sections = _sections(data)
    if ".nv_fatbin" not in sections:
        return {"zeroed": 0, "kept": 0, "containers": 0}
    offset, size = sections[".nv_fatbin"]
    zeroed = kept = containers = 0
    for _, entries in fatbin_entries(data, offset, offset + size):
        containers += 1
        if not any(kind == ELF_ENTRY and arch == keep_arch for kind, arch, _, _ in entries):
            continue
        for kind, arch, at, length in entries:
            if kind == ELF_ENTRY and arch != keep_arch:
                data[at:at + length] = bytes(length)
                zeroed += length
            else:
                kept += length
    return {"zeroed": zeroed, "kept": kept, "containers": containers}


# ------------------------------------------------------------------------------------------------ packing
def find_wheel(download: bool) -> Path:
    found = sorted(glob.glob(str(WHEELS / WHEEL_GLOB)))
    if found:
        return Path(found[-1])
    if not download:
        raise FileNotFoundError(f"no {WHEEL_GLOB} in {WHEELS}")
    platforms = [arg for p in PIP_PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *platforms, "-d", str(WHEELS), "onnxruntime-gpu==1.31.1"],
                   check=True)
    return find_wheel(download=False)


def prepare(args) -> None:
    """Unpack the wheel, prune its fatbins, pack the tree into ``.whl/ort.tar.xz``, then :func:`split` it."""
    wheel = find_wheel(download=not args.no_download)
    with tempfile.TemporaryDirectory(prefix="ort-parts-") as tmp:
        tree = Path(tmp) / "site"
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tree)
        for lib in sorted(tree.glob("onnxruntime/capi/*.so*")):
            data = bytearray(lib.read_bytes())
            report = prune_fatbins(data, args.arch)
            if report["zeroed"]:
                lib.write_bytes(data)
                print(f"{lib.name}: {report['containers']} fatbin containers, {report['zeroed'] / 2**20:.1f} MiB of "
                      f"other architectures' cubins zeroed, {report['kept'] / 2**20:.1f} MiB kept", flush=True)
        tar = subprocess.Popen(["tar", "-C", str(tree), "-cf", "-", "."], stdout=subprocess.PIPE)
        with open(PACKED.with_suffix(".tmp"), "wb") as out:     # xz on 2 cores: several minutes
            subprocess.run(["nice", "xz", "-T2", "--x86", "--lzma2=preset=9e", "-c"], stdin=tar.stdout, stdout=out,
                           check=True)
        if tar.wait():
            raise RuntimeError("tar failed")
    os.replace(PACKED.with_suffix(".tmp"), PACKED)
    print(f"{wheel.name} -> {PACKED.relative_to(ROOT)}: {PACKED.stat().st_size / 2**20:.1f} MiB")
    split(args)


def part_sizes(total: int, sizes_mib: list[int]) -> list[int]:
    """Byte sizes of the parts: the given sizes (MiB) in order while data remains, then the rest as one part."""
    sizes, left = [], total
    for mib in sizes_mib:
        if left <= 0:
            break
        sizes.append(min(left, mib * 2**20))
        left -= sizes[-1]
    if left > 0:
        sizes.append(left)
    return sizes


def split(args) -> None:
    """Cut ``.whl/ort.tar.xz`` into ``.whl/ort-part-K-of-N`` of the ``--sizes`` given (no recompression)."""
    blob = PACKED.read_bytes()
    for old in WHEELS.glob("ort-part-*"):
        old.unlink()
    sizes = part_sizes(len(blob), args.sizes)
    offset = 0
    for k, size in enumerate(sizes):
        name = WHEELS / f"ort-part-{k + 1}-of-{len(sizes)}"
        name.write_bytes(blob[offset:offset + size])
        offset += size
        print(f"  {name.relative_to(ROOT)}  {size / 2**20:.1f} MiB")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare", help="prune and pack the wheel into .whl/ort.tar.xz, then split it")
    p.add_argument("--arch", type=int, default=90, help="the one GPU architecture kept (default 90: the H200)")
    p.add_argument("--no-download", action="store_true", help="fail instead of downloading a missing wheel")
    s = sub.add_parser("split", help="re-cut .whl/ort.tar.xz into parts of other sizes")
    for q in (p, s):
        q.add_argument("--sizes", type=lambda t: [int(x) for x in t.split(",")], default=[24, 32],
                       help="MiB of the first parts, the rest in one last part (default 24,32: part 1 rides with "
                            "the devkit's runtime + compiler.a, part 2 with compiler.b)")
    args = parser.parse_args(argv)
    {"prepare": prepare, "split": split}[args.step](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
