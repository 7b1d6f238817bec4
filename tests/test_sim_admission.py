"""The simulated scheduler's admission choices, pure: KV room a waiting request needs, and the
running request retracted first."""

from services.sim_engine.admission import CLIP_MAX_NEW_TOKENS_ESTIMATE, NEW_TOKEN_RATIO, choose_victim, prompt_room
from services.sim_engine.request import Request


def request(rid: str, prompt: int, max_new: int, *, computed: int = 0, output: int = 0,
            priority: int = 0, order: int = 0) -> Request:
    r = Request(rid=rid, input_ids=list(range(prompt)), priority=priority)
    r.fill_ids = list(r.input_ids)
    r.computed = computed
    r.output_ids = list(range(output))
    r.max_new_tokens = max_new
    r.order = order
    return r


def test_room_is_the_uncached_prompt_plus_its_first_token_plus_a_share_of_remaining_output() -> None:
    waiting = request("w", prompt=100, max_new=50)
    assert prompt_room(waiting, cached=40, running=[]) == 100 - 40 + 1 + int(NEW_TOKEN_RATIO * 50)


def test_room_counts_prompts_still_prefilling_and_caps_each_output_estimate() -> None:
    waiting = request("w", prompt=10, max_new=10)
    prefilling = request("p", prompt=300, max_new=0, computed=100)  # 200 tokens of prompt left
    long_decode = request("d", prompt=5, max_new=100_000, computed=5, output=1)
    share = int(NEW_TOKEN_RATIO * (0 + CLIP_MAX_NEW_TOKENS_ESTIMATE + 10))
    assert prompt_room(waiting, cached=0, running=[prefilling, long_decode]) == 10 + 1 + 200 + share


def test_victim_is_the_lowest_priority_then_the_newest() -> None:
    old_low = request("a", 4, 4, priority=0, order=1)
    new_low = request("b", 4, 4, priority=0, order=2)
    high = request("c", 4, 4, priority=5, order=3)
    assert choose_victim([old_low, high, new_low]) is new_low
    assert choose_victim([old_low, high]) is old_low
