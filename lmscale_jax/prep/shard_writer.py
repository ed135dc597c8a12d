"""Pass 3 of data preparation on one node: corpus chunks → pieces (~4 MB each, at line ends)
→ tokenized and packed by a pool of workers (``tokenize_pack``), each writing its piece to disk
→ shards of a fixed record count, each written by a worker (``packed_pieces``). Pieces and
shards finished by an earlier run (their sidecars present) are not redone. What no later step
reads is removed as the pass goes: a chunk once its pieces are packed, a piece's sequences once
the shards that take them are written (finalize removed all of it at the end, one process
unlinking while the other cores idled: 0.07 s of a 3.2 s two-worker run, 21 MB of code)."""

from __future__ import annotations

import contextlib
import json
import os

from lmscale_jax import progress
from lmscale_jax.prep import packed_pieces, tokenize_pack
from lmscale_jax.prep.options import PrepareOptions
from lmscale_jax.store import dataset, file_io
from lmscale_jax.store import tokenizer as toklib

TOKENIZE_BATCH = tokenize_pack.TOKENIZE_BATCH

# Pass 3's task: about this many bytes of a corpus chunk, ending at a line end. Measured: with
# whole 32 MB chunks as the tasks, two workers tokenized this machine's corpus no faster than
# one (2.63 vs 2.55 s: one chunk held most of it).
PIECE_BYTES = 4 << 20
PIECE_LIST = "pieces.json"  # in the work directory: the pieces of this preparation


def pieces(chunks: list[str], piece_bytes: int | None = None) -> list[tuple[str, int, int]]:
  """(chunk, start, end) byte ranges of about ``piece_bytes`` (``PIECE_BYTES``) covering every
  chunk, each ending at a line end. They depend only on the chunks' bytes, so the output is the
  same for any number of workers."""
  piece_bytes = piece_bytes or PIECE_BYTES
  out = []
  for path in chunks:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      start = 0
      while start < size:
        f.seek(min(start + piece_bytes, size))
        f.readline()  # on to the end of the line the boundary falls in
        end = min(f.tell(), size)
        out.append((path, start, end))
        start = end
  return out


def piece_list(work: str, chunks: list[str]) -> list[tuple[str, int, int]]:
  """:func:`pieces` of the chunks, computed once (by pass 2, or pass 3 where a tokenizer is
  given) and kept in ``work``: pass 3 removes each chunk once its pieces are packed, so a rerun
  takes the pieces from here, not from the chunks."""
  path = os.path.join(work, PIECE_LIST)
  try:
    with open(path) as f:
      return [(os.path.join(work, name), start, end) for name, start, end in json.load(f)]
  except FileNotFoundError:
    pass
  out = pieces(chunks)
  file_io.atomic_write_json(path, [[os.path.relpath(p, work), s, e] for p, s, e in out])
  return out


def _remove(path: str) -> None:
  with contextlib.suppress(FileNotFoundError):  # a rerun's: an earlier run removed it
    os.unlink(path)


def _piece_lines(path: str, start: int, end: int):
  """The corpus lines of one piece, in batches of TOKENIZE_BATCH."""
  with open(path, "rb") as f:
    f.seek(start)
    # split("\n"), not splitlines(): a document's text may hold other line separators
    lines = [line + "\n" for line in f.read(end - start).decode("utf-8").split("\n")[:-1]]
  for i in range(0, len(lines), TOKENIZE_BATCH):
    yield lines[i:i + TOKENIZE_BATCH]


def write_shards(o: PrepareOptions, work: str, chunks: list[str], tok, pmap) -> dict:
  """Pass 3 on ``pmap`` (``worker_pool.ordered_map``'s). The result's ``seconds``:
  ``tokenize``, ``pack`` and ``write`` (records into shards), each summed over the workers."""
  special = toklib.validate(tok, "tokenizer")
  tasks = piece_list(work, chunks)
  seconds = {"tokenize": 0.0, "pack": 0.0, "write": 0.0}
  init = (os.path.join(work, dataset.TOKENIZER), o.kind, o.seq_len, o.packing, o.val_fraction)
  os.makedirs(os.path.join(work, packed_pieces.PIECES), exist_ok=True)
  last_piece = {chunk: i for i, (chunk, _, _) in enumerate(tasks)}
  counts = []
  for i, info in enumerate(progress.over(
      pmap(packed_pieces.pack_piece, [(packed_pieces.piece_base(work, i), _piece_lines, piece,
                                       init) for i, piece in enumerate(tasks)]),
      o.progress, total=len(tasks), unit="piece", desc="tokenize+pack")):
    packed_pieces.add_seconds(seconds, info["seconds"])
    counts.append(info)
    if last_piece[tasks[i][0]] == i:  # results come in order: the chunk's pieces are packed
      _remove(tasks[i][0])
  shards = packed_pieces.shard_tasks(work, counts,
                                     packed_pieces.records_per_shard(o.seq_len, o.shard_size_mb),
                                     o.compression)
  read_last = packed_pieces.read_last_by(shards)
  infos = []
  for k, info in enumerate(progress.over(pmap(packed_pieces.write_shard, shards), o.progress,
                                         total=len(shards), unit="shard", desc="shards")):
    packed_pieces.add_seconds(seconds, {"write": info.pop("seconds", 0.0)})
    infos.append(info)
    for path in read_last.get(k, ()):  # this shard and every one before it are written
      _remove(path)
  return packed_pieces.result(counts, shards, infos, special,
                              tok.get_vocab_size(with_added_tokens=True), seconds)
