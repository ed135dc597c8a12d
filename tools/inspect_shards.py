"""Summarise, verify or decode a prepared dataset directory.

  python tools/inspect_shards.py DIR [--verify] [--show N]
"""

from __future__ import annotations

import json
import os
import sys

import _cli
import numpy as np

from lmscale_jax.store import dataset


def _show_sources(meta) -> tuple:
  """The tokenizer and the train shards --show reads, each checked first: a missing file or an
  empty split is one line naming it, not a traceback from deep in a reader."""
  from tokenizers import Tokenizer

  tpath = os.path.join(meta.path, dataset.TOKENIZER)
  if not os.path.isfile(tpath):
    raise dataset.DatasetError(f"{tpath}: missing; --show decodes with the dataset's tokenizer")
  try:
    tok = Tokenizer.from_file(tpath)
  except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
    raise dataset.DatasetError(f"{tpath}: not a Hugging Face tokenizer.json ({e})") from None
  shards = meta.splits.get("train", {}).get("shards", [])
  meta.shard_paths("train")  # zero shards: its own clear error
  for shard in shards:
    if problem := meta.shard_problem(shard, checksums=False):
      raise dataset.DatasetError(f"{problem} (inspect_shards --verify checks every shard)")
  usable = [s for s in shards if s["records"] > 0]
  if not usable:
    raise dataset.DatasetError(f"{meta.path}: the train split has no records to show")
  return tok, [os.path.join(meta.path, s["file"]) for s in usable]


def main(argv=None) -> int:
  p = _cli.Parser(description=__doc__.splitlines()[0])
  p.add_argument("dir")
  p.add_argument("--verify", action="store_true", help="re-check record counts and sha256")
  p.add_argument("--show", type=_cli.number(int, 0, 1 << 20), default=0, metavar="N",
                 help="decode N random sequences back to pretokens/text")
  p.add_argument("--seed", type=_cli.number(int, 0, 1 << 62), default=0)
  a = p.parse_args(argv)
  return _cli.guarded(lambda: inspect(a), "nothing was changed")


def inspect(a) -> int:
  meta = dataset.DatasetMeta.load(a.dir)
  print(f"dataset {a.dir}: {meta.name}, seq_len {meta.seq_len}, vocab {meta.vocab_size}, "
        f"kind {meta.raw.get('kind')}, packing {meta.raw.get('packing')}")
  for split, info in meta.splits.items():
    size = sum(s["bytes"] for s in info["shards"])
    print(f"  {split:<10} {info['records']:>10,} sequences in {len(info['shards'])} shards, "
          f"{size / 1e6:,.1f} MB")
  spath = os.path.join(a.dir, dataset.STATS)
  if os.path.exists(spath):
    with open(spath) as f:
      st = json.load(f)
    keys = ("input_bytes", "output_bytes", "reduction_pct", "tokens", "pad_fraction",
            "unk_rate_validation", "wall_seconds", "mb_per_s_per_core")
    print("  stats: " + ", ".join(f"{k}={st[k]}" for k in keys if k in st))
  rc = 0
  if a.verify:
    problems = meta.verify(checksums=True)
    for prob in problems:
      print(f"FAIL {prob}")
    n = sum(len(i["shards"]) for i in meta.splits.values())
    print(f"verify: {n - len(problems)}/{n} shards OK" if not problems else
          f"verify: {len(problems)} problem(s)")
    rc = 1 if problems else 0
  if a.show:
    from array_record.python import array_record_module

    tok, paths = _show_sources(meta)
    rng = np.random.default_rng(a.seed)
    for _ in range(a.show):
      path = paths[rng.integers(len(paths))]
      reader = array_record_module.ArrayRecordReader(path, "readahead_buffer_size:0")
      i = int(rng.integers(reader.num_records()))
      ids = dataset.decode_record(reader.read([i])[0], meta.seq_len, f"{path}[{i}]")
      reader.close()
      n = int(np.count_nonzero(ids != meta.pad_id))
      print(f"--- {os.path.basename(path)} record {i}: {n} tokens")
      print(tok.decode(ids[:n].tolist(), skip_special_tokens=False))
  return rc


if __name__ == "__main__":
  sys.exit(main())
