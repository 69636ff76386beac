"""After a finding, something to hand upstream: the first divergent unit of a comparison (a
decoder layer, the embedding, or the head) written as a standalone case that runs without
llama-parity (docs/repro.md).

    report = compare.compare_models("torchref", my_port, folder, policy="fp32")
    compare.write_repro(report, "torchref", my_port, folder, "case-dir")
    # then, anywhere with numpy:  python case-dir/repro.py

write.py captures the unit on both sides and writes the files; summary.py reads what it needs
from a report (a Report or its untrusted JSON); case.py is the standalone script, copied into
the case as repro.py (it imports numpy only, and nothing here imports it).
"""

from .summary import Recipe, ReproError, Summary, recipe, summarize
from .write import FILES, Repro, Unit, case_folder, unit_of, write_repro

__all__ = ["FILES", "Recipe", "Repro", "ReproError", "Summary", "Unit", "case_folder", "recipe", "summarize",
           "unit_of", "write_repro"]
