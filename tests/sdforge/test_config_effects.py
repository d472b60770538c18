"""The weight-effect classification of the ``train`` and ``phases.<p>`` keys, and ``train``'s concerns.

The train stage's run-dir fingerprint hashes exactly the WEIGHTS keys: a key classified NONE or JOB by mistake
would let a run resume with other weights' settings, one classified WEIGHTS by mistake would restart runs.
"""

import copy
from typing import Annotated

import pytest
import yaml
from pydantic import BaseModel

from sdforge.config import (
    CheckpointSettings,
    ConfigError,
    Effect,
    EmaSettings,
    LaunchSettings,
    MemorySettings,
    OptimizerSettings,
    Phase,
    PrecisionSettings,
    ReportingSettings,
    ResilienceSettings,
    Section,
    Train,
    TrainingRecipe,
    key_effect,
    keys_by_effect,
    parse_params,
)

CONCERNS = Train.__bases__
"""TrainingRecipe, OptimizerSettings, EmaSettings, PrecisionSettings, MemorySettings, CheckpointSettings,
ReportingSettings, LaunchSettings, ResilienceSettings."""
TRAIN_NONE = {
    "save_steps", "keep_last", "keep_every", "keep_best", "checkpoint_s3", "async_checkpoint",
    "log_every", "validation_every", "validation_prompts", "val_loss_every", "val_loss_timesteps", "val_loss_batch",
    "progress_bar",
    "preempt_grace_s", "hang_timeout_s",
}  # fmt: skip
TRAIN_JOB = {"nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "parallel", "activation_checkpointing",
             "memory_budget_gib", "cuda_graphs"}


@pytest.fixture(scope="module")
def demo_dict():
    with open("params.yaml") as fh:
        return yaml.safe_load(fh)


def _train_error(demo_dict, **train) -> str:
    d = copy.deepcopy(demo_dict)
    d["train"] = {**d.get("train", {}), **train}
    with pytest.raises(ConfigError) as err:
        parse_params(d, origin="params.yaml")
    return str(err.value)


def test_every_train_key_belongs_to_exactly_one_concern():
    owners = {key: [c.__name__ for c in CONCERNS if key in c.model_fields] for key in Train.model_fields}
    assert {key: names for key, names in owners.items() if len(names) != 1} == {}
    assert set(Train.model_fields) == {key for c in CONCERNS for key in c.model_fields}
    assert len(CONCERNS) == 9 and all(issubclass(c, Section) and c.model_fields for c in CONCERNS)
    assert {c.EFFECT for c in (CheckpointSettings, ReportingSettings, ResilienceSettings)} == {Effect.NONE}
    assert LaunchSettings.EFFECT is MemorySettings.EFFECT is Effect.JOB
    assert {c.EFFECT for c in (TrainingRecipe, OptimizerSettings, EmaSettings, PrecisionSettings)} == {Effect.WEIGHTS}
    assert "__annotations__" not in vars(Train) or not vars(Train)["__annotations__"]  # no key outside a concern


def test_train_keys_by_effect():
    effects = keys_by_effect(Train)
    assert list(effects) == list(Train.model_fields)
    assert {k for k, e in effects.items() if e is Effect.NONE} == TRAIN_NONE
    assert {k for k, e in effects.items() if e is Effect.JOB} == TRAIN_JOB
    assert {k for k, e in effects.items() if e is Effect.WEIGHTS} == set(Train.model_fields) - TRAIN_NONE - TRAIN_JOB
    assert {"seed", "adam_betas", "ema_decay", "mixed_precision", "deterministic"} <= {
        k for k, e in effects.items() if e is Effect.WEIGHTS
    }


def test_phase_keys_by_effect_only_description_and_eval_grid_are_none():
    effects = keys_by_effect(Phase)
    assert {k for k, e in effects.items() if e is not Effect.WEIGHTS} == {"description", "eval_grid"}
    assert effects["description"] is Effect.NONE and effects["eval_grid"] is Effect.NONE


def test_key_effect_field_metadata_wins_and_mro_decides_otherwise():
    class Base(Section):
        EFFECT = Effect.NONE
        a: int = 0
        d: Annotated[int, Effect.WEIGHTS] = 0

    class Child(Base):
        EFFECT = Effect.JOB
        b: int = 0

    class Overridden(Child):
        a: int = 1  # re-declared here: the effect of this class (Child's, inherited)

    class Plain(BaseModel):
        x: int = 0

    assert keys_by_effect(Child) == {"a": Effect.NONE, "d": Effect.WEIGHTS, "b": Effect.JOB}
    assert key_effect(Overridden, "a") is Effect.JOB
    assert key_effect(Plain, "x") is Effect.WEIGHTS
    assert key_effect(Phase, "description") is Effect.NONE and Phase.EFFECT is Effect.WEIGHTS
    assert Train.EFFECT is Effect.WEIGHTS  # not CheckpointSettings' NONE through the MRO
    with pytest.raises(KeyError, match="no key 'keep_lst'"):
        key_effect(Train, "keep_lst")


def test_train_keys_stay_flat_and_errors_name_train_keys(demo_dict):
    assert Train(keep_last=5, nnodes=2, node_rank=1, seed=3).keep_last == 5
    assert "params.yaml: train: train.node_rank 3 must be < train.nnodes 2" in _train_error(
        demo_dict, nnodes=2, node_rank=3, rdzv_endpoint="node0:29400"
    )
    assert "params.yaml: train.keep_lst: Extra inputs are not permitted" in _train_error(demo_dict, keep_lst=3)
    assert "params.yaml: train.checkpoints: Extra inputs are not permitted" in _train_error(
        demo_dict, checkpoints={"keep_last": 3}
    )
    assert "params.yaml: train.ema_decay: Input should be less than 1" in _train_error(demo_dict, ema_decay=1.5)


def test_a_bare_yaml_on_or_off_is_read_as_the_word():
    assert Train(**yaml.safe_load("async_checkpoint: on")).async_checkpoint == "on"
    assert Train(**yaml.safe_load("async_checkpoint: off")).async_checkpoint == "off"
