"""Priority bands: one declaration, its order, its interactive subset, its engine priority, checked
on the wire and in the settings that name bands."""

from __future__ import annotations

import msgspec
import pytest

from inferbus.runtime.settings import load
from proto import bands
from proto import messages as m
from services.worker.settings import WorkerSettings


def test_the_order_is_most_important_first_and_batch_is_not_interactive() -> None:
    assert bands.BANDS == ("premium", "standard", "batch")
    assert bands.INTERACTIVE == ("premium", "standard")
    priority = [bands.ENGINE_PRIORITY[band] for band in bands.BANDS]
    assert priority == sorted(priority, reverse=True) and len(set(priority)) == len(priority)


def test_a_request_waits_behind_its_band_and_the_more_important_ones() -> None:
    assert bands.through("premium") == ("premium",)
    assert bands.through("standard") == ("premium", "standard")
    assert bands.through("unheard-of") == ("premium", "standard")  # judged as the least important
    assert bands.through("batch", among=bands.BANDS) == bands.BANDS


def test_a_setting_that_names_no_band_is_refused() -> None:
    assert bands.parse(" premium, batch ", "X") == ("premium", "batch")
    with pytest.raises(ValueError, match="'premum' is no band"):
        bands.parse("premum,standard", "X")
    with pytest.raises(ValueError, match="named twice"):
        bands.parse("premium,premium", "X")


def test_a_worker_with_a_typo_in_its_bands_does_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERBUS_WORKER_BANDS", "premium,standrd")
    with pytest.raises(SystemExit, match="'standrd' is no band"):
        load(WorkerSettings)
    monkeypatch.setenv("INFERBUS_WORKER_BANDS", "standard,batch")
    assert load(WorkerSettings).band_list() == ["standard", "batch"]


def test_an_unknown_band_on_the_wire_does_not_decode() -> None:
    request = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="P", reply_to="x", band="batch",
                                 sampling=m.SamplingParams(max_new_tokens=1), deadline=1e12, created=0)
    wire = msgspec.json.encode(request)
    assert msgspec.json.decode(wire, type=m.InferenceRequest).band == "batch"
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(wire.replace(b'"batch"', b'"bulk"'), type=m.InferenceRequest)
