"""Every alert links to its runbook page, every drill kind has one, and every page says how the
problem shows, what to check, the commands, and how to verify recovery."""

from __future__ import annotations

from pathlib import Path

import yaml

from tools.drill.run import KINDS

ROOT = Path(__file__).resolve().parent.parent
RUNBOOKS = ROOT / "docs" / "runbooks"
SECTIONS = ("**How it shows.**", "**What to check.**", "**Commands.**", "**Verify recovery.**")


def alerts() -> list[dict]:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]


def test_every_alert_links_to_its_own_runbook_page() -> None:
    found = alerts()
    assert found
    for rule in found:
        url = rule["annotations"].get("runbook_url")
        assert url == f"docs/runbooks/{rule['alert']}.md", rule["alert"]
        assert (ROOT / url).is_file(), url


def test_every_runbook_page_has_its_sections_and_the_index_lists_it() -> None:
    pages = [RUNBOOKS / f"{rule['alert']}.md" for rule in alerts()] + [RUNBOOKS / f"drill-{k}.md" for k in KINDS]
    index = (RUNBOOKS / "README.md").read_text()
    for page in pages:
        text = page.read_text()
        for section in SECTIONS:
            assert section in text, f"{page.name}: no {section}"
        assert f"({page.name})" in index, f"README.md does not list {page.name}"
    listed = {p.name for p in RUNBOOKS.glob("*.md")} - {"README.md"}
    assert listed == {p.name for p in pages}, "pages without an alert or drill, or the other way round"
