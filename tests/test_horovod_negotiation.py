"""The coordinator of ``mpi_gradreducer.horovod`` alone (no MPI): when a key is ready, what its verdict is, and
the stall inspector's warning about it."""

from __future__ import annotations

from mpi_gradreducer.horovod.negotiation import JOIN, Coordinator, Request, describe
from mpi_gradreducer.horovod.settings import Settings
from mpi_gradreducer.horovod.stall import REPLY_WINDOW, StallInspector


def _allreduce(key: str, shape: tuple[int, ...] = (3,), dtype: str = "float32", op: int = 0, epoch: int = 0,
               **more) -> Request:
    return Request(key, "allreduce", "hvd.allreduce", ((dtype, shape),), op=op, epoch=epoch, **more)


def _join(epoch: int = 0) -> Request:
    return Request(JOIN, "join", "hvd.join", epoch=epoch)


def test_a_key_is_ready_once_every_rank_asked_in_any_order():
    c = Coordinator(3)
    assert c.receive(2, [_allreduce("b"), _allreduce("a")]) == []
    assert c.receive(0, [_allreduce("a")]) == []
    out = c.receive(1, [_allreduce("a"), _allreduce("b")])
    assert [r.key for r in out] == ["a"]  # b waits for rank 0
    assert out[0].error is None and out[0].joined == () and all(q is not None for q in out[0].requests)
    assert [r.key for r in c.receive(0, [_allreduce("b")])] == ["b"]
    assert c.table == {}


def test_the_first_error_wins_and_names_its_rank():
    c = Coordinator(3, ranks=(4, 5, 6))
    bad = dict(error=("TypeError", "hvd.allreduce: tensor: expected a torch.Tensor, got list"))
    c.receive(2, [_allreduce("k", **bad)])
    c.receive(1, [_allreduce("k", error=("ValueError", "second"))])
    (out,) = c.receive(0, [_allreduce("k")])
    assert out.error == ("ValueError", "rank 5: second") and not out.internal  # the lowest failing rank, global


def test_disagreements_are_internal_errors_naming_both_ranks():
    c = Coordinator(2)
    c.receive(0, [_allreduce("k", (3,))])
    (out,) = c.receive(1, [_allreduce("k", (4,))])
    assert out.internal and out.error is not None and out.error[0] == "RuntimeError"
    assert "rank 0 called hvd.allreduce of [float32 (3,)] with op=Average but rank 1 called hvd.allreduce of " \
           "[float32 (4,)] with op=Average" in out.error[1]
    c.receive(0, [Request("g", "allgather", "hvd.allgather", (("float32", (1, 2)),))])
    (out,) = c.receive(1, [Request("g", "allgather", "hvd.allgather", (("float32", (5, 2)),))])
    assert out.error is None  # the first dimension may differ
    c.receive(0, [_allreduce("f", factors=(1.0, 2.0))])
    (out,) = c.receive(1, [_allreduce("f")])
    assert out.internal and "scaled by 1.0 before and 2.0 after" in out.error[1]


def test_join_serves_allreduce_refuses_the_rest_and_completes_with_the_last_rank():
    c = Coordinator(3)
    assert c.receive(1, [_join()]) == []
    assert c.receive(0, [_allreduce("a")]) == []  # rank 2 has not asked
    (served,) = c.receive(2, [_allreduce("a")])
    assert served.joined == (1,) and served.requests[1] is None and served.error is None
    c.receive(0, [Request("g", "allgather", "hvd.allgather", (("float32", (1,)),))])
    (refused,) = c.receive(2, [Request("g", "allgather", "hvd.allgather", (("float32", (1,)),))])
    assert refused.internal and "cannot run while ranks [1] are in hvd.join()" in refused.error[1]
    c.receive(0, [_allreduce("b")])
    out = c.receive(2, [_join()])  # rank 2 joins: b, which waited for it, is ready
    assert [r.key for r in out] == ["b"] and out[0].joined == (1, 2)
    (done,) = c.receive(0, [_join()])
    assert done.kind == "join" and done.last == 0
    # a new epoch: nobody counts as joined any more
    assert c.receive(0, [_allreduce("c", epoch=1)]) == [] and c.receive(1, [_allreduce("c", epoch=1)]) == []
    assert [r.key for r in c.receive(2, [_allreduce("c", epoch=1)])] == ["c"]


