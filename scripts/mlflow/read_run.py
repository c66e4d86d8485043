"""What an MLflow tracking server holds for one experiment, as one JSON object.

    python3 read_run.py URI EXPERIMENT   (run by scripts/mlflow.sh read URI EXPERIMENT)

Only the standard library (urllib), so any python3 runs it, no venv. URI is
the server, http://HOST:PORT (or HOST:PORT); EXPERIMENT is the experiment's
name, or its id if no experiment has that name. Through the REST API 2.0
(runs/search, metrics/get-history, artifacts/list) it prints:

  {"experiment": {"id": "1", "name": "...", "lifecycle_stage": "active"},
   "runs": [{                     # every run, deleted ones too, oldest first
     "run_id": "...", "run_name": "...", "status": "FINISHED",
     "lifecycle_stage": "active", "start_time": MS, "end_time": MS or null,
     "artifact_uri": "...",
     "params": {KEY: VALUE},
     "tags": {KEY: VALUE},        # the mlflow.* system tags included
     "metrics": {KEY: [[STEP, VALUE], ...]},    # the full history, by step
                                                # (then timestamp)
     "metric_timestamps": {KEY: [MS, ...]},     # in the same order
     "artifacts": ["dir/file", ...],            # files, recursively, sorted
     "artifact_sizes": {"dir/file": BYTES}}]}

Non-finite metric values are written as the strings "NaN", "Infinity",
"-Infinity" (strict JSON has no such numbers). Errors (server unreachable,
no such experiment, an API error) go to stderr with status 1.
"""

import json
import math
import sys
import urllib.error
import urllib.parse
import urllib.request

PAGE = 1000


def die(msg):
    print(f"read_run.py: error: {msg}", file=sys.stderr)
    sys.exit(1)


class Api:
    def __init__(self, uri):
        if "://" not in uri:
            uri = "http://" + uri
        self.base = uri.rstrip("/") + "/api/2.0/mlflow/"

    def call(self, method, path, query=None, body=None, missing_ok=False):
        url = self.base + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                code = json.loads(text).get("error_code")
            except ValueError:
                code = None
            if missing_ok and code == "RESOURCE_DOES_NOT_EXIST":
                return None
            die(f"{method} {url}: HTTP {e.code}: {text.strip()[:500]}")
        except (urllib.error.URLError, OSError) as e:
            die(f"{method} {url}: {getattr(e, 'reason', e)} (is the server at {self.base} up?)")


def finite(x):
    if isinstance(x, str):  # MLflow's JSON writes non-finite values as strings
        x = float(x)
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    return x


def experiment(api, name_or_id):
    got = api.call("GET", "experiments/get-by-name", {"experiment_name": name_or_id}, missing_ok=True)
    if got is None and name_or_id.isdigit():
        got = api.call("GET", "experiments/get", {"experiment_id": name_or_id}, missing_ok=True)
    if got is None:
        die(f"no experiment named {name_or_id!r} at {api.base}")
    return got["experiment"]


def runs_of(api, exp_id):
    runs, token = [], None
    while True:
        body = {"experiment_ids": [exp_id], "max_results": PAGE, "run_view_type": "ALL",
                "order_by": ["attributes.start_time ASC"]}
        if token:
            body["page_token"] = token
        got = api.call("POST", "runs/search", body=body)
        runs += got.get("runs", [])
        token = got.get("next_page_token")
        if not token:
            return runs


def history(api, run_id, key):
    points, token = [], None
    while True:
        query = {"run_id": run_id, "metric_key": key, "max_results": 25000}
        if token:
            query["page_token"] = token
        got = api.call("GET", "metrics/get-history", query)
        points += got.get("metrics", [])
        token = got.get("next_page_token")
        if not token:
            break
    points.sort(key=lambda m: (int(m.get("step", 0)), int(m.get("timestamp", 0))))
    return points


def artifacts(api, run_id, path=""):
    files, token = {}, None
    while True:
        query = {"run_id": run_id}
        if path:
            query["path"] = path
        if token:
            query["page_token"] = token
        got = api.call("GET", "artifacts/list", query)
        for f in got.get("files", []):
            if f.get("is_dir"):
                files.update(artifacts(api, run_id, f["path"]))
            else:
                files[f["path"]] = int(f.get("file_size", 0))
        token = got.get("next_page_token")
        if not token:
            return files


def describe(api, run):
    info, data = run["info"], run.get("data", {})
    run_id = info["run_id"]
    metrics, stamps = {}, {}
    for key in sorted({m["key"] for m in data.get("metrics", [])}):
        points = history(api, run_id, key)
        metrics[key] = [[int(m.get("step", 0)), finite(m["value"])] for m in points]
        stamps[key] = [int(m.get("timestamp", 0)) for m in points]
    files = artifacts(api, run_id)
    end = info.get("end_time")
    return {
        "run_id": run_id,
        "run_name": info.get("run_name"),
        "status": info.get("status"),
        "lifecycle_stage": info.get("lifecycle_stage"),
        "start_time": int(info["start_time"]) if "start_time" in info else None,
        "end_time": int(end) if end is not None else None,
        "artifact_uri": info.get("artifact_uri"),
        "params": dict(sorted((p["key"], p.get("value", "")) for p in data.get("params", []))),
        "tags": dict(sorted((t["key"], t.get("value", "")) for t in data.get("tags", []))),
        "metrics": metrics,
        "metric_timestamps": stamps,
        "artifacts": sorted(files),
        "artifact_sizes": dict(sorted(files.items())),
    }


def main():
    if len(sys.argv) != 3:
        die("usage: read_run.py URI EXPERIMENT")
    api = Api(sys.argv[1])
    exp = experiment(api, sys.argv[2])
    out = {
        "experiment": {
            "id": exp["experiment_id"],
            "name": exp.get("name"),
            "lifecycle_stage": exp.get("lifecycle_stage"),
        },
        "runs": [describe(api, r) for r in runs_of(api, exp["experiment_id"])],
    }
    json.dump(out, sys.stdout, allow_nan=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
