"""Verdicts operators act on, on real jobs under ``ccld run -- torchrun``: the record says
who and where (host, local rank, the launcher's job id, time, id); it reaches a function
given to ``ccld_plugin.on_verdict``, a sink an installed package declares, a webhook on a
local HTTP server and ``/metrics`` while the job is hung; and ``actions.on_hang=abort``
ends a hung job so that torchrun restarts it, with the culprit's host in the exclude
file."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import urllib.request
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

from prometheus_client.parser import text_string_to_metric_families
from sink_package import install_sink_package
from test_ccld_run import _log, ccld_run

from ccld_harness.launch import free_port
from ccld_plugin.services.actions import ABORT_EXIT_CODE


def _torchrun_c10d(run_id: str, restarts: int = 0):
    """torchrun with a c10d rendezvous (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the
    job's environment each attempt's workers get a store of their own: see
    test_a_hung_job_is_aborted_restarted_and_finishes)."""

    def launcher(world: int) -> list[str]:
        return [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"),
            *("--rdzv-id", run_id, "--max-restarts", str(restarts)),
        ]

    return launcher


HOUR = timedelta(hours=1)


class _Collector:
    """A local HTTP server (127.0.0.1) that keeps the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        got = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/hook"
        Thread(target=self.httpd.serve_forever, daemon=True).start()


def _metrics(port: int) -> dict[str, list]:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    except OSError:
        return {}
    return {
        f.name: [(s.labels, s.value) for s in f.samples]
        for f in text_string_to_metric_families(text.decode())
    }


def test_a_hang_reaches_every_hook_with_who_and_where(tmp_path):
    """Rank 2 of 4 hangs in compute at step 5 of a DDP job. While the job hangs, /metrics
    carries the verdict; the JSONL record, the on_verdict hook, the installed package's
    sink and the webhook get the same record, naming the host and local rank."""
    site = tmp_path / "site"
    install_sink_package(site)
    server = _Collector()
    port = free_port()
    scraped: dict[str, list] = {}

    def scrape_once_hung(verdicts: list[dict]) -> bool:
        if any(v["kind"] == "hang" for v in verdicts):
            scraped.update(_metrics(port))
        return bool(scraped.get("ccld_culprit"))

    env = {
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "CCLD_TEST_SINK_FILE": str(tmp_path / "plugin.jsonl"),
        "HOOK_FILE": str(tmp_path / "hook.jsonl"),
    }
    sets = (
        f"sinks.webhook.url={server.url}",
        f"sinks.prometheus.port={port}",
        "sinks.prometheus.address=127.0.0.1",
    )
    try:
        verdicts = ccld_run(
            tmp_path,
            "ddp_hooked.py",
            "hang@2:5",
            60,
            launcher=_torchrun_c10d("hooked-run"),
            sets=sets,
            env=env,
            until=scrape_once_hung,
        )
    finally:
        server.httpd.shutdown()
    (v,) = verdicts
    assert (v["kind"], v["cause"], v["ranks"], v["group"]["role"]) == ("hang", "compute", [2], "dp")
    assert v["culprits"] == [
        {"rank": 2, "host": socket.gethostname(), "local_rank": 2, "device": None}
    ]
    assert v["job"] == "hooked-run"  # torchrun's run id (TORCHELASTIC_RUN_ID)
    assert (
        abs((datetime.now().astimezone() - datetime.fromisoformat(v["time"])).total_seconds()) < 600
    )
    assert v["stuck_s"] >= 3 and v["ratio"] is None and v["resumes"] is None
    # the same record through each hook
    hooked = [json.loads(line) for line in (tmp_path / "hook.jsonl").read_text().splitlines()]
    plugin = (tmp_path / "plugin.jsonl").read_text().splitlines()
    assert hooked == [v] and json.loads(plugin[0]) == v and server.bodies[:1] == [v]
    # /metrics while the job hung
    assert ({"kind": "hang", "cause": "compute", "role": "dp"}, 1.0) in scraped["ccld_verdicts"]
    (culprit,) = scraped["ccld_culprit"]
    assert culprit == (
        {"id": v["id"], "kind": "hang", "cause": "compute", "rank": "2"}
        | {"host": socket.gethostname(), "role": "dp"},
        1.0,
    )
    ranks = {labels["rank"] for labels, _ in scraped["ccld_rank_step_seconds"]}
    assert ranks == {"0", "1", "2", "3"}, _log(tmp_path)


def test_a_hung_job_is_aborted_restarted_and_finishes(tmp_path):
    """Rank 2 hangs at step 5 on the first attempt only. With actions.on_hang=abort every
    rank leaves with the documented code abort_after_s after the verdict, torchrun
    (--max-restarts 1) starts the job again, and the second attempt runs to its end; the
    exclude file names rank 2's host, as srun --exclude reads it."""
    bad_hosts = tmp_path / "bad_hosts"
    verdicts = ccld_run(
        tmp_path,
        "ddp_plain.py",
        "hang@2:5",
        30,
        launcher=_torchrun_c10d("abort-run", restarts=1),
        sets=(
            "actions.on_hang=abort",
            "actions.abort_after_s=2",
            f"actions.exclude_file={bad_hosts}",
        ),
        # Each attempt's workers get a store of their own (their rank 0's, on a fresh port).
        # In the store torchrun's agent shares with them by default, which outlives an
        # attempt and whose keys have no attempt in them, the second attempt's gloo
        # read the first's addresses: "Gloo connectFullMesh failed ... Connection refused".
        env={"FAULT_ATTEMPT": "0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        end_on_verdict=False,
        timeout_s=240,
    )
    log = (tmp_path / "job.log").read_text(errors="replace")
    assert [(v["kind"], v["cause"], v["ranks"]) for v in verdicts] == [("hang", "compute", [2])], (
        verdicts,
        log[-3000:],
    )
    (hang,) = verdicts
    said = f"exits with code {ABORT_EXIT_CODE}: the job is aborted after hang {hang['id']}"
    left = re.findall(rf"ccld: rank (\d) {said}: .*? \(at ([0-9TZ:.-]+);", log)
    assert sorted(int(r) for r, _ in left) == [0, 1, 2, 3], log[-3000:]
    # the abort came abort_after_s after the verdict (a round or so later)
    waited = {
        (datetime.fromisoformat(t) - datetime.fromisoformat(hang["time"])).total_seconds()
        for _, t in left
    }
    assert len(waited) == 1 and 2 <= waited.pop() <= 2 + 10, left
    assert "params " in log  # the second attempt finished: rank 0's last line
    assert bad_hosts.read_text() == f"{socket.gethostname()}\n"
