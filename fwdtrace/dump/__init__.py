"""HDF5 dumps of every module call in one training step, and their comparison.

Layout (one file per registration): ``{directory}/{epoch}-epoch_{step}-step_dump.hdf5``
(``..._rank{r}_dump.hdf5`` under ``torch.distributed``), one group per module call named
``{NNN}_{ClassName}`` in call order, holding datasets ``input0``, ``output0``,
``grad_input0``, ``grad_output0``, ... A call of a function hooked by path (``hook_forward``,
``register_atomic``) is a group of its own, ``{NNN}_{function_name}``, keyed as its graph node
(``module_key`` ``"model.layers.0.self_attn.eager_attention_forward"``, ``function`` its path). Each tensor is written when its hook fires, never
gathered in memory first. A statistics dump instead keeps its step's vectors (a few hundred bytes
each) and writes them when it closes as one matrix, ``statistics`` (a row per tensor, in the order
written), and one JSON index, ``statistics_index`` (the calls with their attributes, the rows'
group, tensor name, shape and dtype); the reader shows them as the groups and datasets above.
h5py is imported only here, when a dump is made or read.

A dump is written under a temporary name in its folder (``{name}.partial-{random}``) and
renamed when it is closed; its attributes say whether the step completed (``complete``,
``forward_finished``, ``backward_finished``, ``status``), so a cut-short dump never reads as whole.
Reading treats every file as untrusted: only plain datasets inside the file are read.
"""

from .cli import run_cli
from .compare import compare_dumps
from .layout import MATH_PREFIX as MATH_PREFIX
from .overflow import Overflow, OverflowReport, find_overflow
from .ranks import RanksReport, compare_ranks
from .reader import read_dump
from .record import Dumper
from .report import Divergence, DumpReport, DumpRow

__all__ = ["Dumper", "read_dump", "compare_dumps", "compare_ranks", "find_overflow", "DumpReport", "DumpRow",
           "Divergence", "Overflow", "OverflowReport", "RanksReport", "run_cli"]
