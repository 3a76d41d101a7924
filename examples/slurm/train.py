"""examples/torch_train.py for Slurm: every checkpoint's metadata records the
Slurm job (SLURM_JOB_ID, SLURM_RESTART_COUNT, ...), so a requeued job's
checkpoints show which life wrote them; the restart is also in the lineage
(the first checkpoint after a restore has the restored one as parent, set by
the client automatically).

SIGUSR1 (what `#SBATCH --signal=B:USR1@90` sends to the batch shell, which
forwards it here) and SIGTERM trigger PreemptionGuard: an urgent checkpoint.
Same arguments as examples/torch_train.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch_train

from tierckpt.client.torch import TorchCheckpointer

SLURM_KEYS = (
    "SLURM_JOB_ID",
    "SLURM_RESTART_COUNT",
    "SLURM_JOB_NAME",
    "SLURM_JOB_NODELIST",
    "SLURM_CLUSTER_NAME",
)


def slurm_metadata() -> dict[str, Any]:
    found: dict[str, Any] = {key: os.environ[key] for key in SLURM_KEYS if key in os.environ}
    if "SLURM_JOB_ID" in found:
        # Slurm leaves SLURM_RESTART_COUNT unset before the first requeue.
        found["SLURM_RESTART_COUNT"] = int(found.get("SLURM_RESTART_COUNT", 0))
    return found


class SlurmCheckpointer(TorchCheckpointer):
    def save(self, step: int, **kwargs: Any) -> Any:
        kwargs["metadata"] = {**slurm_metadata(), **(kwargs.get("metadata") or {})}
        return super().save(step, **kwargs)


if __name__ == "__main__":
    torch_train.TorchCheckpointer = SlurmCheckpointer  # type: ignore[misc]
    sys.exit(torch_train.main())
