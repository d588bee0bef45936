"""Framework profiles: keys grouped by technique in TOML tables, flat keys still read, misplaced keys refused."""

from __future__ import annotations

import dataclasses
from importlib import resources

import pytest
import tomllib

from autopar.framework import FRAMEWORKS, TECHNIQUE_KEYS, Framework, FrameworkSpecError, load_framework


def test_every_key_has_one_technique_and_every_preset_groups_its_keys():
    keys = [k for ks in TECHNIQUE_KEYS.values() for k in ks]
    assert len(keys) == len(set(keys))
    assert set(keys) == {f.name for f in dataclasses.fields(Framework)} - {"name", "description", "options"}
    for name in FRAMEWORKS:
        data = tomllib.loads(resources.files("autopar").joinpath("frameworks", f"{name}.toml").read_text())
        assert set(data) <= {"base", "description", *TECHNIQUE_KEYS}, name  # nothing ungrouped


def test_a_grouped_file_and_a_flat_one_read_alike(tmp_path):
    grouped = tmp_path / "grouped.toml"
    grouped.write_text('base = "torch"\n\n[data_parallel]\ngrad_reduce_bytes = 2\n\n'
                       '[pipeline]\npp_p2p_overlap = true\n')
    flat = tmp_path / "flat.toml"
    flat.write_text('base = "torch"\ngrad_reduce_bytes = 2\npp_p2p_overlap = true\n')
    a, b = load_framework(str(grouped)), load_framework(str(flat))
    assert isinstance(a, Framework) and a.grad_reduce_bytes == 2 and a.pp_p2p_overlap
    assert {**a.to_dict(), "name": ""} == {**b.to_dict(), "name": ""}


@pytest.mark.parametrize(("text", "message"), [
    ('base = "torch"\n[pipeline]\ngrad_reduce_bytes = 2\n', "it belongs in [data_parallel]"),
    ('base = "torch"\n[pipeline]\nwarp_speed = 2\n', "[pipeline] has no key 'warp_speed'"),
    ('base = "torch"\ngrad_reduce_bytes = 4\n[data_parallel]\ngrad_reduce_bytes = 2\n', "both at the top level"),
])
def test_a_misplaced_key_is_named(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(FrameworkSpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_framework(str(path))
