"""The live status page: what a browser gets from a synchronizer that has merged some rounds."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from html.parser import HTMLParser

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from lightning_diloco.synchronizer.status_page import render, serve_status_page
from tests.helpers import SPECS, FakeClock, contribution, initial_fragments, layout, run_config, with_peer_votes


class Tables(HTMLParser):
    """The text of every table cell, by table id and row."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table = self._row = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._table = self.tables.setdefault(dict(attrs).get("id", ""), [])
        elif tag == "tr" and self._table is not None:
            self._row = []
            self._table.append(self._row)
        elif tag == "td" and self._row is not None:
            self._row.append("")

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = self._row = None

    def handle_data(self, data):
        if self._row:
            self._row[-1] += data


def _synchronizer_with_history():
    """Islands 0 and 1 joined; island 0's contributions merged into two rounds of fragment 0."""
    config = run_config()
    clock = FakeClock()
    sync = Synchronizer(config, SynchronizerSettings(clock=clock))
    for i in range(2):
        sync.join(i, 1, SPECS)
    for p, value in initial_fragments(config).items():
        sync.seed(0, p, get_codec("fp32").encode(value))
    with_peer_votes(sync, range(2))  # island 0 alone in its rounds: a run past its first ones
    numel = layout(config).fragment_numel(0)
    for r in range(2):
        sync.push(contribution(config, 0, 0, torch.full((numel,), 0.01), round=r, base_version=r, seq=r))
        sync.poll()
    return sync


@pytest.fixture
def page():
    sync = _synchronizer_with_history()
    server = serve_status_page(sync.status, 0)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield sync, url
    server.shutdown()
    server.server_close()


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers.get_content_type(), response.read().decode()


def test_the_page_shows_each_island_and_each_fragments_version(page):
    sync, url = page
    kind, body = _get(url + "/")
    assert kind == "text/html" and 'http-equiv="refresh"' in body
    tables = Tables()
    tables.feed(body)
    islands = [row for row in tables.tables["islands"] if row]
    assert [row[0] for row in islands] == ["0", "1"]
    assert [row[6] for row in islands] == ["2", "0"]  # merged contributions: island 1 never sent
    assert islands[1][7] == "never"
    rounds = {row[0]: row for row in tables.tables["rounds"] if row}
    assert {p: int(row[1]) for p, row in rounds.items()} == {str(p): v for p, v in sync.versions().items()}
    assert rounds["0"][1] == "2" and rounds["0"][4] == "2"  # version 2 after two closed rounds


def test_the_same_data_is_served_as_json_and_other_paths_are_404(page):
    sync, url = page
    kind, body = _get(url + "/status.json")
    assert kind == "application/json"
    assert json.loads(body)["outer_steps"] == sync.status().outer_steps == 2
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(url + "/admin")
    assert err.value.code == 404


def test_text_from_the_run_is_escaped():
    status = dataclasses.replace(_synchronizer_with_history().status(), adjustments=["<script>alert(1)</script>"],
                                 refused={"<b>bad</b>": 1})
    body = render(status)
    assert "<script>" not in body and "<b>bad" not in body and "&lt;script&gt;" in body


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless browser: apt-get install chromium")
def test_a_headless_browser_renders_the_islands_and_the_versions(page, tmp_path):
    sync, url = page
    browser = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}", "--dump-dom", url + "/"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    try:
        dom, _ = browser.communicate(timeout=90)
    finally:
        if browser.poll() is None:
            os.killpg(browser.pid, signal.SIGKILL)  # the browser's helpers too
            browser.communicate()
    assert browser.returncode == 0
    tables = Tables()
    tables.feed(dom)
    assert [row[:2] for row in tables.tables["islands"] if row] == [["0", "live"], ["1", "live"]]
    versions = {row[0]: int(row[1]) for row in tables.tables["rounds"] if row}
    assert versions == {str(p): v for p, v in sync.versions().items()} == {"0": 2, "1": 0}
