"""The worker's session (worker/session.py) driven without sockets, threads or a clock: the
handshake, the resume rules of docs/protocol.md ("Exactly once"), credits and the queue, pauses,
the transfer cap's hand-backs and the unknown-session reply, each as effects."""

from __future__ import annotations

from idlegrad.common import protocol as proto
from idlegrad.worker import session as S

HELLO = proto.Hello(worker_id="w", host="h", cores=1, threads=1, device="cpu", memory_mb=1,
                    versions={})


def welcome(instance="A", holding=(), heartbeat_s=1.0, liveness=3) -> proto.Welcome:
    return proto.Welcome(job="digits", job_args={}, fingerprint="f", seed=0,
                         heartbeat_s=heartbeat_s, liveness=liveness, instance=instance,
                         holding=list(holding))


def joined(session: S.Session, now=0.0, **kw) -> list:
    """connect -> hello -> welcome -> Join -> welcomed: the effects of the last step."""
    session.connect(now)
    msg = welcome(**kw)
    assert session.received(now, msg) == [S.Join(msg)]
    return session.welcomed(now, msg, "f")


def sent(effects, kind=None) -> list:
    return [e.message for e in effects if isinstance(e, S.Send)
            and (kind is None or isinstance(e.message, kind))]


def of(effects, kind) -> list:
    return [e for e in effects if isinstance(e, kind)]


def compute_one(session: S.Session, slot: int, now=0.0, result=None) -> list:
    """Slot `slot` given, started and finished with a result kept as `result`."""
    session.task(now, slot, f"work{slot}")
    (compute,) = of(session.start(now), S.Compute)
    assert compute == S.Compute(slot, f"work{slot}")
    return session.finished(now, slot, S.ResultReady(result or f"result{slot}"))


def test_the_handshake_says_hello_then_ready_with_the_credits_and_fingerprint():
    session = S.Session(3, HELLO)
    (hello,) = sent(session.connect(0.0))
    assert isinstance(hello, proto.Hello) and hello.instance is None
    # a welcome is an answer to a hello only; a stray one later is nothing
    effects = joined(session)
    assert sent(effects) == [proto.Ready(credits=3, fingerprint="f")]
    assert session.received(1.0, welcome()) == []
    # a reconnect names the coordinator process the session belongs to
    session.lost(1.0)
    (hello,) = sent(session.connect(1.0))
    assert hello.instance == "A"


def test_after_a_reconnect_unacknowledged_results_are_resent_exactly_once():
    session = S.Session(2, HELLO)
    joined(session)
    assert of(compute_one(session, 7), S.SendResult) == [S.SendResult(7, "result7")]
    # slot 8 computes while the connection is lost: kept, sent once on the resume, not before
    session.task(0.0, 8, "work8")
    session.start(0.0)
    assert of(session.lost(1.0), S.CancelCompute) == [S.CancelCompute(8)]
    assert session.finished(1.0, 8, S.ResultReady("result8")) == []
    session.connect(2.0)
    msg = welcome(holding=[7, 8])
    session.received(2.0, msg)
    effects = session.welcomed(2.0, msg, "f")
    assert of(effects, S.SendResult) == [S.SendResult(7, "result7"), S.SendResult(8, "result8")]
    assert isinstance(effects[-1].message, proto.Ready)  # resent before ready
    assert session.results_resent == 2
    # acknowledged: dropped, and not resent after another reconnect
    assert session.received(3.0, proto.Ack(slots=[7, 8])) == [S.DropResult(7, "result7"),
                                                               S.DropResult(8, "result8")]
    session.lost(4.0)
    assert of(joined(session, 5.0, holding=[7, 8]), S.SendResult) == []


def test_held_results_are_dropped_when_the_coordinator_no_longer_holds_their_slots():
    session = S.Session(2, HELLO)
    joined(session)
    compute_one(session, 1)
    compute_one(session, 2)
    session.task(0.0, 3, "work3")  # queued
    session.task(0.0, 4, "work4")
    session.lost(1.0)
    # the same process, which evicted slot 1 and the queued 3: only 2 and 4 are kept
    effects = joined(session, 2.0, holding=[2, 4])
    assert of(effects, S.DropResult) == [S.DropResult(1, "result1")]
    assert of(effects, S.SendResult) == [S.SendResult(2, "result2")]
    assert [slot for slot, _ in session.queue] == [4]
    # another coordinator process: everything of the old one goes, before anything is resent
    session.lost(3.0)
    effects = joined(session, 4.0, instance="B", holding=[2, 4])
    assert of(effects, S.DropResult) == [S.DropResult(2, "result2")]
    assert of(effects, S.SendResult) == [] and not session.queue and session.instance == "B"


