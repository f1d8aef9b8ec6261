"""`lowmem_aitextgen serve` on a slow machine, made so: every decoding step waits SECONDS first.

    python serve_slowly.py SECONDS serve FOLDER --flag=value ...
"""

import sys
import time

from lowmem_aitextgen import cli
from lowmem_aitextgen.generation.engine import Engine

SECONDS = float(sys.argv[1])
step = Engine.step


def slow_step(self: Engine) -> list:
    time.sleep(SECONDS)
    return step(self)


Engine.step = slow_step
cli.main(sys.argv[2:])
