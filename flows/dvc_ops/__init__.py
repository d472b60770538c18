"""The flows' DVC plumbing: the stage graph (``dag``), one stage run in its own process group (``runner``),
the S3 remote: configure, restore, push (``remote``).

Not named ``flows/dvc``: Prefect puts ``flows/`` on ``sys.path`` when it loads a flow from its file, and a
``dvc`` package there would shadow DVC itself (``ModuleNotFoundError: No module named 'dvc.repo'``).
"""
