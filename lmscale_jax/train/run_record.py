"""A run's record, ``workdir/config.json``: its one reader (:func:`load_record`, for the
resume and for the tools through ``lmscale_jax.inference.model_files``), what binds a run to
its dataset (:func:`dataset_identity`, :func:`check_tokenizer`) and what a resume may change in
it.

``config.json`` is the config of the latest run, with ``changes``: what each resume changed
that alters results, from which step (:func:`check_config_change`, the rules above
:data:`SHAPE_KEYS`). A resume with an incompatible model, optimizer state or (without
``--allow_config_change``) data stream or optimisation is refused. The rest of the workdir
(its lock, entries, ``run_state.json``): ``train/workdir.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from absl import logging

from lmscale_jax.config import checks as config_checks
from lmscale_jax.config import legacy
from lmscale_jax.store import dataset, file_io
from lmscale_jax.store import tokenizer as toklib
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.train.checkpoint import IncompatibleCheckpoint, step_dir
from lmscale_jax.train.workdir import RUN_CONFIG, WorkdirError

# What a resume may change, one list per rule (config.json against this run's config; keys as
# "section.key"): the parameter shapes (SHAPE_KEYS, of the resolved model) and the layout of
# the optimizer state (STATE_KEYS) never; what changes the data stream or the optimisation
# (RESULT_KEYS) only with --allow_config_change, recorded in config.json's "changes";
# train.steps (how a finished run is extended) always, recorded too; NEUTRAL_KEYS (logging,
# checkpointing, the loader's speed, paths, memory levers) silently. A key in no list counts as
# a RESULT_KEY, so a new key is never resumed over silently before someone classifies it.
SHAPE_KEYS = ("layers", "hidden", "heads", "ffn", "vocab_size", "seq_len", "type_vocab_size",
              "norm", "positions")
STATE_KEYS = ("train.nonfinite",)  # skip mode wraps the optimizer state (optax.apply_if_finite)
RESULT_KEYS = (
    "train.batch_size", "train.learning_rate", "train.warmup_steps", "train.schedule",
    "train.end_lr_frac", "train.weight_decay", "train.b1", "train.b2", "train.eps",
    "train.clip_norm", "train.seed", "train.grad_accum_steps", "train.grad_allreduce_dtype",
    "train.dropout_rng", "train.inject_nonfinite_steps", "train.warmup_fraction",
    "data.seed", "data.mask_prob", "data.max_predictions", "data.shard_by_process",
    "data.on_corrupt", "model.dropout", "model.attention_dropout", "model.dtype",
    "model.layer_norm_eps", "model.packed_attention")
EXTEND_KEYS = ("train.steps",)
NEUTRAL_KEYS = (
    "train.log_every", "train.eval_every", "train.eval_batches", "train.remat", "train.fsdp",
    "train.memory_check",
    "finetune.eval_labels",  # what the held-out scores are measured on, not what is trained
    "train.grad_allreduce",
    "train.max_consecutive_nonfinite", "checkpoint", "metrics", "distributed", "data.path",
    "data.workers", "data.prefetch_buffer", "data.read_threads", "data.stage_from",
    "data.stage_workers", "data.stage_timeout", "data.autotune", "data.autotune_max_workers",
    "data.autotune_target", "model.initializer_range", "model.attention_impl",
    "init_from",  # the weights of step 0 only: a resume restores its checkpoint instead
    *(f"model.{k}" for k in SHAPE_KEYS))  # shapes: compared on the resolved model instead
# Keys added after workdirs already existed (config/legacy.py): such a workdir resumes under the
# legacy value as unchanged (and under another as a change of the key's rule), instead of
# failing on "None -> value".
LEGACY_VALUES = legacy.VALUES


def resume_rule(key: str) -> str:
  """``"state"``, ``"result"``, ``"extend"`` or ``"neutral"``: what a resume does when ``key``
  ("section.key") differs from the workdir's config.json (see the lists above)."""
  for rule, keys in (("state", STATE_KEYS), ("extend", EXTEND_KEYS),
                     ("neutral", NEUTRAL_KEYS), ("result", RESULT_KEYS)):
    if any(key == k or key.startswith(f"{k}.") for k in keys):
      return rule
  return "result"


def _resolved(config, model_cfg, data: dict | None) -> dict:
  out = {"config": json.loads(config.to_json_best_effort()),
         "model": {k: model_cfg[k] for k in SHAPE_KEYS}}
  return out if data is None else {**out, "dataset": data}


