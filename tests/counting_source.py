"""An example data source added from outside the package (docs/extending.md, "Adding a data source"): documents that
count, ``(d + k * stride) mod vocab`` for document d, ``length`` tokens each. Everything it is lives here: its keys
(``data.counting_test.length``, ``.stride``, ``.documents``, ``.held_out``) and their checks, its train stream (the
package's packed lanes, so its position is checkpointed), its eval split, its tokenizer, its provenance, and its
documents by id, so that a mixture can take it as a component (``nums@counting_test=any:0.5``) and ``eval.sets``
as an eval set. Importing this module registers it."""

import grain
import jax
import numpy as np

from jaxtrain import data as data_lib
from jaxtrain.data import loader
from jaxtrain.errors import ConfigError

NAME = "counting_test"


def defaults() -> dict:
  return dict(
      length=24,  # tokens per document
      stride=1,  # between consecutive tokens of a document
      documents=4096,  # training documents
      held_out=64,  # eval documents (after the training ones)
  )


def validate(c) -> None:
  o = data_lib.options(c, NAME)
  if o.length < 2:
    raise ConfigError(f"data.{NAME}.length", f"{o.length} tokens make no next-token prediction", "set it to 2 or more")
  if not 1 <= o.stride < c.model.vocab_size:
    raise ConfigError(f"data.{NAME}.stride", f"{o.stride} is not in [1, model.vocab_size)", "set e.g. 1")
  if o.documents < c.train.global_batch_size:
    raise ConfigError(f"data.{NAME}.documents", f"{o.documents} is fewer than the {c.train.global_batch_size} rows "
                      "of a batch", "raise it")


class Counting:
  """Documents ``first .. first + size - 1``: document i -> its int32 tokens."""

  def __init__(self, c, first: int, size: int):
    o = data_lib.options(c, NAME)
    self.first, self.size, self.length, self.stride, self.vocab = first, size, o.length, o.stride, c.model.vocab_size

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, i: int) -> np.ndarray:
    return ((self.first + int(i) + self.stride * np.arange(self.length)) % self.vocab).astype(np.int32)

  def where(self, i: int) -> str:
    return f"counting document {self.first + int(i)}"


def open_folder(name: str, path: str, c, key: str, whole: bool = False, verify: bool = True) -> data_lib.Folder:
  """The documents (``path`` is not read: the keys say what they are)."""
  del key, verify
  o = data_lib.options(c, NAME)
  train = None if whole else Counting(c, 0, o.documents)
  held_out = Counting(c, o.documents, o.held_out) if o.held_out else None
  docs = len(train) if train is not None else 0
  return data_lib.Folder(name, path, NAME, "byte", False, train, docs, held_out, len(held_out or ()),
                         order=lambda c, lanes: grain.MapDataset.range(docs).repeat(None),
                         locate=lambda d: f"counting document {d}", fix=f"lower data.{NAME}.stride")


def open_train(c):
  folder = open_folder(NAME, "", c, f"data.{NAME}")
  b, index, count = c.train.global_batch_size, jax.process_index(), jax.process_count()
  dataset = loader.lanes_dataset(folder.order(c, b), folder.train, seq_len=c.data.seq_len, global_batch=b,
                                 process_index=index, process_count=count, packing=c.data.packing)
  return loader.TrainIterator(dataset, b, index, count)  # a DataPosition: checkpoints hold where it is


def open_eval(c) -> list[dict]:
  folder = open_folder(NAME, "", c, f"data.{NAME}")
  return loader.packed_eval_batches(folder.held_out, folder.held_out_docs, seq_len=c.data.seq_len,
                                    global_batch=c.train.global_batch_size, process_index=jax.process_index(),
                                    process_count=jax.process_count(), max_batches=c.eval.max_batches)


def provenance(c, step: int, doc_ids) -> dict:
  del c, step
  return {"source": NAME, "documents": sorted({int(d) for d in np.unique(doc_ids) if d >= 0})}


SOURCE = data_lib.Source(
    open_train, open_eval, provenance, reads_path=False, defaults=defaults, validate=validate,
    tokenizer=lambda c: "byte",
    documents=data_lib.Documents(open=open_folder, check=lambda path, c, key: validate(c),
                                 has_held_out=lambda path, c: data_lib.options(c, NAME).held_out > 0,
                                 tokenizer=lambda path, c: "byte"))
data_lib.SOURCES.register(NAME, SOURCE)
