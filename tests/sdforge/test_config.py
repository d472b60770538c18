"""params.yaml validation: errors name the key path and what was expected."""

import copy
import re

import pytest
import yaml

from sdforge.config import ConfigError, FetchSettings, load_params, parse_params
from sdforge.ingest.buckets import shapes_of


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


def test_demo_params_load_with_phase0_seven_phases_the_adapter_and_the_distilled_phase():
    p = load_params("params.yaml")
    assert p.phase_names() == [f"phase{i}" for i in range(0, 10)]
    assert set(p.sources) == {"laion", "diffusiondb", "concept"}
    assert p.phases["phase0"].init_from == "scratch" and p.phases["phase1"].init_from == "phase0"
    assert p.phases["phase7"].init_from == "phase6" and p.phases["phase8"].init_from == "phase7"
    assert p.phases["phase9"].init_from == "phase7" and p.phases["phase9"].distill.sampling_steps == 4
    assert [p.phases[n].adapter is not None for n in p.phases] == [False] * 8 + [True, True]
    assert [p.phases[n].distill is not None for n in p.phases] == [False] * 9 + [True]
    assert {p.phase_objective(n) for n in p.phases} == {"flow_matching"}  # train.objective (issue 40)
    assert {p.phases[n].min_snr_gamma for n in p.phases} == {None}
    assert [p.phase_resolution(n) for n in p.phases] == ["px24"] + ["px32"] * 9
    assert {k: shapes_of(v) for k, v in p.bucket_sets().items()} == {
        "px24": [(20, 28), (24, 24), (28, 20), (32, 16)],
        "px32": [(24, 40), (32, 32), (40, 24)],
    }


def test_without_buckets_one_square_set_of_the_encode_resolution(demo_dict):
    d = copy.deepcopy(demo_dict)
    d.pop("buckets")
    d["encode"].pop("resolutions")
    d["encode"]["resolution"] = 32
    for phase in d["phases"].values():
        phase.pop("resolution")
    p = parse_params(d)
    assert p.encoded_resolutions() == ["square"] and p.phase_resolution("phase3") == "square"
    assert shapes_of(p.bucket_sets()["square"]) == [(32, 32)]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["phases"]["phase2"].pop("resolution"), "phases.phase2.resolution: required when several"),
        (lambda d: d["phases"]["phase2"].update(resolution="px99"), "'px99' is not encoded"),
        (lambda d: d["encode"].update(resolutions=["px24", "px48"]), r"encode.resolutions: \['px48'\] not defined"),
        (
            lambda d: d["buckets"].update(px24={"sizes": [[24, 30]], "step": 8}),
            r"sizes \[\(24, 30\)\] are not multiples",
        ),
        (lambda d: d["buckets"].update(px24={"max_area": 40, "step": 8}), "max_area 40 holds no 8×8 bucket"),
        (lambda d: d["buckets"].update(px24={"max_area": 576, "sizes": [[24, 24]]}), "either sizes .* or max_area"),
        (lambda d: d["train"].update(bucket_tail="keep"), "train.bucket_tail"),
    ],
)
def test_bucket_settings_are_validated(demo_dict, mutate, message):
    assert re.search(message, _broken(demo_dict, mutate))


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


def test_no_phase_starts_from_one_that_learns_words(demo_dict):
    def learn_then_continue(d):
        d["phases"]["phase2"]["adapter"] = {"rank": 2, "targets": ["cross_attention"], "words": ["orange"]}

    msg = _broken(demo_dict, learn_then_continue)  # phase3 starts from phase2, which learns words
    assert "phases.phase3.init_from" in msg and "learns words (['orange'])" in msg
    twice = _broken(demo_dict, lambda d: d["phases"]["phase8"]["adapter"].update(words=["orange", "orange"]))
    assert "phases.phase8.adapter.words: words must be distinct single words" in twice


def test_missing_params_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")


# --- names that become path components (issue 14, item 4) --------------------------------------------------------

UNSAFE_NAMES = ["../../victim", "..", "a/b", "a\\b", ".hidden", "-rf", "x..y", "a b", "", "tab\t", "q'uote", "a@b"]


@pytest.mark.parametrize("bad", UNSAFE_NAMES)
def test_source_name_must_be_a_safe_path_component(demo_dict, bad):
    msg = _broken(demo_dict, lambda d: d["sources"].update({bad: d["sources"]["laion"]}))
    assert f"sources key {bad!r}" in msg and "letters, digits" in msg


@pytest.mark.parametrize("bad", ["../../victim", "a/b", ".x", "p..q"])
def test_phase_name_must_be_a_safe_path_component(demo_dict, bad):
    msg = _broken(demo_dict, lambda d: d["phases"].update({bad: d["phases"]["phase1"]}))
    assert f"phases key {bad!r}" in msg and "letters, digits" in msg


def test_phase_may_not_be_named_scratch(demo_dict):
    msg = _broken(demo_dict, lambda d: d["phases"].update(scratch=d["phases"]["phase1"]))
    assert "phases key 'scratch'" in msg and "reserved" in msg


