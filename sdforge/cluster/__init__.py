"""Kubernetes: the manifests the project runs on a cluster, the checks before anything is submitted, the job runner.

- :mod:`~sdforge.cluster.checks`: mistakes in params that would only show on the cluster, named by key.
- :mod:`~sdforge.cluster.manifests`: the multi-node training job (an Indexed ``Job``, a headless ``Service``, a
  ``ConfigMap`` with the params) and the volumes and environment shared with the flows' pods.
- :mod:`~sdforge.cluster.work_pool`: the Prefect Kubernetes work pool's base job template (``deploy/kubernetes``)
  with its defaults taken from params, rendered for a deployment through ``prefect-kubernetes``' own code.
- :mod:`~sdforge.cluster.job_runner`: submit a training job, stream its pod logs, wait, report why it failed.

docs/CLUSTER.md is the manual.
"""
