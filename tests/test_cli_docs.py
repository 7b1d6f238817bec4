from pathlib import Path

from click.testing import CliRunner

from tools.commands.main import configuration_markdown, main

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_doc_matches_the_settings_classes() -> None:
    assert (ROOT / "docs" / "configuration.md").read_text() == configuration_markdown(), (
        "regenerate with `inferbus config-docs > docs/configuration.md`"
    )


def test_help_explains_every_command_and_option() -> None:
    runner = CliRunner()
    up = runner.invoke(main, ["up", "--help"])
    assert up.exit_code == 0
    for option in ("--workers", "--gpu", "--tp", "--model", "--time-scale"):
        assert option in up.output
    assert "H100" in up.output and "Ctrl-C" in up.output
    for service, variable in (
        ("gateway", "INFERBUS_GATEWAY_PORT"),
        ("worker", "INFERBUS_ENGINE_URL"),
        ("router", "NATS_URL"),
    ):
        result = runner.invoke(main, [service, "--help"])
        assert result.exit_code == 0 and variable in result.output
    assert runner.invoke(main, ["sim-engine", "--help"]).exit_code == 0


def test_bad_setting_values_are_refused_by_name(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from inferbus.runtime.settings import load
    from services.worker.settings import WorkerSettings

    monkeypatch.setenv("INFERBUS_METRICS_PORT", "not-a-number")
    try:
        load(WorkerSettings)
    except SystemExit as error:
        assert "INFERBUS_METRICS_PORT" in str(error)
    else:
        raise AssertionError("a bad integer setting must be refused")
