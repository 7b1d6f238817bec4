"""The worker's pull plan: free slots go where work waits, and idle long-polls never pin them."""

from services.worker.pull_plan import ConsumerState, PullOrder, plan_pulls
from services.worker.puller import pending_after

BIG = 1_000  # room of an interactive consumer (the budget's capacity)


def idle(room: int = BIG) -> ConsumerState:
    return ConsumerState(outstanding=0, waiting=0, room=room)


def test_the_reported_stall_a_standard_queue_with_work_gets_the_free_slots() -> None:
    # 16 slots, 10 running, 6 free; premium queues idle, 6 requests known waiting on standard's
    # shared queue. Before: each premium consumer long-polled a fair share (3 + 3 = all 6) and
    # the standard queue waited for them.
    consumers = [idle(), idle(), idle(), ConsumerState(0, 6, BIG), idle(room=0)]
    plan = plan_pulls(6, consumers)
    assert plan.orders == (PullOrder(3, 6, long=False),)


def test_known_work_is_served_most_important_first() -> None:
    consumers = [ConsumerState(0, 2, BIG), idle(), idle(), ConsumerState(0, 5, BIG)]
    plan = plan_pulls(4, consumers)
    assert plan.orders == (PullOrder(0, 2, long=False), PullOrder(3, 2, long=False))


def test_idle_consumers_long_poll_one_slot_each_when_there_is_room_for_all() -> None:
    plan = plan_pulls(16, [idle(), idle(), idle(), idle(), idle(room=3)])
    assert plan.orders == tuple(PullOrder(i, 1, long=True) for i in range(5))


def test_idle_consumers_long_poll_only_after_known_work_is_served() -> None:
    consumers = [idle(), ConsumerState(0, 3, BIG), idle()]
    assert plan_pulls(5, consumers).orders == (PullOrder(1, 3, long=False), PullOrder(0, 1, long=True),
                                               PullOrder(2, 1, long=True))
    # Four free: the known work takes three, and the one left cannot watch both idle queues.
    plan = plan_pulls(4, consumers)
    assert plan.orders == (PullOrder(1, 3, long=False), PullOrder(0, 1, long=False))


def test_scarce_slots_rotate_short_turns_over_idle_consumers() -> None:
    consumers = [idle(), idle(), idle(), idle(), idle()]
    first = plan_pulls(2, consumers, turn=0)
    assert first.orders == (PullOrder(0, 1, long=False), PullOrder(1, 1, long=False)) and first.turn == 2
    second = plan_pulls(2, consumers, turn=first.turn)
    assert second.orders == (PullOrder(2, 1, long=False), PullOrder(3, 1, long=False)) and second.turn == 4
    third = plan_pulls(2, consumers, turn=second.turn)
    assert third.orders == (PullOrder(4, 1, long=False), PullOrder(0, 1, long=False)) and third.turn == 1


def test_a_consumer_with_a_pull_in_flight_or_no_room_is_left_alone() -> None:
    consumers = [ConsumerState(outstanding=2, waiting=4, room=BIG), ConsumerState(0, 3, room=1), idle(room=0)]
    assert plan_pulls(8, consumers).orders == (PullOrder(1, 1, long=False),)


def test_no_free_slot_no_pull() -> None:
    assert plan_pulls(0, [ConsumerState(0, 5, BIG), idle()]).orders == ()


def test_the_pending_count_is_read_from_both_ack_subject_forms() -> None:
    assert pending_after("$JS.ACK.REQUESTS.c1.1.42.17.1700000000000000000.6") == 6
    assert pending_after("$JS.ACK.hub.ACCHASH.REQUESTS.c1.1.42.17.1700000000000000000.9.token") == 9
    assert pending_after("_INBOX.whatever") == 0
