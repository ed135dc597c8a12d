"""Text corpus (.txt / .jsonl) → dataset: documents tokenized and packed into shards.

  python tools/prepare_text.py --input corpus.jsonl --text-field text --output data/text
"""
import sys

import _cli

if __name__ == "__main__":
  sys.exit(_cli.run("text"))
