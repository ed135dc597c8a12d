"""A trained model's identity: what an index records of the model that built it and compares
with the model a search is given (``search/index``, ``lmscale serve``). A run's workdir, its
checkpoint step and the sha256 of that checkpoint's manifests (the manifests hold every array
file's digest: one hash covers the whole checkpoint without reading gigabytes); an HF
directory's path and its model.safetensors sha256. It reads the checkpoint format of ``train/``
(``checkpoint``, ``checkpoint_manifest``), as loading the model does.
"""

from __future__ import annotations

import hashlib
import os

from lmscale_jax.store import file_io
from lmscale_jax.train import checkpoint, checkpoint_manifest

# What makes two identities the same model (the workdir's path may move with it).
SAME = ("kind", "step", "sha256")


def identity(model) -> dict:
  """The identity of a loaded model (``inference/trained_model``'s: ``source`` and ``step``,
  None for an HF directory), as index.json keeps it."""
  if model.step is None:  # an HF directory
    path = os.path.join(model.source, "model.safetensors")
    return {"kind": "hf", "hf": os.path.abspath(model.source),
            "sha256": file_io.sha256_file(path)}
  step_dir = checkpoint.step_dir(model.source, model.step)
  h = hashlib.sha256()
  for process, count in sorted(checkpoint_manifest.parts_present(step_dir).items()):
    with open(os.path.join(step_dir, checkpoint_manifest.part_name(process, count)), "rb") as f:
      h.update(f.read())
  return {"kind": "workdir", "workdir": os.path.abspath(model.source), "step": model.step,
          "sha256": h.hexdigest()}


def same(a: dict, b: dict) -> bool:
  """Whether two identities name one model (wherever its workdir now is)."""
  return all(a.get(k) == b.get(k) for k in SAME)


def describe(ident: dict) -> str:
  """One line's worth: where, which step, the start of the sha256."""
  where = ident.get("workdir") or ident.get("hf") or "?"
  step = f" step {ident['step']}" if ident.get("step") is not None else ""
  return f"{where}{step} (sha256 {str(ident.get('sha256'))[:12]})"
