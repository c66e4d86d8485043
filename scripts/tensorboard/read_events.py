"""What TensorBoard's own reader loads from a log directory, as one JSON object.

    python read_events.py LOGDIR     (run by scripts/tensorboard.sh read LOGDIR)

Each directory at or under LOGDIR that holds event files (a name with
"tfevents" in it, as TensorBoard decides) is a run, named by its path
relative to LOGDIR ("." for LOGDIR itself), and is loaded as TensorBoard
loads it: an EventAccumulator on that directory (all its event files, in
name order), keeping every scalar and tensor (size_guidance 0). Prints:

  {"runs": {RUN: {
     "file_version": 2.0,          # from the file_version event ("brain.Event:2")
     "writer": "...",              # source_metadata.writer, or null
     "files": [{"name": F, "records": N, "error": null or "..."}],
     "scalars": {TAG: {"steps": [...], "values": [...], "wall_times": [...]}},
     "text": {TAG: {"steps": [...], "values": [...], "wall_times": [...]}},
     "tags": {CATEGORY: [TAG, ...]},  # ea.Tags(), empty categories left out
     "plugins": {PLUGIN: [TAG, ...]}  # tags by summary_metadata.plugin_data
  }}, "errors": ["RUN/F: ..."]}

scalars: Summary.Value.simple_value scalars (ea.Scalars), and also scalars
written TF2-style as rank-0 tensors with the "scalars" plugin (TensorBoard
shows both). text: the tags of the "text" plugin, each tensor decoded with
tensor_util.make_ndarray: a rank-0 string is its UTF-8 text, a rank-1 or
rank-2 tensor a list (of lists) of cells. Non-finite floats are written as
the strings "NaN", "Infinity", "-Infinity" (strict JSON has no such numbers).

TensorBoard stops reading a file at its first bad record (a CRC mismatch or
a truncated record) without saying so, so each file is also read record by
record with TensorBoard's own record reader: "records" counts the records
read before an error and "error" names it; "errors" gathers them all (an
empty list when every record of every file checks out). A LOGDIR without
event files is an error: a message on stderr and status 1.
"""

import json
import logging
import math
import os
import sys

logging.getLogger("tensorboard").setLevel(logging.ERROR)

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    SCALARS,
    TENSORS,
    EventAccumulator,
)
from tensorboard.compat.tensorflow_stub import errors as tf_errors  # noqa: E402
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402


def die(msg):
    print(f"read_events.py: error: {msg}", file=sys.stderr)
    sys.exit(1)


def is_event_file(name):
    # TensorBoard's own test (io_wrapper.IsTensorFlowEventsFile).
    return "tfevents" in name


def finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    return x


def plain(v):
    """A decoded tensor value as JSON: bytes as UTF-8 text, arrays as lists."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return finite(v)


def check_records(path):
    """(records, error) reading path with TensorBoard's record reader."""
    reader = pywrap_tensorflow.PyRecordReader_New(path, 0, None, None)
    records = 0
    while True:
        try:
            reader.GetNext()
        except tf_errors.OutOfRangeError:
            return records, None
        except tf_errors.DataLossError as e:
            return records, e.message
        records += 1


def series(events, value):
    return {
        "steps": [e.step for e in events],
        "values": [value(e) for e in events],
        "wall_times": [e.wall_time for e in events],
    }


def plugin_tags(ea, plugin):
    try:
        return sorted(ea.PluginTagToContent(plugin))
    except KeyError:
        return []


def load_run(path):
    ea = EventAccumulator(path, size_guidance={SCALARS: 0, TENSORS: 0})
    ea.Reload()
    tags = {k: sorted(v) if isinstance(v, list) else v for k, v in ea.Tags().items() if v}
    plugins = {}
    for tag in ea.Tags().get(TENSORS, []):
        meta = ea.SummaryMetadata(tag)
        plugins.setdefault(meta.plugin_data.plugin_name or "", []).append(tag)
    scalars = {tag: series(ea.Scalars(tag), lambda e: finite(e.value)) for tag in sorted(ea.Tags()[SCALARS])}
    for tag in plugin_tags(ea, "scalars"):
        scalars[tag] = series(
            ea.Tensors(tag), lambda e: plain(tensor_util.make_ndarray(e.tensor_proto))
        )
    text = {
        tag: series(ea.Tensors(tag), lambda e: plain(tensor_util.make_ndarray(e.tensor_proto)))
        for tag in plugin_tags(ea, "text")
    }
    return {
        "file_version": ea.file_version,
        "writer": ea.GetSourceWriter(),
        "scalars": scalars,
        "text": text,
        "tags": tags,
        "plugins": {k: sorted(v) for k, v in sorted(plugins.items())},
    }


def main():
    if len(sys.argv) != 2:
        die("usage: read_events.py LOGDIR")
    logdir = sys.argv[1]
    if not os.path.isdir(logdir):
        die(f"{logdir} is not a directory")
    runs, errors = {}, []
    for dirpath, dirnames, filenames in os.walk(logdir):
        dirnames.sort()
        names = sorted(f for f in filenames if is_event_file(f))
        if not names:
            continue
        name = os.path.relpath(dirpath, logdir)
        run = load_run(dirpath)
        files = []
        for f in names:
            records, error = check_records(os.path.join(dirpath, f))
            files.append({"name": f, "records": records, "error": error})
            if error:
                errors.append(f"{name}/{f}: {error}")
        run["files"] = files
        runs[name] = run
    if not runs:
        die(f"no event files (names with 'tfevents') in {logdir} or below it")
    for e in errors:
        print(f"read_events.py: warning: {e}", file=sys.stderr)
    json.dump({"runs": runs, "errors": errors}, sys.stdout, allow_nan=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
