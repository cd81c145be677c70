"""The typer options (and their help) that several commands share, defined once: a command adds e.g.
``model: str = MODEL_OPTION, dtype: str = DTYPE_OPTION, device_map: str = DEVICE_MAP_OPTION`` and passes them on
as ``load_model(model, dtype=dtype, device_map=device_map)``."""

from __future__ import annotations

from collections.abc import Callable

import typer
from typer.models import OptionInfo

MODEL_HELP = "Model: smollm2 (default), gemma3-270m, minilm, tiny:<family>, a transformers folder or a .gguf file."

DTYPE_HELP = ("Dtype the model runs in: float32 (default, exact), bfloat16 or float16 (lenscope still computes in "
              "float32; verify's tolerances scale with the dtype's precision).")
DEVICE_MAP_HELP = ("Split the model across devices with accelerate: auto, balanced, sequential, a JSON object "
                   "{module: device} (devices: 0, cuda:1, cpu, disk) or a JSON file holding one.")

DTYPE_OPTION = typer.Option(None, "--dtype", help=DTYPE_HELP, metavar="bfloat16|float16|float32")
DEVICE_MAP_OPTION = typer.Option(None, "--device-map", help=DEVICE_MAP_HELP, metavar="MAP")
MODEL_OPTION = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP)
JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object.")
SAVE_OPTION = typer.Option(None, "--save", help="Save the result (.safetensors) to reload later.")
FOIL_DECOMPOSE_OPTION = typer.Option(None, "--foil", "-f", help="Foil token: decompose target minus foil.")
IG_STEPS_OPTION = typer.Option(None, "--steps", help="Integrated gradients: quadrature steps (default 16).")
SEQ_LEN_OPTION = typer.Option(None, "--seq-len", help="Tokens per sequence of text (default: 256, or the model's "
                                                     "context when that is shorter).")
EVAL_PART_OPTION = typer.Option("eval", "--part", help="eval (last 20% of the file, default), train or all.")
SOURCE_OPTION = typer.Option(None, "--source", help=(
    "Encoder-decoder models (T5, BART, mBART, ...): the source text; the text argument is then the target prefix."))
# the training commands (lens train, dict train)
RESUME_OPTION = typer.Option(False, "--resume", help="Continue an interrupted run from its checkpoint in --out.")
SEED_OPTION = typer.Option(0, "--seed")
JSON_SUMMARY_OPTION = typer.Option(False, "--json", help="Print a JSON summary.")
# the commands that estimate their memory first (graph, dict train, dict eval; lenscope.memory)
MAX_MEMORY_OPTION = typer.Option(None, "--max-memory", metavar="SIZE", help=(
    "Memory budget, e.g. 8GB or 500MB (default: 0.8 of the memory available now). The command estimates its peak "
    "first and refuses in one line, naming what to lower, when the estimate exceeds it."))


class _TableOption(OptionInfo):
    """An option whose help, metavar and default may be functions, called each time the command line is built."""

    help = property(lambda self: self._read("help"), lambda self, value: None)
    metavar = property(lambda self: self._read("metavar"), lambda self, value: None)
    default = property(lambda self: self._read("default"), lambda self, value: None)

    def _read(self, what: str):
        v = self._of[what]
        return v() if callable(v) else v


def table_option(default, *decls: str, help: Callable[[], str], metavar: Callable[[], str] | None = None,
                 **kw) -> OptionInfo:
    """A typer option whose ``help`` (and ``metavar``, and ``default`` when it is a function) come from a table of
    kinds (the attribution methods, the steering direction builders) each time the command line is built, so that
    a kind registered after this module was imported is listed too. The functions import their table inside (it
    must import no torch: ``--help``)."""
    info = typer.Option(None, *decls, **kw)
    out = _TableOption.__new__(_TableOption)
    out.__dict__.update(info.__dict__)
    out._of = {"help": help, "metavar": metavar, "default": default}
    return out
