"""``lightning-diloco synchronizer`` and ``lightning-diloco status``."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import logging
import resource
import signal
import threading

import torch

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.protocol import SynchronizerStatus
from lightning_diloco.core.settings import add_setting_arguments, config_with, given_settings, load_run_config
from lightning_diloco.core.token_options import add_token_arguments, resolve_token
from lightning_diloco.synchronizer.membership import LIVENESS_TIMEOUT
from lightning_diloco.synchronizer.version_log import RECOVERY_WAIT

log = logging.getLogger(__name__)


def add_run_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config run.json`` and one flag per run setting (core/settings.py)."""
    g = parser.add_argument_group("run settings (authoritative for every island)")
    g.add_argument("--config", metavar="RUN_JSON",
                   help="run settings as JSON, e.g. {\"merge\": {\"min_quorum\": 2}}; the flags below override it")
    add_setting_arguments(g)


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    base = load_run_config(args.config) if args.config else None
    return config_with(given_settings(args), base)


def add_synchronizer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 for every interface (default %(default)s)")
    parser.add_argument("--port", type=int, default=7470, help="port; 0 picks a free one (default %(default)s)")
    parser.add_argument("--shard", type=int, default=0, help="this shard's index (default %(default)s)")
    parser.add_argument("--num-shards", type=int, default=1, help="shards in the run; shard i owns fragments p %% S == i (default %(default)s)")
    parser.add_argument("--checkpoint-dir", help="resume from and write checkpoints here")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="outer steps between checkpoints (default %(default)s)")
    parser.add_argument("--recovery-wait", type=float, default=RECOVERY_WAIT,
                        help="seconds a restarted synchronizer waits for an island to give back a version published after "
                        "its last checkpoint before serving the checkpoint's (default %(default)s)")
    parser.add_argument("--run-id", help="the run's name, written into its checkpoints: a checkpoint of another run "
                        "is refused (default: the checkpoint's, or a new one)")
    parser.add_argument("--layout-hash", help="the run's model layout (its hash, as Status and the islands' logs show it): "
                        "a first island with another model is refused instead of adopted")
    parser.add_argument("--num-islands", type=int, help="the run's island count: an island started with another "
                        "num_islands is refused (default: the count a quorum of the islands is started with)")
    parser.add_argument("--liveness-timeout", type=float, default=LIVENESS_TIMEOUT, help="seconds of silence before an island is not waited for (default %(default)s)")
    add_token_arguments(parser, "shared secret islands must present")
    parser.add_argument("--tls-cert", help="PEM certificate file: serve TLS")
    parser.add_argument("--tls-key", help="PEM private key file for --tls-cert")
    parser.add_argument("--max-workers", type=int, default=256, help="concurrent calls; a waiting push holds one (default %(default)s)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus text metrics over HTTP on this port")
    parser.add_argument("--status-port", type=int,
                        help="serve a live HTML status page (and /status.json) on this port, on 127.0.0.1")
    add_run_config_arguments(parser)


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of returning it to the kernel.

    Every round allocates and frees several fragment-sized buffers. By default glibc serves
    buffers above 32 MB with fresh mmaps and unmaps them on free, so each round pays page faults
    for every byte again: measured at about 2.5x the time of a 16M-parameter round. One arena for
    every thread: a worker thread's own arena grows in heaps of at most 64 MB, so a larger buffer
    (a 16M-parameter fp32 fragment) was still mmapped afresh on every push; measured on 16
    learners of 16M parameters, the shard's system time fell from 4.6-4.7 s to 1.8-2.5 s per 3
    rounds. Costs nothing where glibc is absent (returns False).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
        return (bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
                and bool(libc.mallopt(m_arena_max, 1)))
    except (OSError, AttributeError):
        return False


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open descriptors to its hard limit; returns both, the
    soft one as it now is. Every connection (gRPC or HTTP) and every checkpoint write takes a descriptor:
    under the usual soft limit of 1024, about 1,030 idle connections to the HTTP ports made joins
    time out and checkpoints fail (EMFILE). The hard limit is the operator's to set (ulimit -Hn)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an unlimited hard limit above the kernel's own ceiling: keep the soft one
            pass
    return soft, hard


