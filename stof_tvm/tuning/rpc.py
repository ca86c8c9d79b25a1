"""The measuring side of distributed tuning: a TVM RPC tracker and one RPC server per device.

MetaSchedule's ``RPCRunner`` asks a tracker for a device registered under a key, uploads the built candidate
to that device's RPC server, times it there and releases the server. Every server holds one device (for a GPU:
start it with ``CUDA_VISIBLE_DEVICES`` naming one GPU, since the runner always measures on device 0 of the
server), so N servers under one key measure N candidates at once, provided the runner keeps N sessions open
(its ``max_workers``; :func:`count_servers` gives N). The tracker hands free servers out first in, first out,
so even one-at-a-time requests alternate over all of them.

This module starts the processes (the stock ``python -m tvm.exec.rpc_tracker``, and for servers
:mod:`stof_tvm.tuning.rpc_server`, TVM's RPC server serving CUDA with sessions forked from a fork server; the
tracker needs the ``tornado`` package, the servers do not), reads the tracker's state, and
:class:`LocalCluster` runs a whole tracker-and-servers set as child processes for tests and single-host runs.
The runner itself is built by :func:`stof_tvm.tuning.runners.make_runner`.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

__all__ = ["LocalCluster", "count_servers", "format_summary", "parse_address", "server_command",
           "servers_by_key", "tracker_command", "tracker_summary", "wait_for_servers"]

TRACKER_MODULE = "tvm.exec.rpc_tracker"
SERVER_MODULE = "stof_tvm.tuning.rpc_server"   # TVM's RPC server, CUDA-capable sessions (see that module)


def parse_address(text: str, what: str = "--rpc-tracker") -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; ``what`` names the argument in the error message."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must look like HOST:PORT (e.g. 127.0.0.1:9190), got {text!r}")
    return host, int(port)


def tracker_command(host: str = "0.0.0.0", port: int = 9190, port_end: int | None = None,
                    python: str = sys.executable) -> list[str]:
    """Command line of a tracker listening on the first free port of ``[port, port_end)``."""
    _check_port(port, "port")
    return [python, "-m", TRACKER_MODULE, "--host", host, "--port", str(port),
            "--port-end", str(port_end if port_end is not None else port + 1)]


def server_command(tracker: str, key: str, host: str = "0.0.0.0", port: int = 9090,
                   port_end: int | None = None, custom_addr: str | None = None,
                   python: str = sys.executable) -> list[str]:
    """Command line of an RPC server that registers with ``tracker`` under ``key``.

    ``custom_addr`` is the address the tracker gives to clients; without it the tracker uses the address the
    server's connection came from, which is right unless the server sits behind NAT (a container's bridge
    network seen from another host).
    """
    parse_address(tracker, "tracker")
    _check_key(key)
    _check_port(port, "port")
    command = [python, "-m", SERVER_MODULE, "--host", host, "--port", str(port),
               "--port-end", str(port_end if port_end is not None else port + 100),
               "--tracker", tracker, "--key", key]
    if custom_addr:
        command += ["--custom-addr", custom_addr]
    return command


def tracker_summary(tracker: str, timeout_s: float = 10.0) -> dict:
    """The tracker's state: ``{"queue_info": {key: {"free": n, "pending": n}}, "server_info": [...]}``.

    Raises ConnectionError when no tracker answers at ``tracker`` within ``timeout_s``.
    """
    from tvm import rpc

    host, port = parse_address(tracker, "tracker")
    try:                                          # tvm's own connect retries for a minute; probe first
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise ConnectionError(f"no RPC tracker at {tracker}: {err}") from None
    session = rpc.connect_tracker(host, port)
    try:
        return session.summary()
    finally:
        session.close()


def servers_by_key(summary: dict) -> dict[str, int]:
    """Number of servers registered under each key in a :func:`tracker_summary`."""
    counts: dict[str, int] = {}
    for info in summary.get("server_info", []):
        role, _, key = str(info.get("key", "")).partition(":")
        if role == "server" and key:
            counts[key] = counts.get(key, 0) + 1
    return counts


def count_servers(tracker: str, key: str, timeout_s: float = 10.0) -> int:
    """How many RPC servers are registered under ``key`` (busy or free): the runner's useful ``max_workers``."""
    _check_key(key)
    return servers_by_key(tracker_summary(tracker, timeout_s)).get(key, 0)


def wait_for_servers(tracker: str, key: str, count: int, timeout_s: float = 60.0) -> dict:
    """Poll the tracker until at least ``count`` servers are registered under ``key``; return the summary.

    Raises TimeoutError naming what was seen when the servers do not appear in time.
    """
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    deadline = time.monotonic() + timeout_s
    seen = "no answer"
    while True:
        try:
            summary = tracker_summary(tracker, timeout_s=min(5.0, max(0.5, deadline - time.monotonic())))
            found = servers_by_key(summary)
            if found.get(key, 0) >= count:
                return summary
            seen = f"servers by key: {found or 'none'}"
        except ConnectionError as err:
            seen = str(err)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{count} RPC server(s) with key {key!r} did not register with {tracker} "
                               f"within {timeout_s:g} s ({seen})")
        time.sleep(0.2)