def dataset_identity(meta: dataset.DatasetMeta) -> dict:
  """What binds a run to its dataset (config.json's ``"dataset"``, checked on every resume and
  by the tools that score a run on a dataset): its tokenizer, a digest of ``tokenizer.json``
  (``toklib.digest``: two datasets of one vocabulary size tokenized differently mean other
  tokens by the same ids); its content, a digest of the shards' sha256 in metadata.json (a
  staged copy is the same dataset, another corpus is not); and its absolute path (data.path as
  typed may be relative to another directory)."""
  shards = {split: [s.get("sha256") for s in info["shards"]]
            for split, info in meta.splits.items()}
  content = hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()
  tokenizer = os.path.join(meta.path, dataset.TOKENIZER)
  return {"path": os.path.abspath(meta.path), "content_sha256": content,
          # None: a dataset without its tokenizer (nothing to bind; not made by prepare_*.py)
          "tokenizer_sha256": toklib.digest(tokenizer) if os.path.exists(tokenizer) else None}


def check_tokenizer(record: dict, tokenizer_sha256: str, where: str, workdir: str) -> None:
  """Refuses a dataset (or tokenizer) ``where`` whose tokenizer is not the one the run of
  ``workdir`` was trained with (its record's ``"dataset"``; a record from before runs were
  bound to their dataset has none and is not checked)."""
  trained = (record.get("dataset") or {}).get("tokenizer_sha256")
  if trained is None or tokenizer_sha256 is None or trained == tokenizer_sha256:
    return
  raise IncompatibleCheckpoint(
      f"{where} has another tokenizer than the run in {workdir} was trained with "
      f"(tokenizer.json sha256 {tokenizer_sha256[:12]}…, the run's {trained[:12]}…, from "
      f"{record['dataset'].get('path')}): its token ids would mean other tokens. Give the "
      "run's dataset (or a copy of it), or a new --workdir")


@dataclasses.dataclass
class ConfigCheck:
  """What :func:`check_config_change` found: the run's record (None: a new workdir), the
  changes to record, and whether the record came from the checkpoint (config.json missing or
  unreadable: :func:`save_config` writes it again)."""
  old: dict | None
  changes: list
  restored: bool = False


# config.json's "model": the resolved shape keys every reader of a run relies on.
_SHAPE_INTS = ("vocab_size", "seq_len", "layers", "hidden", "heads", "ffn")
_RECORD = ("a training run's config ({\"config\": …, \"model\": …}, as lmscale train "
           "writes it)")


def load_record(path: str) -> dict:
  """``config.json`` at ``path`` as :func:`save_config` writes it, checked: the one reader of
  it (the resume rules here; the tools through ``lmscale_jax.inference.model_files``). A
  missing, unreadable or damaged file is a :class:`RunRecordError`: one line naming it and
  what was expected there (a FIFO would block the reader: refused unopened)."""
  if not os.path.lexists(path):
    raise RunRecordError(f"{path}: no such file: expected {_RECORD}", "missing")
  if kind := file_io.not_regular(path):
    raise RunRecordError(f"{path} is {kind}: expected {_RECORD}", kind)
  try:
    with open(path) as f:
      record = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
    raise RunRecordError(f"{path}: not valid JSON ({e}; cut short?): expected {_RECORD}",
                         f"not readable JSON ({e})") from None
  except OSError as e:
    raise RunRecordError(f"{path}: cannot read it ({e.strerror or e}): expected {_RECORD}",
                         f"unreadable ({e.strerror or e})") from None
  _check_record(path, record)
  return legacy.complete_record(record)  # a record from before a key existed, in today's keys


def json_kind(value) -> str:
  """What a JSON value is, in words ("an array"), for the lines naming a wrong one."""
  return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
          type(None): "null"}.get(type(value), "a number")


