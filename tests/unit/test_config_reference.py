"""docs/configuration.md is the settings model, rendered, and current.

A new key, a changed default or bound, or a new validator changes the
rendering; this fails until the file is regenerated, and fails for a key
without a description or a validator without a refusal text, so the
reference cannot fall behind the code.
"""

from __future__ import annotations

import re
from pathlib import Path

from tierckpt.service import config_reference
from tierckpt.service.config import Settings, _env_overrides, load_settings

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "configuration.md"
REGENERATE = "python -m tierckpt.service.config_reference > docs/configuration.md"


def test_every_key_and_validator_is_described() -> None:
    assert config_reference.undocumented() == []


def test_docs_configuration_md_is_current() -> None:
    assert REFERENCE.read_text() == config_reference.render(), f"regenerate: {REGENERATE}"


def test_every_table_key_is_in_the_reference_with_its_environment_name() -> None:
    text = config_reference.render()
    for section, field in Settings.model_fields.items():
        model = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
        if isinstance(model, list):
            assert f"## `[[{section}]]`" in text
            continue
        assert f"## `[{section}]`" in text
        for key in type(model).model_fields:
            name = f"TIERCKPT_{section.upper()}__{key.upper()}"
            assert f"| `{key}` |" in text and f"`{name}`" in text
            # The documented name is the one the loader reads.
            assert _env_overrides({name: "1"}) == {section: {key: 1}}


def test_the_example_is_a_valid_configuration(tmp_path: Path) -> None:
    (example,) = re.findall(r"```toml\n(.*?)```", config_reference.render(), flags=re.S)
    path = tmp_path / "tierckpt.toml"
    path.write_text(example)
    settings = load_settings(path, environ={})
    assert [r.name for r in settings.regions] == ["us-east", "us-west"]
    assert settings.retention.keep_best is not None