def test_a_join_completes_keys_asked_before_it():
    c = Coordinator(2)
    c.receive(0, [_allreduce("early")])
    out = c.receive(1, [_join()])
    assert [r.key for r in out] == ["early"] and out[0].joined == (1,)
    (done,) = c.receive(0, [_join()])
    assert done.last == 0


def test_describe_names_roots_and_operations():
    text = describe(Request("k", "broadcast", "hvd.broadcast", (("int64", (2, 2)),), root=3))
    assert text == "hvd.broadcast of [int64 (2, 2)] from root_rank=3"
    assert describe(Request("k", "barrier", "hvd.barrier")) == "hvd.barrier"
    assert describe(_allreduce("k", op=4)).endswith("with op=Max")


def test_the_stall_warning_waits_for_the_missing_ranks_answers_then_names_what_they_wait_in():
    c = Coordinator(3, ranks=(4, 5, 6))
    c.receive(0, [_allreduce("metric")])
    said: list[str] = []
    asked: list[tuple[list[int], int]] = []
    inspector = StallInspector(Settings(stall_check=2.0), say=said.append,
                               ask=lambda ranks, inquiry: asked.append((ranks, inquiry)), set_id=2)
    start = c.since["metric"]
    assert inspector.inspect(c, start + 1.0) is None and asked == []  # not yet stalled
    inspector.inspect(c, start + 2.5)
    assert asked == [([5, 6], 1)] and said == []  # the missing ranks (global) are asked; the warning waits
    inspector.told(5, 1, ["hvd.DistributedOptimizer's reduction in process set 2: call 1, bucket 0 (84 bytes)"])
    inspector.told(4, 1, ["not asked"])  # ignored
    inspector.told(6, 0, ["an answer to an earlier inquiry"])  # ignored
    inspector.inspect(c, start + 3.0)
    assert said == []  # rank 6 has not answered yet
    inspector.inspect(c, start + 2.5 + REPLY_WINDOW)
    assert len(said) == 1, said
    assert "some ranks of process set 2" in said[0]
    assert said[0].endswith("Missing ranks:\n5: [metric] (it waits in hvd.DistributedOptimizer's reduction in "
                            "process set 2: call 1, bucket 0 (84 bytes))\n6: [metric] (no answer to what it "
                            "waits in)"), said[0]
    inspector.inspect(c, start + 20.0)
    assert len(said) == 1 and len(asked) == 1  # once per key


def test_the_stall_warning_comes_once_every_asked_rank_answered_or_when_the_set_is_lost():
    c = Coordinator(2)
    c.receive(0, [_allreduce("a")])
    said: list[str] = []
    inspector = StallInspector(Settings(stall_check=1.0), say=said.append, ask=lambda ranks, inquiry: None)
    start = c.since["a"]
    inspector.inspect(c, start + 1.5)
    inspector.told(1, 1, [])
    inspector.inspect(c, start + 1.6)  # every rank asked has answered: at once, not at the window's end
    assert len(said) == 1 and said[0].endswith("1: [a] (it waits in no operation that Horovod knows of)"), said
    c.receive(0, [_allreduce("b")])
    inspector.inspect(c, c.since["b"] + 3.0)
    inspector.flush()  # the set is lost (or the engine stops) before the answer: said with what came
    inspector.flush()  # once
    assert len(said) == 2 and said[1].endswith("1: [b] (no answer to what it waits in)"), said
