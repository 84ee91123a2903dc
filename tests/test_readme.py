"""The README's configuration reference is checked against the structured configs, so it cannot drift."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from edit_train.config import CheckpointConfig, Config, RunConfig, SyncConfig, TrainConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _table_keys() -> list[str]:
    section = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    keys = []
    for line in section.splitlines():
        if line.startswith("| `"):
            keys += re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)*)`", line.split("|")[1])
    return keys


def _exists(key: str) -> bool:
    cls: object = Config
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return False
        default = fields[part].default_factory() if callable(fields[part].default_factory) else None
        cls = type(default) if dataclasses.is_dataclass(default) else None
    return True


def test_every_documented_key_exists() -> None:
    keys = _table_keys()
    assert len(keys) > 30
    for key in keys:
        assert _exists(key), f"README documents {key}, which is not in edit_train/config.py"
    assert not _exists("train.no_such_key")


def test_every_user_facing_field_is_documented() -> None:
    documented = set(_table_keys())
    for prefix, cls in (("train", TrainConfig), ("checkpoint", CheckpointConfig), ("run", RunConfig),
                        ("sync", SyncConfig)):
        for f in dataclasses.fields(cls):
            assert f"{prefix}.{f.name}" in documented, f"{prefix}.{f.name} missing from the README table"
    for top in ("resume", "faults", "seed", "logger"):
        assert top in documented


def test_quick_start_and_test_command() -> None:
    assert "pip install -e '.[dev]'" in README and "\nedit-train " in README
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    cmd = re.search(r"Tests \(the exact command CI runs.*?```bash\n(.+?)\n```", README, re.S).group(1).strip()
    assert cmd in ci.splitlines()
