"""A live status page: the synchronizer's Status as plain HTML that reloads itself.

``lightning-diloco synchronizer --status-port 8080`` serves it at ``http://127.0.0.1:8080/`` (and
the same data as JSON at ``/status.json``). Standard library only: one small page, rendered from
:meth:`Synchronizer.status` on every request, so it never shows anything the service did not
report. Bound to loopback by default: the page answers without the run's token, so its
connections are bounded in time and number (http_limits.py).
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer

from lightning_diloco.core.protocol import SynchronizerStatus
from lightning_diloco.synchronizer.http_limits import (
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    BoundedServer,
    limited_handler,
    serve_in_background,
)

REFRESH_S = 2

STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin-bottom: .2em; } h2 { font-size: 1.05em; margin-top: 1.4em; }
table { border-collapse: collapse; } td, th { padding: .25em .8em; text-align: right; border-bottom: 1px solid #ddd; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
.down { color: #b00; } .muted { color: #777; } .summary span { margin-right: 1.6em; }
"""


def render(status: SynchronizerStatus) -> str:
    """The page for one shard's status."""
    e = html.escape
    h = status.sync_every or 1
    summary = [
        f"run step {status.run_step}", f"outer steps {status.outer_steps}",
        f"islands live {len(status.live_islands)} of {len(status.islands)}", f"quorum K = {status.min_quorum}",
        f"H = {h}, P = {status.num_fragments}",
        f"bytes in {_mb(status.bytes_in)}, out {_mb(status.bytes_out)}",
    ]
    rows = []
    for i, isl in sorted(status.islands.items()):
        rate = f"{1.0 / isl.step_time_s:.2f}" if isl.step_time_s > 0 else "-"
        merged = "never" if isl.merged_s_ago is None else f"{isl.merged_s_ago:.1f} s ago"
        rows.append(_row([
            str(i), "left" if isl.left else "live" if isl.live else '<span class="down">down</span>', str(isl.world_size),
            str(isl.steps), f"{isl.schedule_step % h} / {h}", rate, str(isl.accepted), merged,
            f"{isl.seen_s_ago:.1f} s ago",
        ]))
    fragments = []
    for p, r in sorted(status.rounds.items()):
        closed = max(1, r.closed)
        fragments.append(_row([
            str(p), str(status.versions.get(p, "-")), str(r.round) if r.round >= 0 else "-",
            f"{r.open_contributors}" + (f" ({r.waiting_late} late)" if r.waiting_late else ""),
            str(r.closed), f"{r.merged_entries / closed:.2f}", str(r.merged_late),
            f"{r.grace_wait_total_s / closed:.3f} / {r.grace_wait_max_s:.3f}",
            e(r.last.reason) if r.last else "-",
        ]))
    refused = ", ".join(f"{e(k)} {v}" for k, v in sorted(status.refused.items())) or "none"
    accepted = ", ".join(f"{e(k)} {v}" for k, v in sorted(status.accepted.items())) or "none"
    notes = [f"refused: {refused}", f"accepted: {accepted}"]
    if status.checkpoint_failures:
        notes.append(f'<span class="down">checkpoint writes failed: {status.checkpoint_failures} '
                     f'({e(status.last_checkpoint_error)})</span>')
    notes += [e(a) for a in status.adjustments]
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>lightning_diloco synchronizer: step {status.run_step}</title><style>{STYLE}</style></head>
<body>
<h1>Decoupled DiLoCo synchronizer <span class="muted">shard {status.shard} of {status.num_shards},
incarnation {e(status.incarnation)}</span></h1>
<p class="summary">{''.join(f'<span>{s}</span>' for s in summary)}</p>
<h2>Islands</h2>
<table id="islands"><tr><th>island</th><th>state</th><th>processes</th><th>steps</th><th>phase in H</th>
<th>steps/s</th><th>merged</th><th>last merged</th><th>last heard</th></tr>
{''.join(rows) or '<tr><td colspan="9" class="muted">no island has joined yet</td></tr>'}</table>
<h2>Fragments and rounds</h2>
<table id="rounds"><tr><th>fragment</th><th>version</th><th>open round</th><th>in it</th><th>closed</th>
<th>islands per round</th><th>merged late</th><th>grace wait s (mean / max)</th><th>last closed by</th></tr>
{''.join(fragments)}</table>
<h2>Contributions</h2>
<ul>{''.join(f'<li>{n}</li>' for n in notes)}</ul>
<p class="muted">Reloads every {REFRESH_S} s. The same data: <a href="status.json">status.json</a>.</p>
</body></html>
"""


def _row(cells: list[str]) -> str:
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


class StatusPageServer(BoundedServer, HTTPServer):
    pass


def serve_status_page(status: Callable[[], SynchronizerStatus], port: int, host: str = "127.0.0.1", *,
                      idle_timeout: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> StatusPageServer:
    """Serve the page on a daemon thread; ``server.shutdown(); server.server_close()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            path = self.path.split("?", 1)[0]
            if path not in ("/", "/status.json"):
                self.send_error(404, "the status page is at / and its data at /status.json")
                return
            current = status()
            body = (json.dumps(current.to_dict()) if path == "/status.json" else render(current)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json" if path == "/status.json" else "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # a reload every 2 s would flood the synchronizer's log
            pass

    server = StatusPageServer((host, port), limited_handler(Handler, idle_timeout), max_connections=max_connections)
    serve_in_background(server, "diloco-status-page")
    return server
