"""Imported once by the process that tests/forked.py forks its runs from (its PRELOAD): tensorboardX, imported the
way jaxtrain.metrics imports it (without torch). Its record writer imports boto3 and Google Cloud Storage, for
TensorBoard files on a store: ~0.2 CPU-seconds (640 modules) that every forked training run would otherwise pay
again. Then everything imported is frozen out of the garbage collector's sight (the last of PRELOAD), as
jaxtrain.main does for itself: the forks' collections do not walk (and copy) the inherited objects; and their full
collections are made rare (tests/collector.py), which the forks inherit."""

from jaxtrain import metrics
from tests import collector

metrics._summary_writer_class()  # noqa: SLF001 - the module's own way to import tensorboardX
collector.freeze()