def test_a_coordinator_that_never_acknowledges_leaves_at_most_max_unacked_results_kept():
    session = S.Session(1, HELLO, max_unacked=2)
    joined(session)
    compute_one(session, 1)
    compute_one(session, 2)
    assert of(compute_one(session, 3), S.DropResult) == [S.DropResult(1, "result1")]
    assert list(session.unacked) == [2, 3]
    # a slot computed again replaces its older result
    assert of(compute_one(session, 3, result="again"), S.DropResult) == [S.DropResult(3, "result3")]


def test_credits_and_the_queue():
    session = S.Session(1, HELLO)
    joined(session)
    for slot in range(6):
        session.task(0.0, slot, f"work{slot}")
    assert [s for s, _ in session.queue] == [0, 1, 2, 3]  # 2 x credits + 2 at most
    session.task(0.0, 2, "again")  # sent again after a resumed session: we have it
    session.task(0.0, 9, "work9", refused="parts outside the data")
    assert [w for _, w in session.queue] == ["work0", "work1", "work2", "work3"]
    assert of(session.start(0.0), S.Compute) == [S.Compute(0, "work0")]
    assert session.start(0.0) == []  # one computation at a time
    effects = session.received(0.0, proto.Cancel(slots=[0, 2]))
    assert effects == [S.CancelCompute(0)] and [s for s, _ in session.queue] == [1, 3]
    # a task's acks are acted on with it
    session.finished(0.0, 0, S.NotComputed())
    session.received(0.0, proto.Cancel(slots=[1, 3]))
    compute_one(session, 5)
    assert session.task(0.0, 6, "work6", acks=[5]) == [S.DropResult(5, "result5")]


def test_a_pause_says_paused_and_ready_zero_at_once_and_starts_nothing():
    session = S.Session(2, HELLO)
    joined(session)
    session.task(0.0, 1, "work1")
    effects = session.pause(1.0, True)
    assert sent(effects) == [proto.Heartbeat(state="paused", shards=[]),
                             proto.Ready(credits=0, fingerprint="f")]
    assert not session.wants_compute() and session.start(1.0) == []
    # the next heartbeat says paused again, and the credits unchanged are not said again
    assert sent(session.tick(2.0), proto.Ready) == []
    effects = session.pause(3.0, False)
    assert sent(effects, proto.Ready) == [proto.Ready(credits=2, fingerprint="f")]
    assert of(session.start(3.0), S.Compute) == [S.Compute(1, "work1")]


def test_a_stop_hands_the_slots_back_with_a_bye():
    session = S.Session(2, HELLO)
    joined(session)
    session.task(0.0, 1, "work1")
    session.start(0.0)
    session.task(0.0, 2, "work2")
    assert session.stop("interrupted") == [S.CancelCompute(1)]
    assert not session.queue
    assert session.tick(0.5) == [S.Send(proto.Bye(reason="interrupted")), S.Leave("interrupted")]
    assert session.finished(0.6, 1, S.ResultReady("r")) == [S.DropResult(1, "r")]


def test_a_spent_cap_hands_back_a_slot_whose_data_is_not_here_before_it_starts():
    session = S.Session(2, HELLO, capped_retry_s=60.0)
    joined(session)
    session.task(0.0, 1, "lacks")
    # not capped: nothing is asked, the slot may fetch its data
    assert session.start(0.0, lambda work: False)[0] == S.Compute(1, "lacks")
    session.finished(0.0, 1, S.ResultReady("r1"))
    session.task(0.0, 3, "lacks")
    session.task(0.0, 2, "cached")
    session.cap(10.0, 1000.0)
    effects = session.start(10.0, lambda work: work == "cached")
    assert sent(effects) == [proto.Heartbeat(state="capped", shards=[]),
                             proto.Ready(credits=0, fingerprint="f"),
                             proto.Handback(slots=[3], reason=S.HANDBACK_REASON)]
    assert effects[-1] == S.Compute(2, "cached")  # computed from the cache
    assert not any(isinstance(e, S.Compute) and e.slot == 3 for e in effects)
    # it asks again after the retry, and says it is not capped once the allowance returns
    session.heard(30.0)  # (the coordinator's heartbeats)
    assert sent(session.tick(30.0), proto.Ready) == []
    session.heard(71.0)
    assert sent(session.tick(71.0), proto.Ready) == [proto.Ready(credits=2, fingerprint="f")]
    session.heard(1001.0)
    assert sent(session.tick(1001.0), proto.Heartbeat)[0].state == "working"


