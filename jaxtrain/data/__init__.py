"""Data sources, chosen by ``data.source`` from :data:`SOURCES`. Every source yields per-process numpy batches in
the format of :mod:`jaxtrain.data.batch`; :func:`to_global` assembles them into global jax.Arrays, after checking
their token ids against the model's vocabulary (:mod:`jaxtrain.data.ids`; eval batches: :func:`eval_sets`). A new
source is one ``SOURCES.register(name, Source(...))`` (:mod:`jaxtrain.data.source`): its train stream (a
:class:`jaxtrain.checkpoint.DataPosition`, so that checkpoints hold its position), its eval batches, where a
batch's rows came from, its own keys (``data.<name>``) and checks, its tokenizer, and whether a mixture can take it.
This package knows no source by name: the built-in ones register in their own modules, imported here."""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator

import jax
import ml_collections
from jax.sharding import NamedSharding

from jaxtrain import paths
from jaxtrain.data import arrayrecord, folders, ids, mixture, prompts, stream, synthetic  # noqa: F401 - built-in sources
from jaxtrain.data.batch import KEYS
from jaxtrain.data import source as source_lib
from jaxtrain.data.source import SOURCES, Documents, Folder, Source, options  # noqa: F401 - the API of sources
from jaxtrain.errors import ConfigError, check_positive


def defaults() -> ml_collections.ConfigDict:
  """The ``data`` config group."""
  return ml_collections.ConfigDict(dict(
      source="arrayrecord",  # a name in SOURCES: arrayrecord (tools/prepare_data.py's output) | raw | synthetic
      path="",  # prepared data folder; empty = the bundled Shakespeare corpus, prepared on first use. raw: a
      # file, folder or glob of .jsonl / .parquet / .txt files
      seq_len=128,
      packing=True,  # pack documents into rows (segment ids keep them apart); False = one padded doc per row
      tokenizer="",  # if set ('byte' or a tokenizer file), the data must have been prepared with it
      num_workers=0,  # Grain worker processes (0 = in-process, fastest on few cores)
      prefetch=2,  # batches buffered per worker
      verify_checksums=True,  # SHA-256 of every shard against the manifest at start
      cache_dir="~/.cache/jaxtrain",  # where the bundled corpus is prepared
      # data.source=raw's (jaxtrain/data/stream.py), and read by raw components of a mixture and eval sets:
      field="text",  # the JSONL field / Parquet column holding the text
      eval_path="",  # eval records (file, folder or glob); empty = the last eval_fraction of data.path
      eval_fraction=0.0,  # without eval_path: this fraction of data.path's records (its last ones) is eval only
      # several folders mixed (jaxtrain/data/mixture.py), instead of data.path: 'web=data/web:0.7,code=data/code:0.3'
      # (name=path:weight, or name@source=path:weight to name the source that reads it; in a config file also
      # {'web': ('data/web', 0.7), ...}); per-component metrics and evals
      mixture=ml_collections.FieldReference("", field_type=object),
      mixture_stages=ml_collections.FieldReference("", field_type=object),  # '1000:web=0.9,code=0.1;...': after
      # step 1000 those weights (every component named)
      mixture_ramp=False,  # True: weights move linearly from each stage to the next instead of at once
      **source_lib.groups(),  # data.<name>: the keys of each registered source that has its own
  ))


def eval_set_defaults() -> dict:
  """The ``eval`` group's key this package reads (the group itself is the core's, jaxtrain.config)."""
  # named eval data besides the training data's own eval split, each reported as eval_loss/<name>:
  # 'books=data/books,code=data/code_eval' (prepared folders: every split; raw files: every record)
  return dict(sets=ml_collections.FieldReference("", field_type=object))


