"""`ddpfab run --debugpy` on real lab hosts, attached from a DAP client as VS Code attaches.

The client is a short script speaking the Debug Adapter Protocol (Content-Length framed JSON):
initialize, attach, configurationDone; the rank, which waited for it, runs into `breakpoint()`
and stops there; the client lists the threads, reads the rank's RANK in the stopped frame,
continues; the job ends 0. Meanwhile the hang watch (`--hang-timeout 4`) calls nothing hung.
"""

from __future__ import annotations

import json
import signal
import re
import socket
import sys
import time

import pytest

from ddpfab import lab as labmod

from .helpers import start_ddpfab, wait_no_processes

pytestmark = pytest.mark.usefixtures("no_leftovers")

JOB = r'''
import os
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank = int(os.environ["RANK"])
print("rank %d up" % rank, flush=True)
if rank == 3:
    here = "inside rank %d" % rank
    breakpoint()
t = torch.tensor([float(rank)])
dist.all_reduce(t)
print("rank %d sum %s" % (rank, t.item()), flush=True)
dist.destroy_process_group()
'''


class Dap:
    """A DAP client: requests out, responses and events in, as VS Code's debug adapter client."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.seq, self.buf, self.seen = 0, b"", []

    def request(self, command: str, **arguments) -> int:
        self.seq += 1
        body = json.dumps({"seq": self.seq, "type": "request", "command": command, "arguments": arguments}).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self.seq

    def _message(self) -> dict:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return json.loads(body)

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError(f"the adapter closed the connection; seen: {self.seen[-5:]}")
        self.buf += data

    def wait(self, kind: str, name: str, seq: int | None = None, timeout: float = 90) -> dict:
        """The next response to *seq* (``kind="response"``, *name* its command) or event *name*."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._message()
            self.seen.append(msg)
            if msg.get("type") != kind:
                continue
            if kind == "event" and msg.get("event") == name:
                return msg
            if kind == "response" and msg.get("command") == name and (seq is None or msg.get("request_seq") == seq):
                assert msg.get("success"), msg
                return msg
        raise TimeoutError(f"no {kind} {name} in {timeout} s; seen: {self.seen[-5:]}")


def waiting_ports(proc, lines: list[str], count: int) -> dict[int, int]:
    """rank -> the local port ddpfab printed for it, read from the run's output (kept in *lines*)
    until *count* ranks wait for a debugger."""
    ports: dict[int, int] = {}
    while len(ports) < count:
        line = proc.stdout.readline()
        assert line, "".join(lines)
        lines.append(line)
        m = re.search(r"debugpy: rank (\d+) on node\d waits for a debugger: attach to 127\.0\.0\.1:(\d+)", line)
        if m:
            ports[int(m.group(1))] = int(m.group(2))
    return ports


def test_a_dap_client_attaches_to_rank_3_through_the_printed_port_and_the_job_ends_0(lab, tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    inv = tmp_path / "inventory.yml"
    inv.write_text(labmod.render_inventory(lab, sys.executable, names=["node1", "node2"]))
    proc = start_ddpfab("run", "-i", str(inv), "--nproc-per-node", "2", "--debugpy", "3", "--hang-timeout", "4",
                        "job.py", cwd=tmp_path)
    lines: list[str] = []
    try:
        port = waiting_ports(proc, lines, 1)[3]
        # the launch.json entry, printed and kept in the run's dir, maps the node's workdir to here
        entry = json.loads(lines[-1].split("its launch.json entry: ", 1)[1])
        assert entry["connect"] == {"host": "127.0.0.1", "port": port} and entry["request"] == "attach"
        assert entry["name"].endswith("rank 3 (node2)"), entry  # node2 runs ranks 2 and 3
        assert entry["pathMappings"][0]["localRoot"] == str(tmp_path)
        [record] = tmp_path.glob("runs/*/launch.json")
        assert json.loads(record.read_text())["configurations"] == [entry]

        dap = Dap(port)
        dap.wait("response", "initialize", dap.request("initialize", clientID="ddpfab-test", adapterID="debugpy",
                                                          pathFormat="path", linesStartAt1=True, columnsStartAt1=True))
        attach = dap.request("attach", justMyCode=False)
        dap.wait("event", "initialized")
        dap.wait("response", "configurationDone", dap.request("configurationDone"))
        dap.wait("response", "attach", attach)
        time.sleep(6)  # longer than --hang-timeout while rank 3 sits at its breakpoint
        stopped = dap.wait("event", "stopped")
        threads = dap.wait("response", "threads", dap.request("threads"))["body"]["threads"]
        assert any(t["id"] == stopped["body"]["threadId"] for t in threads), threads
        frames = dap.wait("response", "stackTrace", dap.request("stackTrace", threadId=stopped["body"]["threadId"]))
        top = frames["body"]["stackFrames"][0]
        assert top["source"]["path"].endswith("job.py"), top
        rank = dap.wait("response", "evaluate", dap.request("evaluate", expression="here", frameId=top["id"],
                                                                context="repl"))
        assert rank["body"]["result"] == "'inside rank 3'", rank
        dap.wait("response", "continue", dap.request("continue", threadId=stopped["body"]["threadId"]))
        out, _ = proc.communicate(timeout=120)
        lines.append(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    assert proc.returncode == 0, text
    for rank in range(4):
        assert f"rank {rank} sum 6.0" in text, text
    assert "hang" not in text.lower().replace("--hang-timeout", ""), text
    wait_no_processes(lab, timeout=10, names=("node1", "node2"))


def test_ctrl_c_while_ranks_wait_for_a_client_ends_everything_with_the_forwards(lab, tmp_path):
    """Every rank waits for a client (`--debugpy` alone: all), one client is attached and gone
    quiet, then Ctrl-C: the job and the ranks' debug adapters are gone from every node, and the
    forwarded port is closed here."""
    (tmp_path / "job.py").write_text(JOB)
    inv = tmp_path / "inventory.yml"
    inv.write_text(labmod.render_inventory(lab, sys.executable, names=["node1", "node2"]))
    proc = start_ddpfab("run", "-i", str(inv), "--nproc-per-node", "2", "--debugpy", "job.py", cwd=tmp_path)
    lines: list[str] = []
    try:
        ports = waiting_ports(proc, lines, 4)
        dap = Dap(ports[0])
        dap.wait("response", "initialize", dap.request("initialize", clientID="ddpfab-test", adapterID="debugpy"))
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        lines.append(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, "".join(lines)
    wait_no_processes(lab, timeout=15, names=("node1", "node2"))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", ports[1]), timeout=5)