def test_a_slot_that_meets_the_cap_while_fetching_is_handed_back():
    session = S.Session(2, HELLO)
    joined(session)
    session.task(0.0, 4, "work4")
    session.start(0.0)
    effects = session.finished(1.0, 4, S.Capped(until=500.0))
    assert sent(effects)[-1] == proto.Handback(slots=[4], reason=S.HANDBACK_REASON)
    assert sent(effects, proto.Ready) == [proto.Ready(credits=0, fingerprint="f")]
    assert session.capped(1.0) and not session.capped(500.0)


def test_a_slot_the_jobs_code_fails_on_is_handed_back_with_what_it_raised():
    """The coordinator is told at once (else it holds the slot until its deadline, and a job
    that fails on every slot of a worker shows it 'working' for good)."""
    session = S.Session(2, HELLO)
    joined(session)
    session.task(0.0, 5, "work5")
    session.start(0.0)
    error = "ValueError: Expected more than 1 value per channel\n\x1b[31m" + "x" * 400
    (handback,) = sent(session.finished(1.0, 5, S.NotComputed(error=error)))
    assert handback.slots == [5] and handback.error.startswith("ValueError: Expected more")
    assert handback.error.isprintable() and len(handback.error) <= proto.MAX_NAME
    proto.decode(proto.encode(handback))  # the coordinator's schema takes it
    # a cancelled slot (no error) says nothing: the coordinator cancelled it
    session.task(1.0, 6, "work6")
    session.start(1.0)
    assert sent(session.finished(2.0, 6, S.NotComputed())) == []


def test_an_unknown_session_reply_says_hello_again():
    session = S.Session(2, HELLO)
    joined(session)
    compute_one(session, 1)
    session.task(0.0, 2, "work2")
    session.start(0.0)
    # hello_first: the coordinator lost our session; we keep what we hold and hello again
    effects = session.received(1.0, proto.Reject(code="hello_first", reason="say hello"))
    assert effects == [S.CancelCompute(2), S.Rehello(forget=False)]
    assert session.received(1.0, proto.Reject(code="hello_first", reason="x")) == []
    assert sent(session.connect(1.0))[0].instance == "A"
    # (a hello_first answering the hello just said is not a second one)
    assert session.received(1.1, proto.Reject(code="hello_first", reason="x")) == []


def test_a_task_for_a_model_not_held_starts_the_session_afresh():
    session = S.Session(2, HELLO)
    joined(session)
    compute_one(session, 1)
    session.task(0.0, 2, "work2")
    effects = session.task(1.0, 3, None, model_held=False)
    assert effects == [S.DropResult(1, "result1"), S.Rehello(forget=True)]
    assert not session.queue and sent(session.connect(1.0))[0].instance is None


def test_other_rejects_leave_refused_and_a_silent_coordinator_is_given_up():
    session = S.Session(2, HELLO)
    session.connect(0.0)
    effects = session.received(0.0, proto.Reject(code="banned", reason="no"))
    assert effects == [S.Leave("the coordinator refused this worker (banned): no", refused=True)]
    session = S.Session(2, HELLO)
    joined(session, heartbeat_s=1.0, liveness=3)
    assert sent(session.tick(0.0), proto.Heartbeat)  # due at once
    assert not of(session.tick(2.5), S.Reconnect)
    session.heard(2.5)
    assert not of(session.tick(5.4), S.Reconnect)
    assert of(session.tick(5.6), S.Reconnect)


def test_heartbeats_tell_the_shards_held_when_they_change():
    held = [[3, 1]]
    session = S.Session(1, HELLO, held_shards=lambda: held[0], cache_counters=lambda: {"hits": 1})
    joined(session)
    assert sent(session.tick(0.0)) == [proto.Heartbeat(state="idle", shards=[1, 3],
                                                       cache={"hits": 1})]
    assert sent(session.tick(1.0))[0].shards is None  # unchanged: not said
    held[0] = None  # cannot tell now: nothing said
    assert sent(session.tick(2.0))[0].shards is None
    held[0] = [1]
    assert sent(session.tick(3.0))[0].shards == [1]
    session.lost(4.0)
    joined(session, 4.0)  # a new session hears anew
    assert sent(session.tick(4.0))[0].shards == [1]