def _check_record(path: str, record) -> None:
  """{"config": {…, "model", "data", "train"}, "model": {the resolved shape keys}}."""
  def bad(line: str, why: str):
    return RunRecordError(line, f"not a run's config ({why})")

  if not isinstance(record, dict):
    raise bad(f"{path}: {json_kind(record)}, expected {_RECORD}", json_kind(record))
  if not {"config", "model"} <= set(record):
    hint = " (a Hugging Face model directory: give it as --hf DIR)" if "model_type" in record \
        else ""
    raise bad(f"{path} is not a training run's config (no 'config' and 'model' entries){hint}",
              "expected 'config' and 'model' entries")
  sections = {"config": record["config"], "model": record["model"]}
  if isinstance(record["config"], dict):
    sections.update({f"config.{k}": record["config"].get(k) for k in ("model", "data", "train")})
  for key, value in sections.items():
    if not isinstance(value, dict):
      raise bad(f"{path}: {key!r} is {json_kind(value)}, expected an object",
                f"{key!r} is {json_kind(value)}")
  for key in _SHAPE_INTS:
    value = record["model"].get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise bad(f"{path}: model.{key} is {value!r}, expected a positive integer (the run's "
                "resolved model shape)", f"model.{key} is {value!r}")


def _read_record(path: str) -> tuple[dict | None, str | None]:
  """``(config.json's record, None)`` or ``(None, what is wrong with it)``."""
  try:
    return load_record(path), None
  except RunRecordError as e:
    return None, e.problem


def recorded_positions(workdir: str) -> str | None:
  """The ``model.positions`` the run in ``workdir`` was built with (what ``"auto"`` keeps on
  a resume): config.json's, else the copy in its latest checkpoint (config.json lost or
  damaged: :func:`read_record` restores it); None for a new workdir, or where neither is
  readable (the resume's checks say so, in one line)."""
  record, _ = _read_record(os.path.join(workdir, RUN_CONFIG))
  if record is None and os.path.isdir(ckpt_lib.checkpoints_dir(workdir)):
    step = ckpt_lib.latest_complete_step(workdir)
    saved = None if step is None else ckpt_lib.saved_record(workdir, step)
    record = legacy.complete_record(saved) if saved else None
  return record["model"]["positions"] if record else None


def read_record(workdir: str, resume_step: int | None) -> tuple[dict | None, bool]:
  """The run's record, ``(record, restored)``: ``workdir/config.json``, or where it is
  missing or damaged the copy saved in the checkpoint a run resumes from (``restored``; every
  checkpoint holds one: ``Checkpointer.save``). ``(None, False)``: a new workdir. One line
  where the resume rules cannot be checked: checkpoints without a readable record anywhere."""
  path = os.path.join(workdir, RUN_CONFIG)
  record, problem = _read_record(path)
  if record is not None:
    return record, False
  saved = None if resume_step is None else ckpt_lib.saved_record(workdir, resume_step)
  if saved is not None:
    logging.warning("%s is %s; the run's config is the copy kept in checkpoint %s (written "
                    "back to %s when this run starts)", path, problem,
                    step_dir(workdir, resume_step), RUN_CONFIG)
    return legacy.complete_record(saved), True
  if problem == "missing" and resume_step is None:
    return None, False
  if resume_step is None:
    raise WorkdirError(f"{path} is {problem}, and no checkpoint holds a copy: remove it to "
                       "start this workdir afresh, or give another --workdir")
  raise IncompatibleCheckpoint(
      f"{workdir} holds checkpoint {resume_step} but its {RUN_CONFIG} is {problem}, and the "
      "checkpoint predates the copy of the config each checkpoint keeps: what a resume may "
      f"change cannot be checked. Put {RUN_CONFIG} back from a copy, or give a new --workdir")


