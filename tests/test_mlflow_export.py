"""`shardconsole runs RUN --mlflow`: a finished 2-rank run written to a local MLflow file store, read back with
MLflow's own client; the expected values are the run's stream (its Step messages), not the exporter's."""

from __future__ import annotations

import pytest

from tests.conftest import messages, of_kind, shardconsole

mlflow = pytest.importorskip("mlflow", reason="shardconsole[mlflow] or [test] installs mlflow-skinny")

pytestmark = pytest.mark.slow


def test_a_run_reads_back_from_mlflows_own_store(fsdp_tiny_run, tmp_path, monkeypatch):
    run = fsdp_tiny_run.run
    assert fsdp_tiny_run.res.returncode == 0, fsdp_tiny_run.res.stderr[-2000:]
    store = tmp_path / "mlruns"
    res = shardconsole("runs", str(run), "--mlflow", env={"MLFLOW_TRACKING_URI": store.as_uri()})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "MLflow run" in res.stdout and store.as_uri() in res.stdout, res.stdout
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.tracking.MlflowClient(tracking_uri=store.as_uri())
    runs = client.search_runs([client.get_experiment_by_name("shardconsole").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == run.name
    steps = {m.step: m.loss for m in of_kind(messages(run), "step")}
    history = client.get_metric_history(runs[0].info.run_id, "loss/train")
    assert {h.step: h.value for h in history} == pytest.approx(steps, rel=1e-6)
    assert len(steps) == 4            # a step line every 3 of 12
    assert runs[0].data.params["train.steps"] == "12"


def test_the_default_store_is_the_run_folders_own(fsdp_tiny_run, tmp_path):
    """Offline with nothing set: a file store inside (a copy of) the run folder."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(fsdp_tiny_run.run, run)
    res = shardconsole("runs", str(run), "--mlflow", env={"MLFLOW_TRACKING_URI": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    assert (run / "mlruns").is_dir() and (run / "mlruns").resolve().as_uri() in res.stdout