@pytest.mark.parametrize(
    ("where", "mutate"),
    [
        ("phases.phase2.init_from", lambda d: d["phases"]["phase2"].update(init_from="../../victim")),
        ("phases.phase3.mix key '../laion'", lambda d: d["phases"]["phase3"].update(mix={"../laion": 1.0})),
        ("eval.prompts key '../cat'", lambda d: d["eval"].update(prompts={"../cat": ["a red circle"]})),
        ("eval.sampling key '../cat'", lambda d: d["eval"].update(sampling={"../cat": {"steps": 2}})),
        ("storage.remote_name", lambda d: d["storage"].update(remote_name='x"]\n[core')),
    ],
)
def test_every_name_that_becomes_a_path_or_identifier_is_checked(demo_dict, where, mutate):
    msg = _broken(demo_dict, mutate)
    assert where in msg and "letters, digits" in msg


def test_shipped_names_stay_valid():
    for path in ("params.yaml", "configs/full/params.yaml"):
        p = load_params(path)
        assert p.sources and p.phases and p.eval.prompts


# --- credentials in URL-valued params (issue 14, item 5) ---------------------------------------------------------

SENTINEL = "SENTINELs3cr3t"
CREDENTIAL_URLS = [
    (("storage", "dvc_remote"), f"s3://AKIAEXAMPLE:{SENTINEL}@bucket/dvcstore"),
    (("storage", "dvc_remote"), f"s3://AKIAEXAMPLE:{SENTINEL}/with/slash@bucket/dvcstore"),
    (("storage", "mlflow_artifacts"), f"s3://AKIAEXAMPLE:{SENTINEL}@bucket/mlflow"),
    (("storage", "endpoint_url"), f"http://minio:{SENTINEL}@minio:9000"),
    (("train", "checkpoint_s3"), f"s3://AKIAEXAMPLE:{SENTINEL}@bucket/ckpts"),
    (("train", "checkpoint_s3"), f"s3://AKIAEXAMPLE:{SENTINEL}/with/slash@bucket/ckpts"),
    (("tracking", "mlflow_uri"), f"https://user:{SENTINEL}@mlflow.example.com"),
    (("tracking", "mlflow_uri"), f"postgresql://user:{SENTINEL}@db/mlflow"),
    (("sources", "laion", "repo"), f"https://user:{SENTINEL}@huggingface.co/datasets/x"),
    (("models", "vae"), f"https://{SENTINEL}@huggingface.co/stabilityai/sd-vae-ft-mse"),
]


@pytest.mark.parametrize(("key", "url"), CREDENTIAL_URLS)
def test_url_params_reject_embedded_credentials_without_echoing_them(demo_dict, key, url):
    def mutate(d):
        section = d
        for part in key[:-1]:
            section = section.setdefault(part, {})
        section[key[-1]] = url

    msg = _broken(demo_dict, mutate)
    assert ".".join(key) in msg and "credentials" in msg and "environment" in msg
    assert SENTINEL not in msg


def test_model_error_does_not_echo_a_credential():
    from sdforge.config import Storage

    with pytest.raises(ValueError, match="credentials") as err:
        Storage(dvc_remote=f"s3://AKIAEXAMPLE:{SENTINEL}@bucket/dvcstore")
    assert SENTINEL not in str(err.value)


@pytest.mark.parametrize(
    ("key", "url"),
    [
        (("storage", "dvc_remote"), "s3://sdforge-artifacts/dvc@v2/store"),
        (("storage", "endpoint_url"), "http://127.0.0.1:9000"),
        (("storage", "endpoint_url"), "https://[::1]:9000/"),
        (("tracking", "mlflow_uri"), "databricks://profile:prefix"),
        (("tracking", "mlflow_uri"), "sqlite:////abs/mlflow.db"),
        (("sources", "laion", "repo"), "laion/relaion2B-en-research-safe"),
    ],
)
def test_url_params_without_credentials_still_load(demo_dict, key, url):
    d = copy.deepcopy(demo_dict)
    section = d
    for part in key[:-1]:
        section = section.setdefault(part, {})
    section[key[-1]] = url
    loaded = parse_params(d)
    value = loaded
    for part in key:
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    assert value == url


def test_an_output_size_over_the_pixel_limit_is_a_config_error():
    assert FetchSettings(image_size=64, max_image_pixels=64 * 64).image_size == 64
    with pytest.raises(ValueError, match=r"image_size 64 makes 4096 output pixels, more than max_image_pixels 4095"):
        FetchSettings(image_size=64, max_image_pixels=4095)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda ph: ph.pop("adapter"), "distill needs an adapter"),
        (lambda ph: ph.update(cfg_dropout=0.1), "cfg_dropout"),
        (lambda ph: ph.update(timestep_sampling="logit_normal"), "timestep_sampling"),
        (lambda ph: ph["distill"].update(w_min=5.0, w_max=4.0), "w_max"),
        (lambda ph: ph["distill"].update(loss="l1"), "loss"),
    ],
)
def test_a_distill_phase_refuses_what_it_cannot_use(demo_dict, change, named):
    message = _broken(demo_dict, lambda d: change(d["phases"]["phase9"]))
    assert "phases.phase9" in message and named in message
