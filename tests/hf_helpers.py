"""Running tests/hf_side.py in the HF virtual environment (tools/test.sh makes .venv-hf)."""

from __future__ import annotations

import json
import os
import subprocess

from tests.helpers import ROOT


def hf_python() -> str:
  python = os.environ.get("LMSCALE_HF_PYTHON") or os.path.join(ROOT, ".venv-hf", "bin", "python")
  assert os.path.exists(python), (
      f"{python}: no HF virtual environment; run the tests with bash tools/test.sh, which "
      "makes .venv-hf (torch + transformers) once")
  return python


def hf_side(tmp_path, jobs: list[dict], timeout: float = 120) -> list:
  """Runs the jobs in one transformers process; returns their results."""
  req, resp = tmp_path / "hf_request.json", tmp_path / "hf_response.json"
  req.write_text(json.dumps(jobs))
  # HF_MODULES_CACHE: where transformers copies a remote-code export's .py files to import
  # them (by default under ~/.cache, shared by every test run).
  env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
             TOKENIZERS_PARALLELISM="false", HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
  out = subprocess.run([hf_python(), os.path.join(ROOT, "tests", "hf_side.py"), str(req),
                        str(resp)], capture_output=True, text=True, timeout=timeout, env=env)
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(resp.read_text())
