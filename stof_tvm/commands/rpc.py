"""``stof-tvm rpc``: run a TVM RPC tracker or server for distributed tuning, or show what a tracker holds.

``tracker`` and ``server`` replace this process with TVM's own programs (``python -m tvm.exec.rpc_tracker`` /
``rpc_server``), so they behave as those do and receive signals directly (as a container's main process).
``status`` prints the tracker's servers per key; with ``--min-servers`` it also answers whether enough are
registered (exit 0 or 1), which is what a container health check or a job script needs.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

from stof_tvm.tuning.rpc import (format_summary, parse_address, server_command, servers_by_key, tracker_command,
                                 tracker_summary)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "rpc", help="run a TVM RPC tracker or server for distributed tuning, or show a tracker's servers",
        description="Distributed tuning: one RPC server per GPU registers with a tracker under a key; "
                    "'stof-tvm tune --rpc-tracker HOST:PORT --rpc-key KEY' then measures on all of them.")
    actions = parser.add_subparsers(dest="rpc_action", metavar="ACTION")
    actions.required = True

    tracker = actions.add_parser("tracker", help="run an RPC tracker (needs the tornado package)")
    tracker.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    tracker.add_argument("--port", type=int, default=9190, help="port to listen on (default 9190)")
    tracker.set_defaults(func=run_tracker)

    server = actions.add_parser("server", help="run an RPC server that registers with a tracker")
    server.add_argument("--tracker", required=True, metavar="HOST:PORT", help="the tracker to register with")
    server.add_argument("--key", required=True, help="device key clients ask for, e.g. h200")
    server.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    server.add_argument("--port", type=int, default=9090,
                        help="first port to try; the next free one up to +100 is used (default 9090)")
    server.add_argument("--gpu", metavar="ID",
                        help="serve only this GPU (sets CUDA_VISIBLE_DEVICES; the runner measures on device 0)")
    server.add_argument("--custom-addr", metavar="ADDR",
                        help="address the tracker hands to clients (when the server is behind NAT)")
    server.set_defaults(func=run_server)

    status = actions.add_parser("status", help="show the servers registered with a tracker")
    status.add_argument("--tracker", required=True, metavar="HOST:PORT", help="the tracker to ask")
    status.add_argument("--key", help="with --min-servers: the key to count")
    status.add_argument("--min-servers", type=int, default=0, metavar="N",
                        help="exit 1 unless at least N servers are registered under --key")
    status.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="with --min-servers: keep asking up to this long (default 0: ask once)")
    status.add_argument("--json", action="store_true", help="print the tracker's summary as JSON")
    status.set_defaults(func=run_status)


def run_tracker(args) -> int:
    if importlib.util.find_spec("tornado") is None:
        raise ValueError("the RPC tracker needs the tornado package: pip install 'stof-tvm[rpc]'")
    _exec(tracker_command(args.host, args.port))


def run_server(args) -> int:
    command = server_command(args.tracker, args.key, args.host, args.port, custom_addr=args.custom_addr)
    if args.gpu is not None:
        if not str(args.gpu).isdigit():
            raise ValueError(f"--gpu must be a GPU index such as 0, got {args.gpu!r}")
        os.environ["CUDA_VISIBLE_DEVICES"] = str(args.gpu)
    _exec(command)


def run_status(args) -> int:
    parse_address(args.tracker, "--tracker")
    if args.min_servers < 0 or args.wait < 0:
        raise ValueError("--min-servers and --wait must not be negative")
    if args.min_servers and not args.key:
        raise ValueError("--min-servers needs --key (the key to count)")
    deadline = time.monotonic() + args.wait
    while True:
        try:
            summary = tracker_summary(args.tracker)
        except ConnectionError as err:
            if time.monotonic() >= deadline:
                print(f"stof-tvm rpc status: {err}", file=sys.stderr)
                return 1
            time.sleep(1.0)
            continue
        enough = servers_by_key(summary).get(args.key, 0) >= args.min_servers
        if enough or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    print(json.dumps(summary, indent=2, sort_keys=True) if args.json else format_summary(args.tracker, summary))
    if not enough:
        print(f"stof-tvm rpc status: fewer than {args.min_servers} server(s) with key {args.key!r}",
              file=sys.stderr)
    return 0 if enough else 1


def _exec(command: list[str]):
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)
