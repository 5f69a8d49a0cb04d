"""Reads an MLflow file store with MLflow's own client and prints JSON:
{"experiments": {name: id}, "runs": [{"experiment", "name", "status", "params", "tags",
"metrics": {key: [[step, value, timestamp], ...]}}]}. Exits 3 without mlflow."""
import json
import os
import sys

# MLflow 3 opens a file store only when told to (it would rather have a database).
os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
try:
    from mlflow.tracking import MlflowClient
except ImportError:
    sys.exit(3)

client = MlflowClient(tracking_uri="file://" + os.path.abspath(sys.argv[1]))
out = {"experiments": {}, "runs": []}
for exp in client.search_experiments():
    out["experiments"][exp.name] = exp.experiment_id
    for run in client.search_runs([exp.experiment_id]):
        metrics = {}
        for key in run.data.metrics:
            history = client.get_metric_history(run.info.run_id, key)
            metrics[key] = [[m.step, m.value, m.timestamp] for m in history]
        out["runs"].append({"experiment": exp.name, "name": run.info.run_name,
                            "status": run.info.status, "params": run.data.params,
                            "tags": run.data.tags, "metrics": metrics})
print(json.dumps(out))