def format_summary(tracker: str, summary: dict) -> str:
    """A short table of a :func:`tracker_summary`: one line per key, then one per server."""
    lines = [f"RPC tracker {tracker}"]
    queues = summary.get("queue_info", {})
    counts = servers_by_key(summary)
    if not counts and not queues:
        return lines[0] + "\n  no servers registered"
    lines.append(f"  {'key':<20} {'servers':>7} {'free':>5} {'pending':>8}")
    for key in sorted(set(counts) | set(queues)):
        queue = queues.get(key, {})
        lines.append(f"  {key:<20} {counts.get(key, 0):>7} {queue.get('free', 0):>5} {queue.get('pending', 0):>8}")
    for info in summary.get("server_info", []):
        if str(info.get("key", "")).startswith("server:"):
            addr = info.get("addr")
            where = f"{addr[0]}:{addr[1]}" if isinstance(addr, (list, tuple)) and len(addr) == 2 else str(addr)
            lines.append(f"  server {where} key {info['key'][len('server:'):]}")
    return "\n".join(lines)


class LocalCluster:
    """A tracker and RPC servers started as child processes of this one; a context manager.

    ``devices``: one entry per server; an entry that is not None is put in that server's
    ``CUDA_VISIBLE_DEVICES`` (so ``devices=[0, 1]`` gives one server per GPU, each seeing its GPU as
    device 0), None leaves the environment as it is (CPU servers for the ``llvm`` target).
    Each process writes its log under ``log_dir``; :meth:`measurements` counts the modules each server loaded,
    one per measured candidate. ``start_timeout_s`` bounds each wait of :meth:`start` (the tracker answering, the
    servers registering) and only ever ends a hang: a child that exits fails the wait at once. Its default is
    generous because each child imports TVM and torch (tvm_ffi loads torch where it is installed), three at once:
    on the loaded 2-core CI machine that took more than the 60 s this default used to be.
    """

    def __init__(self, key: str, devices: Sequence[int | str | None] = (None, None), host: str = "127.0.0.1",
                 log_dir: str | os.PathLike | None = None, python: str = sys.executable,
                 start_timeout_s: float = 300.0):
        _check_key(key)
        if not devices:
            raise ValueError("devices must name at least one server (None for a CPU server)")
        self.key = key
        self.devices = list(devices)
        self.host = host
        self.python = python
        self.start_timeout_s = float(start_timeout_s)
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir if log_dir is not None else tempfile.mkdtemp(prefix="stof-rpc-"))
        self.tracker: str | None = None
        self._procs: list[tuple[str, subprocess.Popen, Path]] = []

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def server_logs(self) -> list[Path]:
        return [log for name, _, log in self._procs if name.startswith("server")]

    def start(self) -> "LocalCluster":
        """Start the tracker, then the servers; return once every server is registered (or raise)."""
        if self._procs:
            raise RuntimeError("LocalCluster already started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            port = _free_port(self.host)
            self._spawn("tracker", tracker_command(self.host, port, python=self.python), None)
            self.tracker = f"{self.host}:{port}"
            self._wait(lambda: tracker_summary(self.tracker, timeout_s=2.0), "the tracker to answer")
            for index, device in enumerate(self.devices):
                command = server_command(self.tracker, self.key, self.host, _free_port(self.host),
                                         python=self.python)
                self._spawn(f"server{index}", command, device)
            self._wait(lambda: wait_for_servers(self.tracker, self.key, len(self.devices), timeout_s=1.0),
                       f"{len(self.devices)} servers to register")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminate every process (servers first), killing those that do not exit within 10 s."""
        for _, proc, _ in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc, _ in reversed(self._procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._procs = []

    def measurements(self) -> list[int]:
        """Modules loaded by each server so far (one per candidate it measured), in server order."""
        return [log.read_text(errors="replace").count("load_module") for log in self.server_logs]

    def _spawn(self, name: str, command: list[str], device) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(device)
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env)
        self._procs.append((name, proc, log))

    def _wait(self, probe, what: str) -> None:
        """Retry ``probe`` until it returns, failing fast (with the log's tail) when a child process died."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            for name, proc, log in self._procs:
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace").strip().splitlines()[-8:]
                    raise RuntimeError(f"RPC {name} exited with code {proc.returncode} while waiting for "
                                       f"{what}; {log}:\n" + "\n".join(tail))
            try:
                probe()
                return
            except (ConnectionError, TimeoutError) as err:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"gave up waiting for {what} after {self.start_timeout_s:g} s: {err}")
            time.sleep(0.2)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _check_key(key) -> None:
    if not isinstance(key, str) or not key or any(c.isspace() or c == ":" for c in key):
        raise ValueError(f"RPC key must be a non-empty string without spaces or ':', got {key!r}")


def _check_port(port, what: str) -> None:
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"{what} must be an int in 1..65535, got {port!r}")
