"""A Mooncake Store node: one process contributing `--dram-bytes` of its memory, and
`--disk-bytes` of disk in `--disk-dir`, to the pool a `mooncake_master` manages
(`KV_STORE=mooncake`; deploy/mooncake.py starts the master and `KV_STORE_NODES` of these).

The disk tier is Mooncake's SSD offload (services/kvcache/mooncake_pool.py): blocks the master
evicts from this node's DRAM are written to its directory first, and served from there. The
master must run with `--enable_offload` for it (deploy/mooncake.py does, when the nodes have
disk); without, the directory stays empty.

The node serves nothing itself: Mooncake's transfer engine, inside this process, answers the
workers' reads and writes of its segment. It prints `mooncake-node ready on HOST:PORT` (its
transfer endpoint) once its segment is mounted (and creates `--ready-file`, which Kubernetes'
probes look for: the node has no port of its own), runs until SIGTERM, then unmounts it.

Mooncake 0.3.13.post1, as measured on this machine: the master forgets a node
`--client_ttl` (10 s) after its last heartbeat, and the blocks it held with it; until then a
read of one fails (TRANSFER_FAIL), never hangs past the transfer timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib

from services import lifecycle
from services.kvcache.mooncake_pool import SCHEME, connect

NAME = "mooncake-node"
log = logging.getLogger(__name__)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--master", required=True, help="the mooncake_master's HOST:PORT")
    parser.add_argument(
        "--metadata", required=True, help="the master's HTTP metadata server, http://HOST:PORT"
    )
    parser.add_argument("--dram-bytes", type=int, default=256 << 20, help="this node's segment")
    parser.add_argument("--disk-bytes", type=int, default=0, help="this node's disk tier (0: none)")
    parser.add_argument(
        "--disk-dir", default="", help="the disk tier's directory (created; this node's own)"
    )
    parser.add_argument(
        "--ready-file", default="", help="created once the segment is mounted, removed on stop"
    )
    args = parser.parse_args()
    if args.dram_bytes <= 0:
        raise ValueError(f"--dram-bytes must be positive, not {args.dram_bytes}")
    if args.disk_bytes < 0 or (args.disk_bytes and not args.disk_dir):
        raise ValueError("--disk-bytes must not be negative, and a disk tier needs --disk-dir")
    return args


async def serve(args: argparse.Namespace) -> None:
    stop = lifecycle.stop_signal()
    try:
        pool = f"{SCHEME}{args.master}?metadata={args.metadata}"
        store = await asyncio.to_thread(
            connect,
            pool,
            args.host,
            args.dram_bytes,
            disk_dir=args.disk_dir,
            disk_bytes=args.disk_bytes,
        )
    except Exception as exc:
        lifecycle.fail_start(NAME, exc)
    print(f"{NAME} ready on {store.get_hostname()}", flush=True)
    if args.ready_file:
        pathlib.Path(args.ready_file).touch()
    await stop.wait()
    log.info("%s stopping: unmounting its segment", NAME)
    if args.ready_file:
        pathlib.Path(args.ready_file).unlink(missing_ok=True)
    store.close()


def main() -> None:
    lifecycle.run(NAME, parse_args, serve)


if __name__ == "__main__":
    main()
