"""Loop hooks from outside jaxtrain/: a hook named by import path in a config file (tests/hook_example.py) is called
at its cadence with the step's metrics and adds its own to the log records; a bad path is one line."""

import json

import pytest

from jaxtrain import config as config_lib
from jaxtrain.metrics import read_records
from jaxtrain.train import trainer
from tests import forked

CONFIG_FILE = '''from tests.conftest import small_config


def get_config():
  c = small_config("runs/with_hook", fsdp=8)
  c.train.update(steps=7, log_every=2, hooks=("tests.hook_example:loss_log",))
  return c
'''


def test_a_hook_named_in_a_config_file_is_called_at_its_cadence_with_the_steps_metrics(tmp_path):
  config_file = tmp_path / "with_hook.py"
  config_file.write_text(CONFIG_FILE)
  config = config_lib.load_file(str(config_file), [f"workdir={tmp_path / 'run'}"])
  _, history = trainer.train(config)
  seen = [json.loads(line) for line in (tmp_path / "run" / "loss_log.jsonl").read_text().splitlines()]
  losses = {r["step"]: r["loss"] for r in history}  # the logged steps: 2, 4, 6, 7
  assert [s["step"] for s in seen] == [3, 6, 7]  # every 3 steps and the last
  assert [s["logged"] for s in seen] == [False, True, True]
  assert [s["loss"] for s in seen[1:]] == [losses[6], losses[7]] and seen[0]["loss"] > 0
  # What it adds to each record: the lines written before that step's hooks ran (3's by step 4, 6's by step 7).
  assert [(r["step"], r["loss_log/lines"]) for r in read_records(tmp_path / "run") if "loss" in r] == [
      (2, 0), (4, 1), (6, 1), (7, 2)]


@pytest.mark.parametrize("path, why", [
    ("tests.hook_example:nope", "'tests.hook_example:nope': module tests.hook_example has no nope"),
    ("nowhere_at_all:factory", "'nowhere_at_all:factory': module nowhere_at_all cannot be imported "
                               "(ModuleNotFoundError: No module named 'nowhere_at_all')"),
    ("tests.hook_example", "'tests.hook_example' is not 'module.path:factory'"),
])
def test_a_bad_hook_path_is_one_line_naming_it(tmp_path, path, why):
  c = config_lib.base_config()
  c.train.hooks = (path,)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate_values(c)
  assert str(e.value).startswith(f"train.hooks: {why}")


def test_a_bad_hook_path_on_the_command_line_exits_2_with_one_line(tmp_path):
  r = forked.run(["-m", "jaxtrain.main", "--config=configs/tiny.py", f"--config.workdir={tmp_path}",
                  "--config.train.hooks=('tests.hook_example:nope',)"])
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1].startswith(
      "jaxtrain: error: train.hooks: 'tests.hook_example:nope': module tests.hook_example has no nope")
