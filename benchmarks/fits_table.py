"""Writes docs/memory.md's "What fits my card" table: train()'s planner on each card of hardware.CARDS, presented
(lowmem_aitextgen/cards.py; estimates only, nothing downloaded or trained).

    python benchmarks/fits_table.py          # rewrites the table between its markers in docs/memory.md
    python benchmarks/fits_table.py --print  # prints it

tests/test_cards.py checks that docs/memory.md holds exactly what this writes.
"""

from __future__ import annotations

import os
import sys

DOCUMENT = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "memory.md")
START, END = "<!-- fits-table: benchmarks/fits_table.py -->", "<!-- /fits-table -->"


def with_table(document: str, table: str) -> str:
    before, rest = document.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{table}\n{END}{after}"


def main() -> None:
    from lowmem_aitextgen.cards import fits_table

    table = fits_table()
    if "--print" in sys.argv:
        print(table)
        return
    with open(DOCUMENT, encoding="utf-8") as f:
        text = f.read()
    with open(DOCUMENT, "w", encoding="utf-8") as f:
        f.write(with_table(text, table))


if __name__ == "__main__":
    main()
