"""Release records: digests, pins, ids, and what a worker compares before it serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferbus.releases import record
from proto import messages as m
from services.sim_engine import quality
from services.worker import release_check

COMMIT = "0123456789abcdef0123456789abcdef01234567"
IMAGE = "lmsysorg/sglang@sha256:" + "ab" * 32


@pytest.fixture
def model_dir(tmp_path: Path, llama3_model_dir: Path) -> Path:
    target = tmp_path / "model"
    target.mkdir()
    for path in llama3_model_dir.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    (target / "model.safetensors").write_bytes(b"weights" * 100)
    return target


def make(model_dir: Path, **overrides: object) -> m.Release:
    options: dict = {"repo": "meta-llama/Llama-3.3-70B-Instruct", "revision": COMMIT, "engine_image": IMAGE,
                     "engine_flags": {"quantization": "fp8", "tp_size": 2}}
    options.update(overrides)
    return record.build_release("llama", model_dir, **options)


def test_release_id_is_the_content(model_dir: Path) -> None:
    first, again = make(model_dir), make(model_dir, note="rebuilt", created=5.0)
    assert first.id == again.id and record.DIGEST.match(first.id)
    (model_dir / "model.safetensors").write_bytes(b"other weights")
    assert make(model_dir).id != first.id
    assert make(model_dir, engine_flags={"quantization": "none", "tp_size": 2}).id != make(model_dir).id


@pytest.mark.parametrize("revision", ["main", "latest", "v1.0", COMMIT[:12], COMMIT.upper()])
def test_floating_revisions_are_refused(model_dir: Path, revision: str) -> None:
    with pytest.raises(record.InvalidRelease, match="not a pinned commit"):
        make(model_dir, revision=revision)


@pytest.mark.parametrize("image", ["lmsysorg/sglang:latest", "lmsysorg/sglang:v0.5.23", "lmsysorg/sglang@sha256:abc"])
def test_engine_images_must_be_digests(model_dir: Path, image: str) -> None:
    with pytest.raises(record.InvalidRelease, match="not pinned by digest"):
        make(model_dir, engine_image=image)


def test_unknown_flags_and_adapter_tags_are_refused(model_dir: Path) -> None:
    with pytest.raises(record.InvalidRelease, match="unknown engine flags"):
        make(model_dir, engine_flags={"temperature": "0.7"})
    with pytest.raises(record.InvalidRelease, match="adapter"):
        make(model_dir, adapters=[m.ReleaseAdapter(name="support", digest="latest")])


def test_verify_names_every_difference(model_dir: Path) -> None:
    release = make(model_dir)
    assert record.verify_files(release.files, model_dir) == []
    (model_dir / "model.safetensors").write_bytes(b"tampered")
    (model_dir / "extra.safetensors").write_bytes(b"x")
    (model_dir / "generation_config.json").unlink()
    problems = record.verify_files(release.files, model_dir)
    assert any(p.startswith("model.safetensors has sha256") for p in problems)
    assert "generation_config.json is missing" in problems
    assert "extra.safetensors is not part of the release" in problems


def test_worker_compares_files_template_and_engine_flags(model_dir: Path) -> None:
    release = make(model_dir)
    info = {"quantization": "fp8", "tp_size": 2, "tokenizer_path": str(model_dir)}
    assert release_check.problems_of(release, "llama", str(model_dir), info) == []
    assert release_check.problems_of(release, "other", str(model_dir), info)[0].startswith("the release is of model")
    wrong = release_check.problems_of(release, "llama", str(model_dir), {**info, "quantization": "none"})
    assert wrong == ["the engine runs quantization=none, the release pins fp8"]
    assert "does not report tp_size" in release_check.problems_of(
        release, "llama", str(model_dir), {"quantization": "fp8", "tokenizer_path": str(model_dir)})[0]
    config = model_dir / "tokenizer_config.json"
    config.write_text(config.read_text().replace("assistant", "helper"))
    problems = release_check.problems_of(release, "llama", str(model_dir), info)
    assert "the chat template differs from the release's" in problems
    assert release_check.problems_of(release, "llama", "", info)[-1].startswith("INFERBUS_MODEL_DIR is not set")


def test_adapter_files_must_hash_to_their_version(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"lora")
    digest = record.directory_digest(adapter)
    spec = m.AdapterSpec(name="support", base_model="llama", version=digest, path=str(adapter), created=0)
    assert release_check.adapter_problem(spec) is None
    (adapter / "adapter_model.safetensors").write_bytes(b"other lora")
    assert "the registered version is " + digest in (release_check.adapter_problem(spec) or "")


def test_a_worker_runs_a_pinned_request_only_on_its_release() -> None:
    def request(release: str | None, pinned: bool) -> m.InferenceRequest:
        return m.InferenceRequest(request_id="r", tenant="t", model="llama", prompt="P", reply_to="x", created=0,
                                  deadline=1e12, sampling=m.SamplingParams(max_new_tokens=1), release=release,
                                  release_pinned=pinned)

    assert release_check.pin_refusal(request("a", True), "a") is None
    assert release_check.pin_refusal(request("b", True), "a") == "pinned to release b, this worker serves a"
    assert release_check.pin_refusal(request("b", True), "") == "pinned to release b, this worker serves no release"
    # A canary's split (not pinned) may be served by any release, as when the router is slow.
    assert release_check.pin_refusal(request("b", False), "a") is None
    assert release_check.pin_refusal(request(None, False), "a") is None


def test_sim_quality_answers_arithmetic_at_its_accuracy(tmp_path: Path) -> None:
    assert quality.answer("What is 17 + 25?", 1.0, "s") == "42"
    assert quality.answer("Compute 6 * 7 =", 1.0, 1) == "42"
    assert quality.answer("Tell me a story", 1.0, 1) is None
    right = sum(quality.answer("What is 100 - 58?", 0.7, seed) == "42" for seed in range(2000))
    assert 1300 < right < 1500
    quality.write_accuracy(tmp_path, 0.5)
    assert quality.accuracy_of(str(tmp_path), None) == 0.5
    assert quality.accuracy_of(str(tmp_path), 0.9) == 0.9
    assert quality.accuracy_of(None, None) == quality.DEFAULT_ACCURACY
    # An adapter's directory may set its own accuracy; without one, its requests are the model's.
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    assert quality.adapter_accuracy(str(adapter), 0.93) == 0.93
    quality.write_accuracy(adapter, 0.7)
    assert quality.adapter_accuracy(str(adapter), 0.93) == 0.7