def validate(config) -> None:
  check_positive(config, ["data.seq_len", "data.prefetch"])
  check_positive(config, ["data.num_workers"], allow_zero=True)
  _validate_eval_sets(config)
  _check_unread_groups(config)
  if mixture.components(config) or mixture.stages_given(config) or config.data.mixture_ramp:
    mixture.validate(config)
    return
  source = SOURCES.get(config.data.source)
  if config.data.path and not source.reads_path:
    raise ConfigError("data.path", f"is set but data.source='{config.data.source}' ignores it",
                      "set data.source=arrayrecord or clear data.path")
  source.validate(config)  # e.g. raw: files there, field in them, tokenizer fits: before anything compiles
  own, given = defaults(), config.data
  for key, readers in _readers().items():
    if key in source.reads or given[key] == own[key]:
      continue
    if config.eval.sets and any(key in SOURCES.get(n).documents.reads for n in readers if SOURCES.get(n).documents):
      continue  # (eval sets of that source read it)
    raise ConfigError(f"data.{key}", f"is set but only data.source={'|'.join(readers)} reads it (data.source="
                      f"'{config.data.source}')", f"set data.source={readers[0]} or leave data.{key} at {own[key]!r}")


def _readers() -> dict[str, list[str]]:
  """``key -> the sources that read data.<key>``, for the keys that some sources read and others do not."""
  out = {}
  for name, source in SOURCES.items():
    for key in source.reads:
      out.setdefault(key, []).append(name)
  return out


def _check_unread_groups(config) -> None:
  """A source's own keys (``data.<name>``) set while no part of the run reads that source: one ConfigError line."""
  used = {config.data.source} | {folders.source_of(comp.path, comp.source, f"data.mixture ({comp.name})")
                                 for comp in mixture.components(config)}
  for name, group in source_lib.groups().items():
    if name in used or name not in config.data:
      continue
    for key, default in group.items():
      if config.data[name][key] != default:
        raise ConfigError(f"data.{name}.{key}", f"is set but data.source='{config.data.source}' does not read it",
                          f"set data.source={name} (or mix it in: data.mixture='x@{name}=path:weight'), or "
                          f"leave it at {default!r}")


def _validate_eval_sets(config) -> None:
  sets = mixture.parse_named(config.eval.sets, "eval.sets", weighted=False)
  if not sets:
    return
  if not config.eval.every_steps:
    raise ConfigError("eval.sets", "is set but eval.every_steps=0 (eval never runs)", "set eval.every_steps=N")
  clash = set(mixture.names(config)) & {e.name for e in sets}
  if clash:
    raise ConfigError("eval.sets", f"'{sorted(clash)[0]}' is also a component of data.mixture (whose eval split "
                      "is reported under that name)", "give the eval set another name")
  for name, path, _, source in sets:
    folders.check(paths.resolve(path), config, f"eval.sets ({name})", source)


def resolve(config) -> None:
  """The data keys' canonical form (config.json's): mixtures and eval sets with absolute paths, in name order."""
  mixture.canonical(config)
  sets = mixture.parse_named(config.eval.sets, "eval.sets", weighted=False)
  if sets:
    mixture.replace(config.eval, "sets", mixture.format_named(sets, "eval.sets"))


def read_folders(config) -> list[str]:
  """Every data folder or file the config names (``data.path``, ``data.eval_path``, the components of
  ``data.mixture`` and ``eval.sets``), resolved, in that order: what a run's lineage fingerprints."""
  named = [e.path for e in mixture.parse_named(config.data.get("mixture", ""), "data.mixture", weighted=True)]
  named += [e.path for e in mixture.parse_named(config.eval.get("sets", ""), "eval.sets", weighted=False)]
  return list(dict.fromkeys(paths.resolve(p) for p in [config.data.path, config.data.eval_path, *named] if p))


def to_global(local_batch: dict, sharding: NamedSharding, config=None) -> dict:
  """This process's rows -> global arrays laid out with ``sharding`` (works on one host and on many).
  Host-side fields (``doc_ids``: provenance) stay behind; a mixture's ``sources`` go along. With ``config`` (the
  rows of its training stream), a token id outside [0, model.vocab_size) is refused first: a
  :class:`jaxtrain.data.ids.TokenIdError` naming the source, the document and the position."""
  if config is not None:
    ids.check(local_batch, config.model.vocab_size, functools.partial(_document, config, "train"))
  keys = KEYS + (("sources",) if "sources" in local_batch else ())
  return {k: jax.make_array_from_process_local_data(sharding, local_batch[k]) for k in keys}


