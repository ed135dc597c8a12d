"""The functions of an index most like a query function (cosine search).

  lmscale search --index INDEX_DIR (--workdir RUN [--step N] | --hf DIR)
      (--elf FILE [--function NAME | --address 0xADDR] | --text "push rbp [NEXT] …")
      [--k 10] [--exact] [--json OUT]

A query is every named function of an ELF file, one of them, or text: normalised instructions,
or an objdump -d listing (`objdump -d bin | lmscale search … --text -`: each function in it,
re-decoded from its bytes as preparation decodes them; search/listing.py);
the answer is, per query, the k best: score (cosine), binary, function name and address, as
rows and (--json) as a JSON file. Functions whose normalised text is the same score the same
(which of them ranks first is arbitrary): each result says so, `= query` (the query's own
text) or `= #R` (the text of the result ranked R), in the JSON "same_text_as_query" and
"same_text_as" (null where the index, written before text digests were kept, cannot tell). An
encoder not fine-tuned for similarity (MLM pretraining only) scores unrelated functions near 1:
one warning line on stderr, and "warning" in the JSON, says so and names the fine-tuned route.
The model must be the one that built the index. A query
longer than the model's sequence length is cut (the model sees its first tokens, as it sees an
indexed function's): a line above its rows says how many tokens were used and how many dropped,
and the JSON has "cut", "tokens" (used) and "dropped" per query. The search is exact up to
the index size lmscale_jax/search/vector_search.py names (measured), approximate above it (an
HNSW graph kept in the index directory; the answer says so, with the recall@10 measured on the
index's own rows); --exact: exact at every size.
"""

from __future__ import annotations

import argparse
import os
import sys

from lmscale_jax.cli import args
from lmscale_jax.search import listing
from lmscale_jax.store import output_marks, user_text

TOOL = "lmscale search"  # the parser's prog, and the mark its --json carries


def address(text: str) -> int:
  try:
    return int(text, 16)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected a hexadecimal address (0x401000)")


def with_dropped(model, answers: list, queries: list) -> list:
  """Each answer with ``dropped``: the tokens of its query past the model's sequence length
  (0 where it was not cut); the model saw the first ``tokens`` of ``tokens + dropped``."""
  for a, (_, _, text) in zip(answers, queries):
    full = len(model.tokenizer.encode(text).ids) - 2  # [CLS] text [SEP], as encode counts
    a["dropped"] = full - a["tokens"] if a["cut"] else 0
  return answers


def same_text(result: dict) -> str:
  """A result's mark: ``= query`` (its normalised text is the query's), ``= #R`` (it is that of
  the result ranked R: search/query.mark_same_text), or ""."""
  if result.get("same_text_as_query"):
    return "= query"
  return f"= #{result['same_text_as']}" if result.get("same_text_as") else ""


def table(answers: list, seq_len: int, recall: float | None = None) -> str:
  """The answers as rows: query, rank, score, same text (:func:`same_text`), function @
  address, binary; a cut query's line says how much of it the model saw; ``recall``: the search
  was approximate, with that recall@10."""
  lines = [f"{'query':<24} {'rank':>4} {'score':>8} {'same':<7}  function @ address  binary"]
  if recall is not None:
    lines.insert(0, f"# approximate search (HNSW graph, recall@10 {recall:.3f} measured on the "
                 "index's own rows); --exact: the exact answer")
  for a in answers:
    if a["cut"]:
      lines.append(f"# {a['query']}: cut to the model's sequence length ({seq_len} tokens): "
                   f"its first {a['tokens']} tokens used, {a['dropped']} dropped")
    for rank, r in enumerate(a["results"], 1):
      lines.append(f"{a['query'][:24]:<24} {rank:>4} {r['score']:>8.4f} "
                   f"{same_text(r):<7}  {r['function']} @ {r['address']:#x}  "
                   f"{os.path.basename(r['binary'])}")
  return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog=TOOL, description=__doc__.splitlines()[0])
  p.add_argument("--index", required=True, metavar="INDEX_DIR", help="what lmscale index wrote")
  args.add_model_source(p)
  p.add_argument("--elf", default=None, type=args.input_file, metavar="FILE")
  which = p.add_mutually_exclusive_group()
  which.add_argument("--function", default=None, metavar="NAME", help="(--elf) one function")
  which.add_argument("--address", default=None, type=address, metavar="0xADDR",
                     help="(--elf) the function at this address")
  p.add_argument("--text", default=None, type=args.text, help="normalised instructions ([NEXT] "
                 "between them, or one a line), or an objdump -d listing (its functions, "
                 "re-decoded from its bytes); - reads it from standard input")
  p.add_argument("--k", type=args.number(int, 1, 1 << 20), default=10)
  p.add_argument("--exact", action="store_true", help="exact search at every index size "
                 "(default: approximate above a measured size)")
  p.add_argument("--json", default=None, type=args.output_file, metavar="OUT")
  return p


def main(argv=None) -> int:
  parser_ = parser()
  a = parser_.parse_args(argv)
  if (a.elf is None) == (a.text is None):
    parser_.error("give --elf FILE or --text TEXT (one of them)")
  if a.elf is None and (a.function is not None or a.address is not None):
    parser_.error("--function and --address pick a function of --elf FILE")

  def go() -> int:
    from lmscale_jax.inference import trained_model  # JAX: not for --help (~1.3 s)
    from lmscale_jax.search import query

    # The query first: a bad --elf or --function is one line before the model is restored.
    queries = (query.elf_queries(a.elf, a.function, a.address) if a.elf is not None
               else listing.queries(user_text.read_stdin("--text - (standard input)")
                                    if a.text == "-" else a.text))
    model = trained_model.load(a.workdir, a.hf, a.step, a.tokenizer)
    corpus = query.load(a.index, model)
    corpus.exact = a.exact
    answers = with_dropped(model, query.search(model, corpus, queries, a.k), queries)
    searcher = corpus.prepared()  # built by the search: whether it was approximate
    recall = searcher.recall if searcher.approximate else None
    warning = query.similarity_warning(model)
    if warning:
      print(f"warning: {warning}", file=sys.stderr)
    print(table(answers, model.cfg.seq_len, recall))
    if a.json:
      output_marks.write_json(a.json, TOOL, {
          "index": a.index, "k": a.k, "exact": recall is None, "recall_at_10": recall,
          "seq_len": model.cfg.seq_len, "warning": warning, "queries": answers})
    return 0

  return args.guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
