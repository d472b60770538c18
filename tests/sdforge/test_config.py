"""params.yaml validation: errors name the key path and what was expected."""

import copy

import pytest
import yaml

from sdforge.config import ConfigError, load_params, parse_params


@pytest.fixture(scope="module")
def demo_dict():
    with open("params.yaml") as fh:
        return yaml.safe_load(fh)


def _broken(demo_dict, mutate):
    d = copy.deepcopy(demo_dict)
    mutate(d)
    with pytest.raises(ConfigError) as err:
        parse_params(d, origin="params.yaml")
    return str(err.value)


def test_demo_params_load_with_seven_phases():
    p = load_params("params.yaml")
    assert p.phase_names() == [f"phase{i}" for i in range(1, 8)]
    assert set(p.sources) == {"laion", "diffusiondb"}
    assert p.phases["phase1"].init_from == "scratch"
    assert p.phases["phase7"].init_from == "phase6"


def test_unknown_key_is_named(demo_dict):
    msg = _broken(demo_dict, lambda d: d["phases"]["phase3"].update(lr_max=1.0))
    assert "phases.phase3.lr_max" in msg and "Extra inputs are not permitted" in msg


def test_wrong_type_is_named(demo_dict):
    msg = _broken(demo_dict, lambda d: d["phases"]["phase2"].update(batch_size="big"))
    assert "phases.phase2.batch_size" in msg and "'big'" in msg


def test_negative_lr_rejected(demo_dict):
    msg = _broken(demo_dict, lambda d: d["phases"]["phase4"].update(lr=-1e-5))
    assert "phases.phase4.lr" in msg and "greater than 0" in msg


def test_mix_must_sum_to_one(demo_dict):
    msg = _broken(demo_dict, lambda d: d["phases"]["phase6"].update(mix={"laion": 0.6, "diffusiondb": 0.6}))
    assert "phases.phase6.mix" in msg and "sum to 1" in msg and "1.2" in msg


def test_mix_names_unknown_source(demo_dict):
    msg = _broken(demo_dict, lambda d: d["phases"]["phase3"].update(mix={"laoin": 1.0}))
    assert "phases.phase3.mix" in msg and "laoin" in msg and "diffusiondb" in msg


def test_init_from_must_be_an_earlier_phase(demo_dict):
    msg = _broken(demo_dict, lambda d: d["phases"]["phase2"].update(init_from="phase5"))
    assert "phases.phase2.init_from" in msg and "phase5" in msg


def test_missing_params_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")
