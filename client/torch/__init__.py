"""PyTorch training state through tierckpt: save exactly, register, resume exactly.

Needs the ``torch`` extra (``pip install 'tierckpt[torch]'``: torch,
safetensors, numpy); nothing else in ``tierckpt.client`` imports torch.

One checkpoint is a directory on the node's local SSD::

    step-N/model.safetensors    the model's state_dict, its own keys (any safetensors tool reads it)
           state.safetensors    every other tensor: optimizer moments, RNG states, …
           state.json           everything else: step, epoch, optimizer/scheduler structure,
                                data-loader position, Python/NumPy RNG states, extra
           objects.pt           only when something is neither JSON nor a tensor (torch.save)

written in a hidden staging directory, fsynced and renamed into place (the
agent never sees half a checkpoint), then registered with one HTTP call
(``write_seconds`` = the stall the trainer paid). The agent uploads it in the
background.

Exact resume needs every source of randomness back: Python's ``random``,
NumPy's global generator, torch's CPU (and CUDA) generators, plus any
generator the caller passes by name (``torch.Generator``, ``random.Random``,
``numpy.random.Generator``/``RandomState``), and the data-loader position
(:class:`ResumableLoader` wraps a ``DataLoader`` whose shuffling uses a
seeded generator).

:class:`TorchCheckpointer` does both directions for a training loop;
``restore_latest()`` asks the service for the latest valid checkpoint, loads
it straight from the T0 copy when this node still holds a verified one,
otherwise downloads a verified copy from the nearest region, and returns the
step to continue from. :func:`save_distributed` / :func:`restore_distributed`
do the same for ``torch.distributed.checkpoint`` (DCP): every rank writes its
part into its own directory and registers it as its rank; a restore brings
all ranks' files back into one directory, where DCP finds ``.metadata`` and
every ``__R_0.distcp``; :func:`save_distributed_async` stalls only for
DCP's staging copy (``async_save``) and registers each rank's part once
written.

Restoring trusts the checkpoint as much as ``torch.load(weights_only=False)``
would, but only for ``objects.pt`` (absent unless the state held arbitrary
objects); tensors and JSON never run code. Checkpoints come from the service,
SHA-256 verified.
"""

from .._node import default_node
from .checkpoint_dir import (
    FORMAT,
    MODEL_FILE,
    OBJECTS_FILE,
    RESTORE_PREFIX,
    STAGING_PREFIX,
    STATE_FILE,
    TENSORS_FILE,
    Stateful,
    TrainingState,
    load_state,
    save_state,
    write_state,
)
from .checkpointer import Restored, TorchCheckpointer
from .dcp import (
    DistributedRestored,
    PendingSave,
    latest_distributed,
    restore_distributed,
    restore_distributed_report,
    save_distributed,
    save_distributed_async,
)
from .loader import ResumableLoader
from .rng import capture_rng, restore_rng

__all__ = [
    "FORMAT",
    "MODEL_FILE",
    "OBJECTS_FILE",
    "RESTORE_PREFIX",
    "STAGING_PREFIX",
    "STATE_FILE",
    "TENSORS_FILE",
    "DistributedRestored",
    "PendingSave",
    "Restored",
    "ResumableLoader",
    "Stateful",
    "TorchCheckpointer",
    "TrainingState",
    "capture_rng",
    "default_node",
    "latest_distributed",
    "load_state",
    "restore_distributed",
    "restore_distributed_report",
    "restore_rng",
    "save_distributed",
    "save_distributed_async",
    "save_state",
    "write_state",
]