def _document(config, split: str, doc: int | None) -> tuple[str, str]:
  """Document ``doc`` (a ``doc_ids`` value) of the training stream (``split="train"``) or of the eval batches
  (``"eval"``) of the configured source, named for errors: :data:`jaxtrain.data.ids.Where`."""
  source = _source(config)
  if source.document is not None:
    return source.document(config, split, doc)
  name = config.data.source
  return (f"data.source '{name}'" + (f" ({split})" if split == "eval" else "")
          + (f", document {doc}" if doc is not None else "")), f"fix data.source '{name}'"


def _held_out_document(folder: Folder, key: str, doc: int | None) -> tuple[str, str]:
  return mixture.in_folder(folder, key, folder.held_out, doc)


def _source(config) -> Source:
  """The configured source: ``data.source``'s, or the mixture's when ``data.mixture`` is set."""
  return mixture.MIXTURE if mixture.components(config) else SOURCES.get(config.data.source)


def open_train(config) -> Iterator[dict]:
  """The training stream of the configured source, validated before anything is compiled. Raises DataError /
  ConfigError on bad input."""
  return _source(config).open_train(config)


def open_eval(config) -> list[dict]:
  """This process's share of the held-out eval batches (``eval.max_batches`` of them; 0 = all)."""
  return _source(config).open_eval(config)[:config.eval.max_batches or None]


@dataclasses.dataclass
class EvalSet:
  """Held-out batches evaluated together: ``name`` None for the training data's own eval split (``eval_loss``),
  else reported as ``eval_loss/<name>``; ``in_total``: its tokens count in ``eval_loss`` (a mixture's
  components do; ``eval.sets`` do not)."""
  name: str | None
  batches: list[dict]
  in_total: bool


def eval_sets(config) -> list[EvalSet]:
  """Everything the evaluator runs: the training data's eval split (per component for a mixture), then
  ``eval.sets``. This process's rows; at most ``eval.max_batches`` batches each. Their token ids are checked here,
  once (:mod:`jaxtrain.data.ids`): a TokenIdError names the set, the document and the position."""
  if mixture.components(config):
    out = [(EvalSet(f.name, batches, True), functools.partial(_held_out_document, f, "data.mixture"))
           for f, batches in mixture.eval_splits(config)]
  else:
    out = [(EvalSet(None, open_eval(config), True), functools.partial(_document, config, "eval"))]
  named = mixture.parse_named(config.eval.sets, "eval.sets", weighted=False)
  opened = [folders.open_folder(e.name, paths.resolve(e.path), config, f"eval.sets ({e.name})", whole=True,
                                source=e.source) for e in named]
  for folder in opened:
    batches = mixture.eval_batches(folder, config, jax.process_index(), jax.process_count())
    out.append((EvalSet(folder.name, batches, False), functools.partial(_held_out_document, folder, "eval.sets")))
  for s, where in out:
    for batch in s.batches:
      ids.check(batch, config.model.vocab_size, where)
  return [s for s, _ in out if s.batches]


def provenance(config, step: int, doc_ids) -> dict:
  """Where the rows of ``step`` came from, for bad-batch reports."""
  return _source(config).provenance(config, step, doc_ids)


def tokenizer_of(config) -> str | None:
  """The tokenizer the configured data's tokens come from, for generation: ``data.tokenizer`` if set, else what
  the source says ('byte' or a tokenizer file; None: it cannot tell, or it is not registered here)."""
  if config.data.tokenizer:
    return config.data.tokenizer
  if mixture.components(config):
    return mixture.MIXTURE.tokenizer(config)
  name = config.data.source
  return SOURCES.get(name).tokenizer(config) if name in SOURCES else None


def close(iterator) -> None:
  """Stops a Grain iterator's threads and worker processes now (Grain's ``DatasetIterator.close``: its prefetch
  threads are told to stop and its worker processes end), not at interpreter shutdown, when they would be collected
  after their modules are gone. No ``gc.collect()`` after it: a full collection costs ~0.3 s in a fresh process and
  ~1 s in a process holding more (a test worker), at the end of every run, and the close leaves nothing that needs
  one (no error at exit, with or without worker processes, for prepared, raw and mixture data)."""
  if hasattr(iterator, "close"):
    iterator.close()
