"""params.yaml read within bounds (issue 39, case 9): an alias bomb, an oversized file or a NUL byte in a path is
an early ConfigError naming the file and the bound — not minutes of parsing, GiBs of memory or a traceback."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import yaml

from sdforge.config import ConfigError, load_params, read_yaml_bounded
from tests.fixtures.params_bombs import alias_bomb

REPO = Path(__file__).resolve().parents[2]
def test_an_alias_bomb_is_refused_before_it_is_built(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(alias_bomb())
    assert path.stat().st_size < 1000
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # the mapping + 9 keys + Σ levels, level i = 1 + 9 × level i-1 (level 0: a list of 9): 490,329,064
    with pytest.raises(ConfigError, match=r"params\.yaml: 490,329,064 values once its YAML aliases are expanded"):
        load_params(path)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert grown_mib < 50, f"refusing the bomb grew the process by {grown_mib:.0f} MiB"


def test_aliases_a_real_file_uses_still_load(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("base: &base {a: 1, b: [1, 2]}\nother: *base\nmore: {<<: *base, c: 3}\n")
    assert read_yaml_bounded(path) == {"base": {"a": 1, "b": [1, 2]}, "other": {"a": 1, "b": [1, 2]},
                                       "more": {"a": 1, "b": [1, 2], "c": 3}}  # fmt: skip


def test_an_oversized_params_file_is_refused_by_its_size(tmp_path, monkeypatch):
    path = tmp_path / "params.yaml"
    path.write_text("notes: " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match=r"params\.yaml: 1,048,584 bytes, more than a params file may hold "
                                          r"\(1,048,576; SDFORGE_MAX_PARAMS_BYTES raises it\)"):  # fmt: skip
        read_yaml_bounded(path)
    monkeypatch.setenv("SDFORGE_MAX_PARAMS_BYTES", str(2 << 20))
    assert len(read_yaml_bounded(path)["notes"]) == 1 << 20


def test_not_yaml_or_not_a_mapping_is_a_named_error(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("paths: [unclosed\n")
    with pytest.raises(ConfigError, match=r"params\.yaml: not valid YAML"):
        read_yaml_bounded(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match=r"expected a mapping of sections .*got list"):
        read_yaml_bounded(path)
    path.write_text("")
    assert read_yaml_bounded(path) == {}


def test_a_nul_byte_in_a_path_is_a_config_error_naming_the_key(tmp_path):
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["paths"]["shards"] = "data/sha\x00rds"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"paths\.shards: .*NUL byte"):
        load_params(path)