def run_synchronizer(args: argparse.Namespace) -> int:
    from lightning_diloco.synchronizer.server import SynchronizerServer
    from lightning_diloco.synchronizer.service import Synchronizer
    from lightning_diloco.synchronizer.settings import SynchronizerSettings

    keep_freed_memory()
    # Concurrency comes from one thread per call; a torch thread team per call thread would
    # oversubscribe the cores (measured: 1M-parameter rounds ran 1.3-2x faster single-threaded).
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s synchronizer %(levelname)s %(message)s")
    soft, hard = raise_open_files_limit()
    log.info("open descriptors: up to %d (soft limit; the hard limit is %s, set by ulimit -Hn)", soft,
             "unlimited" if hard == resource.RLIM_INFINITY else hard)
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(SynchronizerSettings) if f.name != "clock"}
    service = Synchronizer(run_config_from_args(args), SynchronizerSettings(**flags))  # each setting is its flag
    server = SynchronizerServer(
        service, host=args.host, port=args.port, token=resolve_token(args), tls_cert=args.tls_cert, tls_key=args.tls_key,
        max_workers=args.max_workers,
    ).start()
    if args.metrics_port is not None:
        from lightning_diloco.synchronizer.metrics import serve_metrics

        try:
            metrics, _ = serve_metrics(service, args.metrics_port)
        except OSError as err:
            server.stop(grace=0)
            raise ValueError(f"--metrics-port {args.metrics_port}: {err.strerror or err}; choose a free port") from None
        log.info("metrics at http://127.0.0.1:%d/metrics", metrics.server_address[1])
    if args.status_port is not None:
        from lightning_diloco.synchronizer.status_page import serve_status_page

        try:
            page = serve_status_page(service.status, args.status_port)
        except OSError as err:
            server.stop(grace=0)
            raise ValueError(f"--status-port {args.status_port}: {err.strerror or err}; choose a free port") from None
        log.info("status page at http://127.0.0.1:%d/", page.server_address[1])
    # What start-up made (torch's modules, hundreds of thousands of objects) lives as long as the
    # process: out of the cyclic collector's way, whose full passes scanned it again and again
    # (gc was 5-8% of a shard's samples in perf).
    gc.freeze()
    print(f"synchronizer listening on {server.address}", flush=True)  # launchers parse this line

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down: final checkpoint")
    try:
        server.stop(grace=1.0)
    except Exception as err:  # noqa: BLE001 - said once, plainly, with where
        log.error("the final checkpoint into %s failed: %s; the last good one there is kept", args.checkpoint_dir, err)
        return 1
    return 0


def run_status(args: argparse.Namespace) -> int:
    from lightning_diloco.reasons import Reason
    from lightning_diloco.transport.client import SynchronizerClient, SynchronizerError

    with SynchronizerClient(args.address, token=resolve_token(args), max_retries=1) as client:
        try:
            shards = [client.status(i) for i in range(client.num_shards)]
        except SynchronizerError as err:
            # the server's refusal already says to pass the token: say only how this command takes it
            hint = {Reason.UNAUTHENTICATED: "; `status` takes it as --token-file FILE or $DILOCO_TOKEN",
                    Reason.UNREACHABLE: f"; is a synchronizer running at {args.address}? (its log's 'listening on' line "
                                        "names its address)" if "TLS" not in str(err) else ""}.get(err.reason, "")
            raise ValueError(f"{err}{hint}") from None
    if args.json:
        print(json.dumps([st.to_dict() for st in shards], indent=2))
        return 0
    for st in shards:
        print(format_status(st))
    return 0


def format_status(st: SynchronizerStatus) -> str:
    lines = [
        f"shard {st.shard}/{st.num_shards}  layout {st.layout_hash or '-'}  outer steps {st.outer_steps}  "
        f"quorum K={st.min_quorum}  live islands {st.live_islands}",
        f"bytes in {st.bytes_in:,}  out {st.bytes_out:,}  accepted {st.accepted}  refused {st.refused}",
        f"{'island':>6} {'live':>5} {'procs':>6} {'steps':>8} {'step s':>8} {'accepted':>9} {'seen s ago':>10}",
    ]
    for i, isl in st.islands.items():
        lines.append(f"{i:>6} {'left' if isl.left else 'yes' if isl.live else 'no':>5} {isl.world_size:>6} {isl.steps:>8} {isl.step_time_s:>8.3f} "
                     f"{isl.accepted:>9} {isl.seen_s_ago:>10.1f}")
    lines.append(f"{'frag':>6} {'version':>8} {'open':>5} {'last K':>7} {'grace s':>8}  reason")
    for p, r in st.rounds.items():
        last = r.last
        lines.append(f"{p:>6} {st.versions.get(p, -1):>8} {r.open_contributors:>5} {last.contributors if last else '-':>7} "
                     f"{last.grace_wait_s if last else 0.0:>8.3f}  {last.reason if last else ''}")
    return "\n".join(lines)
