"""Acknowledgements: a task sent in answer to a result carries that result's acknowledgement
(one message instead of two); a result answered by no task is acknowledged on its own.

A raw DEALER plays a worker against a real coordinator process, so what is checked is what
travels on the wire.
"""

from __future__ import annotations

import time

import pytest
import zmq

from idlegrad.common import protocol as proto

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PARAMS = 100


def numel() -> int:
    from idlegrad.common.builtin_jobs import synthetic

    return sum(p.numel() for p in synthetic(params=PARAMS).build_model().parameters())


def answer(task: proto.Task, size: int) -> list:
    return proto.encode(proto.Result(
        slot=task.slot, version=task.version, samples=sum(p[2] for p in task.parts), loss=0.5,
        compute_s=0.01, gradient=proto.Blob("float32", size, (bytes(4 * size),))))


def next_message(sock: zmq.Socket, timeout: float = 10.0):
    """The next task or ack (heartbeats skipped), or None after `timeout`."""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            break
        msg = proto.decode(sock.recv_multipart())
        if isinstance(msg, (proto.Task, proto.Ack)):
            return msg
    return None


def test_a_task_carries_the_ack_of_the_result_it_answers(cluster):
    size = numel()
    coordinator = cluster.coordinator("--job", "synthetic", "--job-arg", f"params={PARAMS}",
                                      "--job-arg", "batch_size=16", "--partitions", "2",
                                      "--epochs", "50", "--eval-every", "3600")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(cluster.address)
        sock.send_multipart(proto.encode(proto.Hello(
            worker_id="raw", host="here", cores=1, threads=1, device="cpu", memory_mb=1,
            versions={})))
        end = time.monotonic() + 60
        welcome = None
        while welcome is None and time.monotonic() < end and coordinator.running:
            if sock.poll(500, zmq.POLLIN):
                msg = proto.decode(sock.recv_multipart())
                welcome = msg if isinstance(msg, proto.Welcome) else None
        assert welcome is not None, coordinator.tail()
        sock.send_multipart(proto.encode(proto.Ready(credits=1, fingerprint=welcome.fingerprint)))
        task = next_message(sock)
        assert isinstance(task, proto.Task) and task.acks == []

        # Its one credit free again, the worker is handed the next slot, with the ack on it.
        sock.send_multipart(answer(task, size))
        reply = next_message(sock)
        assert isinstance(reply, proto.Task), reply
        assert reply.acks == [task.slot] and reply.slot != task.slot

        # A repeat of that result is taken (dropped) and answered by no task: a plain ack.
        sock.send_multipart(answer(task, size))
        reply2 = next_message(sock)
        assert isinstance(reply2, proto.Ack) and reply2.slots == [task.slot], reply2
    finally:
        sock.close(0)
        ctx.term()
    cluster.assert_no_tracebacks()
