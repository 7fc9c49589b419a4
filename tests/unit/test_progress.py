"""engine/progress.py: one line a stage off a terminal, a throttled redraw on one."""

import io

import pytest

from engine import progress
from engine.progress import Stage


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    """A clock the test moves: `clock[0]` seconds."""
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    return now


def test_off_a_terminal_a_stage_is_one_line_naming_it_however_many_items(clock):
    stream = io.StringIO()
    with Stage("loading weights", total=3000, unit="layers", stream=stream) as p:
        for _ in range(3000):
            p.advance()
            clock[0] += 0.001
    assert stream.getvalue() == "loading weights: 3000 layers ... done in 3.0 s\n"


def test_a_stage_left_by_an_exception_says_how_far_it_got(clock):
    stream = io.StringIO()
    with pytest.raises(RuntimeError), Stage("reading x.gguf", 10, "tensors", stream=stream) as p:
        p.advance(4)
        p.detail = "Q3_K widened to fp32"
        raise RuntimeError
    assert stream.getvalue() == (
        "reading x.gguf: 4/10 tensors (Q3_K widened to fp32) ... failed after 0.0 s\n"
    )


def test_on_a_terminal_it_redraws_one_line_and_ends_it(clock):
    stream = Terminal()
    with Stage("warm start", total=4, unit="blocks", stream=stream) as p:
        for _ in range(4):
            clock[0] += 1.0
            p.advance()
    out = stream.getvalue()
    assert out.startswith("\rwarm start: [") and out.endswith("\n") and out.count("\n") == 1
    draws = out.split("\r")[1:]
    assert len(draws) == 1 + 4 + 1  # the start, each advance (a second apart), the end
    assert draws[2] == "warm start: [##########----------] 2/4 blocks 1.0/s ETA 0:02\x1b[K"
    assert draws[-1] == "warm start: 4 blocks ... done in 4.0 s\x1b[K\n"


def test_many_updates_are_drawn_at_most_ten_times_a_second(clock):
    stream = Terminal()
    with Stage("loading weights", total=100_000, stream=stream) as p:
        for _ in range(100_000):
            clock[0] += 1e-5  # 100,000 updates over one second
            p.advance()
    assert stream.getvalue().count("\r") <= 1 + 10 + 1


def test_a_quiet_stage_writes_nothing(clock):
    stream = Terminal()
    with Stage("loading weights", 3, stream=stream, quiet=True) as p:
        p.advance(3)
    assert stream.getvalue() == ""


def test_said_lines_go_to_stdout_above_the_bar(clock, capsys):
    stream = Terminal()
    with Stage("rounds", total=2, stream=stream) as p:
        p.advance()
        p.say("round 1: 12.3 req/s")
    assert capsys.readouterr().out == "round 1: 12.3 req/s\n"
    assert "\r\x1b[K" in stream.getvalue()  # the bar cleared before the line, then redrawn


def test_a_service_that_logs_at_info_gets_the_line_through_its_log(clock, caplog, monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr(progress.sys, "stderr", stderr)
    caplog.set_level("INFO", logger="engine.progress")  # as services/lifecycle.py sets up
    with Stage("disk tier warm start", 2, "blocks") as p:
        p.advance(2)
    assert [r.getMessage() for r in caplog.records] == [
        "disk tier warm start: 2 blocks ... done in 0.0 s"
    ]
    assert stderr.getvalue() == ""


def test_it_imports_the_standard_library_alone():
    """The KV store, which knows no engine (tests/unit/test_layering.py), imports it."""
    import ast
    import sys

    tree = ast.parse(open(progress.__file__).read())
    imported = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    imported |= {
        n.module.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.level == 0
    }
    assert imported - {"__future__"} <= sys.stdlib_module_names


def test_a_new_detail_is_drawn_at_once_on_a_terminal_and_ends_the_line_off_one(clock):
    terminal, log = Terminal(), io.StringIO()
    for stream in (terminal, log):
        with Stage("serving", total=2, unit="cells", stream=stream) as p:
            clock[0] += 1.0
            p.detail = "vllm, concurrency 8"
    assert terminal.getvalue().split("\r")[2] == (
        "serving: [--------------------] 0/2 cells (vllm, concurrency 8)\x1b[K"
    )
    assert log.getvalue() == "serving: 0/2 cells (vllm, concurrency 8) ... done in 1.0 s\n"


def test_advances_from_many_threads_are_all_counted():
    import threading

    stream = Terminal()
    with Stage("replaying kv", 8 * 5000, "requests", stream=stream) as p:
        threads = [
            threading.Thread(target=lambda: [p.advance() for _ in range(5000)]) for _ in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert p.num_done == 8 * 5000
    assert "replaying kv: 40000 requests ... done in " in stream.getvalue()


def test_a_counted_call_advances_the_stage_once_it_returns(clock):
    stream = io.StringIO()
    with Stage("long prompts", 2, "prompts", stream=stream) as p:
        ttft = p.counted(lambda n, cached=False: n / 1000)
        assert ttft(2000) == 2.0 and p.num_done == 1
        ttft(4000, cached=True)
    assert stream.getvalue() == "long prompts: 2 prompts ... done in 0.0 s\n"


def test_a_drawn_line_is_cut_to_the_terminals_width(clock, monkeypatch):
    monkeypatch.setattr(progress, "_width", lambda stream: 40)
    stream = Terminal()
    with Stage("disk tier: reloading /a/long/path/to/the/store", 10, "files", stream=stream):
        pass
    first = stream.getvalue().split("\r")[1]
    assert first == "disk tier: reloading /a/long/path/to/th\x1b[K"  # 39 columns, the cursor 40th