def check_config_change(workdir: str, config, model_cfg, run: tuple[dict | None, bool], *,
                        resume_step: int | None, allow_change: bool = False,
                        data: dict | None = None) -> ConfigCheck:
  """Compares the run's record (``run``: :func:`read_record`'s answer) with this run's config
  (the rules above SHAPE_KEYS) and dataset (``data``: :func:`dataset_identity`, None for a run
  without one).

  Returns the record and the changes to record in config.json: one ``{"step", "key",
  "from", "to"}`` per result or extend key that differs (``"dataset"`` for another dataset of
  the same tokenizer), ``step`` being the first step trained with the new value. Raises
  :class:`IncompatibleCheckpoint` (one line: the key, both values and the fix) for a change a
  resume cannot take. Only reads, so every process can call it before anything is written.
  """
  old, restored = run
  if old is None:
    return ConfigCheck(None, [])
  new = _resolved(config, model_cfg, data)
  diff = {k: (old["model"].get(k), new["model"][k]) for k in SHAPE_KEYS
          if old["model"].get(k) != new["model"][k]}
  if diff:
    desc = ", ".join(f"model.{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
    raise IncompatibleCheckpoint(
        f"{workdir} holds a run of a different model ({desc}); use a new --workdir or the "
        "original config")
  if resume_step is None:  # no checkpoint yet: nothing saved would be reinterpreted
    return ConfigCheck(old, [], restored)
  before = config_checks.flat_keys(old.get("config", {}))
  now = config_checks.flat_keys(new["config"])
  before = {**{k: v for k, v in LEGACY_VALUES.items() if k in now}, **before}
  changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
  by_rule = {k: resume_rule(k) for k in changed}
  state = [k for k in changed if by_rule[k] == "state"]
  if state:
    raise IncompatibleCheckpoint(_change_message(
        workdir, resume_step, state, before, now,
        "it changes the layout of the saved optimizer state: use the original value or a new "
        "--workdir"))
  result = [k for k in changed if by_rule[k] == "result"]
  if result and not allow_change:
    raise IncompatibleCheckpoint(_change_message(
        workdir, resume_step, result, before, now, _RESULT_FIX))
  changes = [{"step": resume_step + 1, "key": k, "from": before.get(k), "to": now.get(k)}
             for k in changed if by_rule[k] in ("result", "extend")]
  return ConfigCheck(old, changes + _dataset_change(workdir, old, data, resume_step,
                                                    allow_change), restored)


_RESULT_FIX = ("it changes the data stream or the optimisation of the saved run: use the "
               "original value, a new --workdir, or --allow_config_change to continue with the "
               "change (recorded in config.json)")


def _dataset_change(workdir: str, old: dict, data: dict | None, resume_step: int,
                    allow_change: bool) -> list[dict]:
  """Another tokenizer: refused (no flag makes the ids mean the same tokens). Other content,
  same tokenizer (another corpus, continued pretraining): a result change. Another path to the
  same content (a staged copy, another working directory): nothing."""
  before = old.get("dataset")
  if data is None or before is None:  # a record older than the binding: recorded from now on
    return []
  check_tokenizer(old, data["tokenizer_sha256"], f"data.path {data['path']}", workdir)
  if before.get("content_sha256") == data["content_sha256"]:
    return []
  if not allow_change:
    raise IncompatibleCheckpoint(
        f"{workdir}: its checkpoint at step {resume_step} was trained on the dataset "
        f"{before.get('path')}, data.path {data['path']} holds other data (its shards' "
        "sha256 differ; the tokenizer is the same): give that dataset (or a copy of it), a new "
        "--workdir, or --allow_config_change to continue on this one (recorded in "
        "config.json)")
  return [{"step": resume_step + 1, "key": "dataset",
           "from": {k: before.get(k) for k in ("path", "content_sha256")},
           "to": {k: data[k] for k in ("path", "content_sha256")}}]


def _change_message(workdir, step, keys, before, now, why) -> str:
  key = keys[0]
  more = f" (and {', '.join(keys[1:])})" if len(keys) > 1 else ""
  return (f"{workdir}: its checkpoint at step {step} was trained with {key}="
          f"{before.get(key)!r}, this run has {key}={now.get(key)!r}{more}; {why}")


def save_config(workdir: str, config, model_cfg, check: ConfigCheck, is_writer: bool,
                data: dict | None = None) -> dict:
  """The run's record from now on: this run's config and dataset, with the earlier runs'
  ``changes`` plus ``check.changes``; written to ``workdir/config.json`` (process 0) unless it
  is there already as it is. Each checkpoint keeps a copy of it (``Checkpointer``)."""
  record = _resolved(config, model_cfg, data)
  changes = (check.old or {}).get("changes", []) + check.changes
  if changes:
    record["changes"] = changes
  unchanged = check.old is not None and not check.restored and check.old == record
  if is_writer and not unchanged:
    os.makedirs(workdir, exist_ok=True)
    file_io.atomic_write_json(os.path.join(workdir, RUN_CONFIG), record)
  return record


class RunRecordError(WorkdirError):
  """``config.json`` is missing or not a run's record (:func:`load_record`): ``str()`` is the
  one line naming it; ``problem`` the phrase the resume rules' own lines use ("missing",
  "not readable JSON (…)")."""

  def __init__(self, line: str, problem: str):
    super().__init__(line)
    self.problem = problem
