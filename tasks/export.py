"""Export: a stored RL version as a peft / diffusers / transformers folder (``unirl_core.runs.export``), one task.

It builds the model from the version's config on the CPU (the export does not need a GPU) and writes through fsspec,
so it runs on the train image in a CPU pod sized for a whole pipeline in memory (SD3.5-M with its T5 encoder in
bf16: ~15 GB of weights, held once); declared, not measured on a cluster. Not cached: it reads the store, whose
content the inputs do not name.
"""

from __future__ import annotations

import html
import json

from flytekit import Resources, task

from images import train_image
from tasks.common import DECK, SMALL_TIMEOUT, deck

EXPORT_TASK = dict(requests=Resources(cpu="4", mem="32Gi"), limits=Resources(mem="48Gi"))


@task(container_image=train_image, **EXPORT_TASK, retries=2, timeout=SMALL_TIMEOUT * 3, **DECK)
def export_task(source: str, out: str, fmt: str = "", ema: bool = False) -> str:
    """Write ``source`` (a version folder ``<root>/<run>/step-XXXXXXXX``, or a run folder: its latest version) to
    ``out`` (a path or fsspec URL) as ``fmt`` (``peft`` | ``diffusers`` | ``transformers``; "" picks peft for a LoRA
    run, else the family's full format); ``ema``: the version's EMA weights. Returns ``out``."""
    import fsspec

    from unirl_core.models.export import EXPORT_MARKER
    from unirl_core.runs.export import export_version

    written = export_version(source, out, fmt or None, ema=ema, device="cpu")
    with fsspec.open(f"{written.rstrip('/')}/{EXPORT_MARKER}", "r") as f:
        marker = json.load(f)
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(marker[k]))}</td></tr>"
                   for k in ("format", "weights", "run", "step", "version_uri") if k in marker)
    deck("export", f"<p>{html.escape(written)}</p><table>{rows}</table>")
    return written
