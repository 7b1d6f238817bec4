"""A cancelled request's bill: what its client received, the rest the platform's (attempt.bill_delivered)."""

from proto import messages as m
from services.worker.attempt import bill_delivered


def test_tokens_made_after_the_client_left_are_the_platforms() -> None:
    usage = m.Usage(prompt_tokens=12, completion_tokens=45, cached_tokens=4)
    tenant, platform = bill_delivered(usage, delivered_tokens=36)
    assert tenant == m.Usage(prompt_tokens=12, completion_tokens=36, cached_tokens=4)
    assert platform == 9


def test_never_more_than_was_made_and_unknown_delivery_bills_what_was_made() -> None:
    usage = m.Usage(prompt_tokens=12, completion_tokens=30)
    assert bill_delivered(usage, delivered_tokens=40) == (usage, 0)  # the gateway counted a resumed total
    assert bill_delivered(usage, delivered_tokens=-1) == (usage, 0)  # an older gateway: no count sent
    assert bill_delivered(usage, delivered_tokens=0) == (m.Usage(prompt_tokens=12, completion_tokens=0), 30)
