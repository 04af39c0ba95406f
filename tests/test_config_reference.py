"""docs/admin.md carries the configuration reference generated from the config model, verbatim."""

from __future__ import annotations

from pathlib import Path

from slurm_antman.config import AntmanConfig
from slurm_antman.admin.config_reference import BEGIN, END, reference_markdown

ADMIN = Path(__file__).resolve().parent.parent / "docs" / "admin.md"


def test_admin_guide_has_the_generated_reference():
    text = ADMIN.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    start = text.index(BEGIN)
    current = text[start:text.index(END) + len(END)] + "\n"
    assert current == reference_markdown(), (
        "docs/admin.md's configuration reference is out of date: replace the text between the markers with "
        "the output of `python -m slurm_antman.admin.config_reference`")


def test_reference_lists_every_field_with_its_default():
    ref = reference_markdown()
    for name, field in AntmanConfig.model_fields.items():
        assert f"| `{name}` |" in ref
    assert "| `sidecar.metrics_port` | int | `0` |" in ref
    assert "| `nodes[].gpus` | int | **required** |" in ref
    assert "| `coordinator.key_dir` | str or null | null |" in ref
