"""The Apache Beam runner of the data preparation (:mod:`.algorithm`; picked by ``runner``, see :mod:`jaxtrain.data.prepare`).

The same four steps as the in-process executor, on any Beam runner: locally DirectRunner (Beam's switching
runner: its Prism runner where it can fetch the binary from GitHub, else the Python FnApiRunner, which
``--runner=FnApiRunner`` names directly, as the tests do: no download), with ``--workers=N`` becoming
``--direct_num_workers=N --direct_running_mode=multi_processing``; on a cluster DaskRunner (a Dask scheduler:
``-- --dask_client_address=HOST:8786``; one task per input file unless ``--dask_npartitions`` /
``--dask_partition_size`` say otherwise), DataflowRunner, FlinkRunner or SparkRunner, with their options passed
through (``tools/prepare_data.py ... --runner=DataflowRunner -- --project=P --region=R
--temp_location=gs://...``). Workers read the inputs and write the output folder themselves, so on a cluster both
are on storage every worker reaches (an object store, a shared file system)::

  files ─ Reshuffle ─ Scatter ─┬─ parts ((split, bucket) -> part file) ─────────────┬─ CoGroupByKey ─ Gather ─┬─ results
                               ├─ LSH bands ─ GroupByKey ─ near duplicates ─────────┘                         │
                               └─ errors (DataError: file and line) ─────────────────────────────────────────┘

The tokens themselves never go through Beam's shuffle: each scatter worker writes them to part files under the
output's temporary folder and the shuffle carries only part names (and, with near-duplicate removal, one small
record per document and band). That is deliberate: the local runners keep every shuffled element in memory, so
shuffling the documents would make the preparation's memory grow with the input; this way a worker holds one
64 MiB buffer while scattering and one bucket (about ``shard_mib``) while gathering, on every runner. The
driver then writes the manifest and renames the folder into place (:func:`algorithm.finalize`).
"""

from __future__ import annotations

import json

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from etils import epath

from jaxtrain.data import dedup
from jaxtrain.data.prepare import algorithm
from jaxtrain.errors import DataError


# Runners that Beam's create_runner does not know by their short name.
_RUNNERS = {"daskrunner": "apache_beam.runners.dask.dask_runner.DaskRunner",
            "dask": "apache_beam.runners.dask.dask_runner.DaskRunner"}


def runner_name(runner: str) -> str:
  """``runner`` as Beam's ``--runner`` takes it: ``DaskRunner`` (or ``dask``) spelled out as its module path."""
  return _RUNNERS.get(runner.lower(), runner)


def check(opts) -> None:
  """The runner is one Beam knows, its packages installed: one DataError line if not."""
  try:
    beam.runners.create_runner(runner_name(opts.runner))
  except (ValueError, ImportError) as e:
    raise DataError("--runner", f"'{opts.runner}' is not a usable Beam runner ({str(e)[:120]})",
                    "use DirectRunner locally, DaskRunner on a Dask cluster (pip install -e '.[beam]'), or "
                    "DataflowRunner, FlinkRunner or SparkRunner") from None


def _scatter(index: int, plan):
  """:func:`algorithm.scatter` of one input file: its ``(kind, key, value)`` records, a DataError as an ``error``
  record (an output, not an exception: the driver reports it as one line, and runners would retry a raise)."""
  try:
    yield from algorithm.scatter(plan, index)
  except DataError as e:
    yield "error", index, (e.subject, e.problem, e.fix)


def _of_kind(record, kind: str):
  """``record``'s (key, value) when it is of ``kind``."""
  return [(record[1], record[2])] if record[0] == kind else []


def _is_error(record) -> bool:
  return record[0] == "error"


def _near_duplicates(band):
  _, members = band
  return dedup.near_duplicates(list(members))


def _gather(item, plan):
  (split, bucket), grouped = item
  return "entry", algorithm.gather(plan, split, bucket, list(grouped["parts"]), list(grouped["dropped"]))


def _write_results(grouped, path: str):
  epath.Path(path).write_text(json.dumps(sorted(grouped[1], key=json.dumps)))


def run(plan) -> list[dict]:
  """Runs the scatter, near-duplicate and gather steps on ``plan.opts.runner``; returns the shards' entries.
  Raises the first (by input file) DataError the workers met.

  The pipeline keeps to what every runner executes alike: one output per step (the scatter's records carry their
  kind and are selected by FlatMaps, not tagged outputs), no side inputs, and one sink (entries and errors
  grouped under one key, written as one file). Beam's DaskRunner needs that: it computes only the last step it
  visits (a second sink never runs), hands the consumers of a tagged output the step's whole output, and serves a
  side input (``ToList``'s global combine has one) by computing its bag inside the consuming task."""
  dask = runner_name(plan.opts.runner) == _RUNNERS["dask"]
  args = [f"--runner={runner_name(plan.opts.runner)}", *plan.opts.pipeline_options]
  if plan.opts.workers > 1 and not any(a.startswith("--direct_") for a in args):
    args += [f"--direct_num_workers={plan.opts.workers}", "--direct_running_mode=multi_processing"]
  if dask and not any(a.startswith(("--dask_npartitions", "--dask_partition_size")) for a in args):
    args.append("--dask_partition_size=1")  # one input file per task (DaskRunner's default: 128 files)
  if not any(a.startswith("--default_sdk_harness_log_level") for a in args):
    args.append("--default_sdk_harness_log_level=WARNING")  # the workers' INFO lines are per bundle: noise
  results = epath.Path(plan.work) / "results.json"
  p = beam.Pipeline(options=PipelineOptions(args))
  records = (p | "Files" >> beam.Create(range(len(plan.files))) | "Spread" >> beam.Reshuffle()
             | "Scatter" >> beam.FlatMap(_scatter, plan))
  parts = records | "Parts" >> beam.FlatMap(_of_kind, "part")
  dropped = (records | "Bands" >> beam.FlatMap(_of_kind, "band") | "ByBand" >> beam.GroupByKey()
             | "NearDuplicates" >> beam.FlatMap(_near_duplicates))
  entries = ({"parts": parts, "dropped": dropped} | "ByBucket" >> beam.CoGroupByKey()
             | "Gather" >> beam.Map(_gather, plan))
  errors = records | "Errors" >> beam.Filter(_is_error)
  _ = ((entries, errors) | "Results" >> beam.Flatten() | "OneKey" >> beam.Map(lambda r: (0, r))
       | "Together" >> beam.GroupByKey() | "Write" >> beam.Map(_write_results, str(results)))
  try:
    result = p.run()
  except OSError as e:  # DaskRunner connects to its scheduler here: nothing else in run() does I/O
    address = next((a.split("=", 1)[1] for a in args if a.startswith("--dask_client_address=")), None)
    if not dask or address is None:
      raise
    raise DataError("--dask_client_address", f"no Dask scheduler answers at {address} ({str(e)[:120]})",
                    "start one (dask scheduler) or fix the address") from None
  try:
    result.wait_until_finish()
  finally:
    if getattr(result, "client", None) is not None:  # DaskRunner's connection to the scheduler
      result.client.close()
  found = json.loads(results.read_text()) if results.exists() else []
  if results.exists():
    results.unlink()
  errors = sorted((r[1], *r[2]) for r in found if r[0] == "error")  # (input file, subject, problem, fix)
  if errors:
    raise DataError(*errors[0][1:])
  return [r[1] for r in found if r[0] == "entry"]
