"""Orbax checkpoints of the train state together with the Grain iterator, plus the saved config.

``workdir/checkpoints/<step>/`` holds ``state`` (Orbax PyTree) and ``data`` (Grain's per-process
iterator JSON); Orbax writes each step under a temporary name and renames it when complete, so
an interrupted save is never taken for a checkpoint. ``workdir/config.json`` is the config of the
run that created the workdir; a resume with an incompatible model is refused.
"""

from __future__ import annotations

import json
import os

import grain
import orbax.checkpoint as ocp

from lmscale_jax import dataset

# Keys that change the parameter shapes or the meaning of the data: a checkpoint cannot be
# resumed under a config that differs in any of them.
SHAPE_KEYS = ("layers", "hidden", "heads", "ffn", "vocab_size", "seq_len", "type_vocab_size",
              "pre_ln")


class IncompatibleCheckpoint(ValueError):
  pass


def check_or_save_config(workdir: str, config, model_cfg, is_writer: bool) -> None:
  """First run: writes ``config.json``. Later runs: refuses a different model shape."""
  path = os.path.join(workdir, "config.json")
  resolved = {"config": json.loads(config.to_json_best_effort()),
              "model": {k: model_cfg[k] for k in SHAPE_KEYS}}
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)["model"]
    diff = {k: (old.get(k), resolved["model"][k]) for k in SHAPE_KEYS
            if old.get(k) != resolved["model"][k]}
    if diff:
      desc = ", ".join(f"model.{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
      raise IncompatibleCheckpoint(
          f"{workdir} holds a run of a different model ({desc}); use a new --workdir or the "
          "original config")
    return
  if is_writer:
    os.makedirs(workdir, exist_ok=True)
    dataset.atomic_write_json(path, resolved)


RUN_STATE = "run_state.json"


def write_run_state(workdir: str, state: str, step: int, total_steps: int) -> None:
  """``workdir/run_state.json``: how the last run ended ("finished" or "preempted"), so a job
  script can requeue itself (launch/slurm.sbatch) without parsing logs."""
  dataset.atomic_write_json(os.path.join(workdir, RUN_STATE),
                       {"state": state, "step": int(step), "total_steps": int(total_steps),
                        "checkpoint": os.path.join(os.path.abspath(workdir), "checkpoints",
                                                   str(step))})


class Checkpointer:

  def __init__(self, workdir: str, *, keep: int, use_async: bool = True):
    self.manager = ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), "checkpoints"),
        item_names=("state", "data"),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=use_async,
            cleanup_tmp_directories=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_iterator: grain.DatasetIterator) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iterator)), force=True)

  def restore(self, step: int, abstract_state, data_iterator: grain.DatasetIterator):
    """Returns the restored state (sharded like ``abstract_state``); restores the iterator."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(data_iterator)))
    return out["state"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
