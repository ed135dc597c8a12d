"""Whose checkpoint it is: a checkpoint is restored only by the run that wrote it.

Every checkpoint keeps the run's record (``config.json`` as it was when the step was saved:
``checkpoint.saved_record``), which names the model's shape, the task and the dataset (its
tokenizer's and its content's digests: ``workdir.dataset_identity``). A checkpoint copied in
from another run (another dataset, tokenizer or model) would otherwise be resumed or scored
silently: every check compares the command line with ``config.json``, not with the checkpoint.
:func:`check_checkpoint_run` is the one check, before any array is read, of every restore: a
training resume (``run_loop``) and the tools that load a run's model
(``inference.model_files.restore_params``: evaluate, fill-mask, embed, export-hf, finetune from
a run). It reads one small JSON file of the checkpoint.
"""

from __future__ import annotations

from lmscale_jax.config import legacy
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.train import run_record
from lmscale_jax.train import workdir as workdir_lib
from lmscale_jax.train.checkpoint import IncompatibleCheckpoint


def check_checkpoint_run(workdir: str, step: int, record: dict) -> None:
  """Refuses checkpoint ``step`` of ``workdir`` where its own record says another run wrote it
  than the one ``record`` (the run's config.json) describes: another model shape or task,
  another tokenizer, or a dataset the run never trained on; one line naming the checkpoint,
  the run, what differs and the fix. A checkpoint from before each kept a record has none:
  not checked (it loads as before)."""
  saved = ckpt_lib.saved_record(workdir, step)
  differs = [] if saved is None else _other_run(record, legacy.complete_record(saved))
  if differs:
    raise IncompatibleCheckpoint(
        f"{ckpt_lib.step_dir(workdir, step)} is a checkpoint of another run than {workdir} "
        f"(its {workdir_lib.RUN_CONFIG}): {'; '.join(differs)}. Move it out of "
        f"{ckpt_lib.checkpoints_dir(workdir)} (or give the --workdir it belongs to)")


def _other_run(record: dict, saved: dict) -> list[str]:
  """What in a checkpoint's record ``saved`` differs from the run's ``record``, each as
  "what: the checkpoint's, the run's". A run's model and tokenizer never change; its dataset's
  content may (--allow_config_change, recorded in its "changes"): any content the run trained
  on is its own."""
  out = [f"model.{k}: {saved['model'].get(k)!r}, the run's {record['model'].get(k)!r}"
         for k in run_record.SHAPE_KEYS if saved["model"].get(k) != record["model"].get(k)]
  if _task(saved) != _task(record):
    out.append(f"task: {_task(saved)}, the run's {_task(record)}")
  theirs, mine = (r.get("dataset") if isinstance(r.get("dataset"), dict) else {}
                  for r in (saved, record))
  a, b = theirs.get("tokenizer_sha256"), mine.get("tokenizer_sha256")
  if a and b and a != b:
    out.append(f"tokenizer.json sha256: {a[:12]}…, the run's {b[:12]}…")
  content = theirs.get("content_sha256")
  if content and mine.get("content_sha256") and content not in _contents(record):
    out.append(f"dataset: {theirs.get('path')} (content sha256 {content[:12]}…), the run's "
               f"{mine.get('path')}")
  return out


def _task(record: dict) -> str:
  """What the run trains: a fine-tune's config has a ``finetune`` section (config.legacy
  completes its ``task``), pretraining's none."""
  finetune = record["config"].get("finetune")
  return f"{finetune.get('task')} fine-tuning" if isinstance(finetune, dict) else "pretraining"


def _contents(record: dict) -> set:
  """The content digests of every dataset the run trained on: config.json's, and those its
  recorded dataset changes name (``run_record._dataset_change``)."""
  changes = [c for c in record.get("changes") or []
              if isinstance(c, dict) and c.get("key") == "dataset"]
  return {_content(record.get("dataset")),
          *(_content(c.get(end)) for c in changes for end in ("from", "to"))}


def _content(dataset) -> str | None:
  return dataset.get("content_sha256") if isinstance(dataset, dict) else None
