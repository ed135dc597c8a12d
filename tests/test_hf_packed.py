"""model.packed_attention="segment" against transformers: a function packed with others gets
the logits the exported BertForMaskedLM computes for it alone (runs in .venv-hf, like the
other tests/test_hf_*.py)."""

from __future__ import annotations

import numpy as np

from lmscale_jax.model import hf_convert
from tests.hf_helpers import hf_side
from tests.test_packed_attention import (SEQ, functions_alone, logits_all, model_cfg, pack,
                                         params, random_functions)

__all__ = ["params"]  # the module fixture of tests/test_packed_attention.py, shared


def test_packed_function_logits_equal_the_exported_model_on_it_alone(params, tmp_path):
  cfg = model_cfg("segment")
  rows = pack(random_functions(np.random.default_rng(5), 30))[:6]
  ours = logits_all(cfg, params, rows)
  alone, where = functions_alone(rows, np.int64)
  assert len(where) > len(rows)
  out = tmp_path / "hf"
  out.mkdir()
  hf_convert.save_model(params, cfg, str(out))
  positions = np.broadcast_to(np.arange(SEQ), (len(alone), SEQ))
  theirs, = hf_side(tmp_path, [{"op": "logits", "dir": str(out), "ids": np.stack(alone).tolist(),
                                "positions": positions.tolist()}])
  theirs = np.asarray(theirs["logits"])
  diff = max(np.abs(ours[r, s:e] - theirs[i, :e - s]).max() for i, (r, s, e) in enumerate(where))
  assert diff < 1e-4, diff  # float32 torch vs XLA, as tests/test_hf_convert.py

