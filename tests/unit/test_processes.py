"""deploy/processes.py: a ready service's stdout keeps being read, so one that writes more than
a pipe holds (UCX logs its warnings there) never blocks on it; and its lines reach its log."""

from __future__ import annotations

import time

from deploy.processes import start_service


def test_a_service_writing_past_a_pipes_size_after_ready_never_blocks(tmp_path):
    log_path = tmp_path / "service.log"
    with open(log_path, "w") as log:
        proc, address = start_service("tests.fixtures.chatty_service", stderr=log)
        try:
            assert address == "127.0.0.1:1"
            assert proc.wait(timeout=30) == 0  # ~1 MiB written: blocked for good unread
        finally:
            proc.kill()
        deadline = time.monotonic() + 10
        while log_path.read_text().count("\n") < 4096 and time.monotonic() < deadline:
            time.sleep(0.05)  # the last lines may still be on their way to the log
    lines = log_path.read_text().splitlines()
    assert len(lines) == 4096 and lines[-1].startswith("warning 4095: ")
