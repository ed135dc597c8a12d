"""Summarise, verify or decode a prepared dataset directory.

  lmscale inspect-data DIR [--verify] [--show N]
"""

from __future__ import annotations

import json
import os
import sys

from lmscale_jax.cli import args
import numpy as np

from lmscale_jax.store import dataset, file_io, records


def _show_sources(meta):
  """The tokenizer and the train split's records --show reads, each checked first: a missing
  file or an empty split is one line naming it, not a traceback from deep in a reader."""
  from tokenizers import Tokenizer

  tpath = os.path.join(meta.path, dataset.TOKENIZER)
  if kind := file_io.not_regular(tpath):
    raise dataset.DatasetError(f"{tpath} is {kind}: expected the dataset's tokenizer.json")
  if not os.path.isfile(tpath):
    raise dataset.DatasetError(f"{tpath}: missing; --show decodes with the dataset's tokenizer")
  try:
    tok = Tokenizer.from_file(tpath)
  except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
    raise dataset.DatasetError(f"{tpath}: not a Hugging Face tokenizer.json ({e})") from None
  args.check_split(meta, "train")
  if not meta.num_records("train"):
    raise dataset.DatasetError(f"{meta.path}: the train split has no records to show")
  # The loader's reader: a record that cannot be read is one line naming shard and record.
  return tok, records.ShardRecords(meta, "train")


def show(meta, n: int, seed: int) -> None:
  """``n`` random records of the train split, decoded back to text."""
  tok, reader = _show_sources(meta)
  rng = np.random.default_rng(seed)
  for _ in range(n):
    i = np.array([rng.integers(len(reader))])
    try:
      ids = reader.decode(reader.read(i), i, meta.vocab_size)[0]
    except dataset.DatasetError as e:
      raise dataset.DatasetError(
          f"{e} (lmscale inspect-data --verify checks every shard)") from None
    count = int(np.count_nonzero(ids != meta.pad_id))
    print(f"--- {reader.where(int(i[0]))}: {count} tokens")
    print(tok.decode(ids[:count].tolist(), skip_special_tokens=False))


def main(argv=None) -> int:
  p = args.Parser(prog="lmscale inspect-data", description=__doc__.splitlines()[0])
  p.add_argument("dir")
  p.add_argument("--verify", action="store_true", help="re-check record counts and sha256")
  p.add_argument("--show", type=args.number(int, 0, 1 << 20), default=0, metavar="N",
                 help="decode N random sequences back to pretokens/text")
  p.add_argument("--seed", type=args.number(int, 0, 1 << 62), default=0)
  a = p.parse_args(argv)
  return args.guarded(lambda: inspect(a), "nothing was changed")


def stats_line(spath: str) -> str:
  """stats.json's main numbers; it is informative only, so a damaged one is said, not fatal."""
  if kind := file_io.not_regular(spath):
    return f"  stats: {spath} is {kind}, not a file"
  try:
    with open(spath) as f:
      st = json.load(f)
  except (OSError, ValueError) as e:
    return f"  stats: {spath} unreadable ({file_io.error_reason(e)})"
  keys = ("input_bytes", "output_bytes", "reduction_pct", "tokens", "pad_fraction",
          "unk_rate_validation", "wall_seconds", "mb_per_s_per_core")
  shown = [f"{k}={st[k]}" for k in keys if k in st] if isinstance(st, dict) else []
  return "  stats: " + (", ".join(shown) or f"{spath} holds none of {', '.join(keys)}")


def inspect(a) -> int:
  meta = dataset.DatasetMeta.load(a.dir)
  print(f"dataset {a.dir}: {meta.name}, seq_len {meta.seq_len}, vocab {meta.vocab_size}, "
        f"kind {meta.raw.get('kind')}, packing {meta.raw.get('packing')}")
  for split, info in meta.splits.items():
    size = sum(s["bytes"] for s in info["shards"])
    print(f"  {split:<10} {info['records']:>10,} sequences in {len(info['shards'])} shards, "
          f"{size / 1e6:,.1f} MB")
  spath = os.path.join(a.dir, dataset.STATS)
  if os.path.lexists(spath):
    print(stats_line(spath))
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
    show(meta, a.show, a.seed)
  return rc


if __name__ == "__main__":
  sys.exit(main())
