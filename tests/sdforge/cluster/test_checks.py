"""Planted mistakes in params are caught before anything is submitted, each with the key to change."""

from __future__ import annotations

import pytest
import yaml

from sdforge.cluster.checks import ClusterConfigError, check_cluster, cluster_problems
from sdforge.cluster.train_job import run_cluster_stage, submits_job
from sdforge.config import ConfigError, parse_params
from sdforge.training.launch import NODE_RANK_ENV, TRAIN_JOB_ENV, node_rank
from tests.fixtures.cluster import FakeApi, cluster_data
from tools.cluster import main as cluster_cli


def test_complete_params_have_no_problem():
    assert cluster_problems(parse_params(cluster_data(2))) == []


def test_multi_node_without_a_rendezvous_is_named_when_params_load():
    with pytest.raises(ConfigError, match=r"cluster\.rdzv_port"):
        parse_params(cluster_data(2, rdzv_port=None))
    data = cluster_data(2, enabled=False)
    data["train"]["rdzv_endpoint"] = None
    with pytest.raises(ConfigError, match=r"train\.rdzv_endpoint"):
        parse_params(data)


@pytest.mark.parametrize(
    ("plant", "keys"),
    [
        (lambda d: d["cluster"].update(gpus_per_pod=4), ["cluster.gpus_per_pod", "train.nproc_per_node"]),
        (lambda d: d["storage"].update(dvc_remote=None), ["storage.dvc_remote"]),
        (lambda d: d["train"].update(checkpoint_s3=None), ["train.checkpoint_s3"]),
        (lambda d: d["cluster"].update(work_pvc=None), ["cluster.work_pvc"]),
        (lambda d: d["cluster"].update(image=None), ["cluster.image"]),
        (lambda d: d["paths"].update(models="models"), ["paths.models"]),
    ],
    ids=["gpus-vs-processes", "no-dvc-remote", "no-checkpoint-s3", "no-work-claim", "no-image", "models-a-mount"],
)
def test_a_planted_mistake_is_named_and_nothing_is_submitted(tmp_path, plant, keys, caplog):
    data = cluster_data(2)
    plant(data)
    params = parse_params(data)
    problems = cluster_problems(params)
    assert len(problems) == 1 and all(key in problems[0] for key in keys), problems
    with pytest.raises(ClusterConfigError, match=keys[0].replace(".", r"\.")):
        check_cluster(params)
    # the stage's own path: status 2, the key in its log, no object created
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    api = FakeApi(pods=[], outcome="Complete")
    assert run_cluster_stage(path, "phase1", api) == 2
    assert api.created == []
    assert keys[0] in caplog.text
    # and the operator's command
    assert cluster_cli(["check", "--params", str(path)]) == 2


def test_the_stage_submits_only_on_the_cluster_with_several_nodes_outside_a_job():
    params = parse_params(cluster_data(2))
    assert submits_job(params, {})
    assert not submits_job(params, {TRAIN_JOB_ENV: "sdforge-phase1-0123abcd"})  # a pod of the job: runs torchrun
    assert not submits_job(parse_params(cluster_data(1)), {})
    local = cluster_data(2, enabled=False)
    local["train"]["rdzv_endpoint"] = "node0.example:29400"  # machines started by hand: torchrun, no job
    assert not submits_job(parse_params(local), {})


def test_node_rank_comes_from_the_pod_index():
    train = parse_params(cluster_data(4)).train
    assert node_rank(train, {NODE_RANK_ENV: "3"}) == 3
    assert node_rank(train, {}) == 0
    with pytest.raises(ValueError, match=NODE_RANK_ENV):
        node_rank(train, {NODE_RANK_ENV: "4"})
