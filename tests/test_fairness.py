from services.gateway.fairness import FairQueue


def drain(queue: FairQueue[str], n: int, tokens: float = 100.0) -> list[str]:
    """Pop `n` items, each costing `tokens`, finishing each right away."""
    served = []
    for _ in range(n):
        popped = queue.pop()
        if popped is None:
            break
        item, tenant, band = popped
        queue.finished(tenant, band, estimated=0.0, actual=tokens)
        served.append(tenant)
    return served


def test_a_tenant_sending_ten_times_more_gets_no_more_than_an_equal_share() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(100):
        queue.push(f"heavy-{i}", "heavy", "standard", 1.0)
    for i in range(10):
        queue.push(f"light-{i}", "light", "standard", 1.0)
    served = drain(queue, 20)
    assert served.count("light") == 10 and served.count("heavy") == 10


def test_weights_split_capacity_in_proportion() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(300):
        queue.push(f"a{i}", "a", "standard", 3.0)
        queue.push(f"b{i}", "b", "standard", 1.0)
    served = drain(queue, 200)
    assert abs(served.count("a") / len(served) - 0.75) < 0.02


def test_premium_goes_first_and_idle_time_banks_no_credit() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(50):
        queue.push(f"s{i}", "busy", "standard", 1.0)
    drain(queue, 30)  # "busy" has been served 3,000 tokens
    queue.push("late-0", "late", "standard", 1.0)
    queue.push("late-1", "late", "standard", 1.0)
    queue.push("vip", "vip", "premium", 1.0)
    assert queue.pop()[0] == "vip"  # type: ignore[index]
    # "late" was idle: it starts level with "busy", not 3,000 tokens behind, so they alternate
    served = drain(queue, 4)
    assert served.count("late") == 2 and served.count("busy") == 2


def test_use_of_idle_capacity_is_neither_charged_nor_credited_when_contention_starts() -> None:
    queue: FairQueue[str] = FairQueue()
    for _ in range(10):
        queue.dispatched("direct", "standard", 1.0, 100.0)  # ten went out while there was room
    for i in range(3):
        queue.push(f"x{i}", "other", "standard", 1.0)
        queue.push(f"d{i}", "direct", "standard", 1.0)
    # "other" joins level with "direct" (no banked credit either way), so they alternate
    served = drain(queue, 4)
    assert served.count("other") == 2 and served.count("direct") == 2


def test_a_request_whose_client_left_is_taken_back() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("d", "direct", "standard", 1.0)
    assert queue.remove("d", "direct", "standard") and len(queue) == 0
    assert not queue.remove("d", "direct", "standard")
    assert queue.pop() is None


def test_waiting_counts_per_band_follow_push_pop_and_remove() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a", "t", "standard", 1.0)
    queue.push("b", "t", "standard", 1.0)
    queue.push("p", "u", "premium", 1.0)
    assert (queue.waiting("standard"), queue.waiting("premium")) == (2, 1)
    queue.pop()  # premium first
    queue.remove("b", "t", "standard")
    assert (queue.waiting("standard"), queue.waiting("premium"), len(queue)) == (1, 0, 1)
