"""A run's stream as an MLflow run: the same tags and steps as the TensorBoard file and the W&B export
(wandb_export.values_by_step), the settings as its params. Optional (`pip install shardconsole[mlflow]`:
mlflow-skinny, the client alone, no server). Offline by default: a file store in `<run folder>/mlruns`,
which `mlflow ui --backend-store-uri <run folder>/mlruns` shows; MLFLOW_TRACKING_URI names another store
(a server, a database) instead.

MLflow 3 keeps its file store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE=true;
it is set for this process only when the store is the default file one, since the database store needs
the full mlflow package and a server is what the default avoids.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from shardconsole.envvars import read
from shardconsole.history.wandb_export import values_by_step
from shardconsole.runlog.runfolder import RunFolder
from shardconsole.settings import config as C

EXPERIMENT = "shardconsole"
BATCH = 1000         # MLflow's log_batch takes at most 1000 metrics a call


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:6000]     # MLflow's limit on a param value
    return out


def export(run_dir: Path) -> str:
    """Write the run to MLflow; returns one line saying where. ConfigError when mlflow is not installed."""
    folder = RunFolder(Path(run_dir))
    uri = read("MLFLOW_TRACKING_URI") or (folder.path / "mlruns").resolve().as_uri()
    if uri.startswith("file:"):
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise C.ConfigError("--mlflow needs the mlflow-skinny package: pip install 'shardconsole[mlflow]'") from None
    try:
        params = _flat(C.load(folder.preset).to_dict())
    except (C.ConfigError, OSError):
        params = {}
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(EXPERIMENT)
    run = client.create_run(exp_id, run_name=folder.run_id, tags={"shardconsole.run_folder": str(folder.path)})
    rid = run.info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric(tag, value, now, step) for step, values in values_by_step(folder) for tag, value in values.items()]
    try:
        plist = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(plist), 100):          # at most 100 params a batch
            client.log_batch(rid, params=plist[i:i + 100])
        for i in range(0, len(metrics), BATCH):
            client.log_batch(rid, metrics=metrics[i:i + BATCH])
    finally:
        client.set_terminated(rid)
    return f"{folder.run_id}: MLflow run {rid} in {uri} ({len(metrics)} values)"
