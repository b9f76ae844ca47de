"""The lesson notebooks as files: where they are, which are lessons, and what a saved one keeps.

Shared by ``runner`` (which executes them) and ``edition`` (which builds the Arabic edition),
so that neither imports the other for these.
"""

from __future__ import annotations

from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"  # this tooling lives beside them
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def lessons(folder: Path = NOTEBOOKS) -> list[Path]:
    return sorted(folder.glob("[0-9][0-9]_*.ipynb"))


WIDGET = "application/vnd.jupyter.widget-view+json"


def clean(notebook, root: Path = NOTEBOOKS.parent, home: Path | None = None) -> None:
    """Keep what a reader needs (tags, hidden sources); drop timings, machine details and
    widget views (a widget lives in its kernel: saved, a reader sees an error or its repr).

    The paths of the machine that ran it become ones a reader can place: this checkout's
    ``root`` reads ``<clone>`` and the ``home`` folder ``~``, in every text an output holds
    (printed lines, values, tracebacks)."""
    home = Path.home() if home is None else home
    mine = [(f"{root}/", "<clone>/"), (f"{home}/", "~/")]  # the clone may be inside home

    def anonymous(text):
        if isinstance(text, list):
            return [anonymous(t) for t in text]
        if isinstance(text, str):
            for path, name in mine:
                text = text.replace(path, name)
        return text

    notebook.metadata = {
        "kernelspec": dict(KERNELSPEC),
        "language_info": {"name": "python", "pygments_lexer": "ipython3"},
    }
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("collapsed", None)
        cell.metadata.pop("scrolled", None)
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if WIDGET not in o.get("data", {})]
            for output in cell.outputs:
                for key in ("text", "evalue", "traceback"):
                    if key in output:
                        output[key] = anonymous(output[key])
                for kind, value in output.get("data", {}).items():
                    if kind.startswith("text/"):
                        output["data"][kind] = anonymous(value)
