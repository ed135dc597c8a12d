"""Binary-code corpus → dataset: ELF functions, disassembled and normalised, packed into shards.

  python tools/prepare_binary.py --input /usr/lib/x86_64-linux-gnu /usr/bin --output data/bin
"""
import sys

import _cli

if __name__ == "__main__":
  sys.exit(_cli.run("binary"))
