"""The Apache Beam runner of the data preparation (:mod:`.algorithm`; picked by ``runner``, see :mod:`jaxtrain.data.prepare`).

The same four steps as the in-process executor, on any Beam runner: locally DirectRunner (Beam's switching
runner: its Prism runner where it can fetch the binary from GitHub, else the Python FnApiRunner, which
``--runner=FnApiRunner`` names directly, as the tests do: no download), with ``--workers=N`` becoming
``--direct_num_workers=N --direct_running_mode=multi_processing``; DataflowRunner, FlinkRunner or SparkRunner at
scale, with their options passed through (``tools/prepare_data.py ... --runner=DataflowRunner -- --project=P
--region=R --temp_location=gs://...``)::

  files ─ Reshuffle ─ Scatter ─┬─ parts ((split, bucket) -> part file) ─────────────┬─ CoGroupByKey ─ Gather ─ shards
                               ├─ LSH bands ─ GroupByKey ─ near duplicates ─────────┘
                               └─ errors (DataError: file and line)

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


def check(opts) -> None:
  """The runner is one Beam knows: one DataError line if not."""
  try:
    beam.runners.create_runner(opts.runner)
  except (ValueError, ImportError) as e:
    raise DataError("--runner", f"'{opts.runner}' is not a usable Beam runner ({str(e)[:120]})",
                    "use DirectRunner locally, or DataflowRunner, FlinkRunner or SparkRunner") from None


class Scatter(beam.DoFn):
  """:func:`algorithm.scatter` of one input file: part names as the main output, LSH bands and errors tagged."""

  def __init__(self, plan):
    self.plan = plan

  def process(self, index):
    try:
      for kind, key, value in algorithm.scatter(self.plan, index):
        yield (key, value) if kind == "part" else beam.pvalue.TaggedOutput(kind, (key, value))
    except DataError as e:
      # An output, not an exception: the driver reports it as one line, and runners would retry a raise.
      yield beam.pvalue.TaggedOutput("error", (index, e.subject, e.problem, e.fix))


def _near_duplicates(band):
  _, members = band
  return dedup.near_duplicates(list(members))


def _gather(item, plan):
  (split, bucket), grouped = item
  return algorithm.gather(plan, split, bucket, list(grouped["parts"]), list(grouped["dropped"]))


def _write_json(items, path: str):
  epath.Path(path).write_text(json.dumps(sorted(items, key=json.dumps)))


def run(plan) -> list[dict]:
  """Runs the scatter, near-duplicate and gather steps on ``plan.opts.runner``; returns the shards' entries.
  Raises the first (by input file) DataError the workers met."""
  args = [f"--runner={plan.opts.runner}", *plan.opts.pipeline_options]
  if plan.opts.workers > 1 and not any(a.startswith("--direct_") for a in args):
    args += [f"--direct_num_workers={plan.opts.workers}", "--direct_running_mode=multi_processing"]
  if not any(a.startswith("--default_sdk_harness_log_level") for a in args):
    args.append("--default_sdk_harness_log_level=WARNING")  # the workers' INFO lines are per bundle: noise
  work = epath.Path(plan.work)
  entries, errors = work / "entries.json", work / "errors.json"
  with beam.Pipeline(options=PipelineOptions(args)) as p:
    scattered = (p | "Files" >> beam.Create(range(len(plan.files))) | "Spread" >> beam.Reshuffle()
                 | "Scatter" >> beam.ParDo(Scatter(plan)).with_outputs("band", "error", main="part"))
    dropped = (scattered.band | "Bands" >> beam.GroupByKey()
               | "NearDuplicates" >> beam.FlatMap(_near_duplicates))
    _ = ({"parts": scattered.part, "dropped": dropped} | "ByBucket" >> beam.CoGroupByKey()
         | "Gather" >> beam.Map(_gather, plan) | "Entries" >> beam.combiners.ToList()
         | "WriteEntries" >> beam.Map(_write_json, str(entries)))
    _ = (scattered.error | "Errors" >> beam.combiners.ToList()
         | "WriteErrors" >> beam.Map(_write_json, str(errors)))
  found, gathered = json.loads(errors.read_text()), json.loads(entries.read_text())
  errors.unlink()
  entries.unlink()
  if found:
    raise DataError(*min(found)[1:])
  return gathered
