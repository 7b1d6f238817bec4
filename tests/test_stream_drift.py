"""A stream configured otherwise than the platform needs: what counts as drift."""

from __future__ import annotations

import dataclasses

from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from inferbus.bus.stream_drift import config_drift

WANTED = StreamConfig(name="USAGE", subjects=["inferbus.usage.>"], retention=RetentionPolicy.LIMITS,
                      storage=StorageType.FILE, max_age=400 * 24 * 3600.0, duplicate_window=600.0, num_replicas=1)
# As the server reports it: every limit filled in, unlimited as -1.
ON_SERVER = dataclasses.replace(WANTED, discard=DiscardPolicy.OLD, max_msgs=-1, max_bytes=-1, max_msgs_per_subject=-1,
                                max_msg_size=-1, max_consumers=-1, sealed=False, description=None)


def test_the_servers_report_of_the_wanted_config_is_no_drift() -> None:
    assert config_drift(WANTED, ON_SERVER) == []


def test_a_new_description_or_metadata_is_no_drift() -> None:
    assert config_drift(WANTED, dataclasses.replace(ON_SERVER, description="edited by ops", metadata={"a": "b"})) == []


def test_a_limit_that_loses_messages_is_drift() -> None:
    assert config_drift(WANTED, dataclasses.replace(ON_SERVER, max_msgs=5)) == ["USAGE: max_msgs is 5, wanted -1"]
    assert config_drift(WANTED, dataclasses.replace(ON_SERVER, max_age=60.0)) == [
        "USAGE: max_age is 60.0, wanted 34560000.0"]


def test_other_subjects_retention_or_replicas_are_drift() -> None:
    drifted = dataclasses.replace(ON_SERVER, subjects=["inferbus.usage.acme"], retention=RetentionPolicy.WORK_QUEUE,
                                  num_replicas=3, sealed=True)
    assert config_drift(WANTED, drifted) == [
        "USAGE: subjects is ['inferbus.usage.acme'], wanted ['inferbus.usage.>']",
        "USAGE: retention is workqueue, wanted limits",
        "USAGE: num_replicas is 3, wanted 1",
        "USAGE: sealed is True, wanted False",
    ]


def test_subjects_in_another_order_are_the_same() -> None:
    wanted = dataclasses.replace(WANTED, subjects=["a.>", "b.>"])
    assert config_drift(wanted, dataclasses.replace(ON_SERVER, subjects=["b.>", "a.>"])) == []
